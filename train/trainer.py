"""The training loop of every draft method (:class:`Trainer`: setup, train step, after step), on accelerate.

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
  skipped steps too (it follows the optimizer-step count). With offline shards the non-finite
  hidden states are counted per shard on the device too (:class:`NonFiniteShards`), read with
  those counters: a warning names each bad shard once, the stops name the first, and a run none
  of whose steps was applied stops at its end without a checkpoint.
- ``train.max_time_minutes`` is checked at logging steps (the clock is shared across ranks then).
- The code that may wait for the device is marked with :func:`host_work` (logging, checkpoint,
  validation, data loading on the CPU); ``tests/integration/test_host_sync.py`` counts syncs outside it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
from torch.utils.data import DataLoader

from ..data_prep.shards import ShardReader
from ..layout import RunLayout
from ..models.common import compile_regions, resolve_attention_backend, resolve_compile
from .data import SEQUENCE_KEY, BatchCollator, SourceTagged, collate, recompute_hint, to_device
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
from .activation_checkpointing import apply_recipe_checkpointing
from .losses import set_fused_loss
from .packing import PackedDataset, collate_packed, length_bucket
from .run_info import run_metadata
from .sampler import LengthGroupedBatches
from .validation import (
    IndexedSubset,
    ValidationSpec,
    dataset_ids,
    run_validation,
    split_by_conversation,
    validation_batches,
)

NO_ATTENTION_METHODS = ("medusa", "mlp_speculator")  # per-position heads: no attention backend

log = logging.getLogger("draftsmith.train")

class DraftMethod(Protocol):
    """Every hook the :class:`Trainer` calls on a method, in the order it first calls them."""

    name: str

    def batch_plan(self) -> Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None:
        """Optional (looked up with ``getattr``): a picklable function run on every collated CPU
        batch in the DataLoader workers; what it returns is merged into the batch (CPU tensors
        moved to the device with the batch, python values left as they are). The trainer adds
        ``num_tokens`` (python int) itself."""

    def dataset(self) -> torch.utils.data.Dataset:
        """Map-style dataset of sequences with a ``lengths()`` method; items collate with
        :func:`draftsmith.train.data.collate`."""

    def build_model(self) -> torch.nn.Module:
        """The draft, initialised (the trainer applies ``draft.gradient_checkpointing`` to it)."""

    def setup(self, accelerator: Any) -> None:
        """Move frozen helpers (e.g. the target head) to the accelerator's device and keep
        what the loss needs to normalise over all processes (``accelerator.reduce``)."""

    def validation_spec(self) -> ValidationSpec:
        """Optional unless ``data.validation_fraction`` (looked up with ``getattr`` for
        ``train.best_metric``): what validation reports (:class:`~draftsmith.train.validation.ValidationSpec`)."""

    def begin_step(self, step: int) -> None:
        """Called before every micro-batch with the optimizer steps taken so far (resumed runs
        included): for methods whose data change during the run (MLP speculator stage 2)."""

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """Loss (scalar) and per-micro-batch metrics: detached 0-dim tensors on the loss's device
        (or python numbers from host data); no host sync (see the module docstring)."""

    def validation_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """With ``data.validation_fraction``: summed counters of one held-out batch
        (:func:`~draftsmith.train.validation.run_validation`)."""

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
    their steps, ``step``). Does nothing; ``tests/integration/test_host_sync.py`` replaces it to attribute the
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


# parameters Muon never takes even when 2-D: the token embedding and the output head (Keller
# Jordan's Muon convention, which the speculators trainer follows, its PR #746)
MUON_EXCLUDED_NAMES = ("embed_tokens", "lm_head")


def split_muon_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(muon, adamw)``: the trainable parameters of ``model`` that Muon orthogonalises (2-D
    hidden weight matrices with both sides > 1: the fc, attention and MLP projections) and the
    rest, which AdamW keeps (norms, biases, any 1-D tensor, and every parameter whose name
    contains ``embed_tokens`` or ``lm_head``). The split of the speculators trainer (its
    ``--optimizer muon``, PR #746). Frozen parameters are in neither list."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(n in name for n in MUON_EXCLUDED_NAMES)
        (muon if hidden_matrix else adamw).append(p)
    return muon, adamw


def build_optimizers(model: torch.nn.Module, cfg: Any, device: torch.device,
                     ns_dtype: torch.dtype | None = None) -> list[torch.optim.Optimizer]:
    """The optimizers of ``train.optimizer``, stepped in this order every optimizer step:
    ``adamw``: ``[AdamW]`` over every trainable parameter (:func:`build_optimizer`); ``muon``:
    ``[AdamW, Muon]``: torch's ``torch.optim.Muon`` (Keller Jordan's Muon; 5 Newton-Schulz
    steps, momentum 0.95 with Nesterov, ``adjust_lr_fn="match_rms_adamw"`` so its update RMS
    matches AdamW's, Moonshot's "Muon is Scalable for LLM Training") over the 2-D hidden weight
    matrices at ``train.muon_lr`` (null: ``train.lr``) and ``train.muon_weight_decay``, AdamW
    over the rest (:func:`split_muon_params`). Muon is :class:`draftsmith.train.optim.Muon`
    (torch's, its ``state_dict`` too) with the Newton-Schulz iterations in ``ns_dtype`` (None:
    :func:`~draftsmith.train.optim.newton_schulz_dtype` of ``device``: bf16 where it has fast
    bf16, fp32 elsewhere, e.g. a CPU without AVX-512 bf16 / AMX, where torch's bf16 is 22x slower).

    Raises:
        RuntimeError: ``train.optimizer: muon`` on a torch without ``torch.optim.Muon`` (< 2.9).
    """
    if getattr(cfg, "optimizer", "adamw") == "adamw":
        return [build_optimizer([p for p in model.parameters() if p.requires_grad], cfg, device)]
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"train.optimizer: muon needs torch.optim.Muon (torch >= 2.9); this torch is {torch.__version__}")
    muon, adamw = split_muon_params(model)
    optimizers = [build_optimizer(adamw, cfg, device)] if adamw else []
    if muon:
        from .optim import Muon, newton_schulz_dtype

        if ns_dtype is None:
            ns_dtype, why = newton_schulz_dtype(device)
            log.info("Muon: Newton-Schulz iterations in %s (%s)", str(ns_dtype).removeprefix("torch."), why)
        optimizers.append(Muon(muon, lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.muon_weight_decay, momentum=0.95,
                               nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype))
    return optimizers


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


def _step_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer step changes: every parameter of ``optimizer``, then the tensors
    of its per-parameter state (momentum buffers, moments, tensor step counts), in a fixed order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return params + state


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group of ``optimizer`` runs a fused kernel that reads ``found_inf``."""
    return all(group.get("fused") for group in optimizer.param_groups)


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
    leaves parameters, moments and step counts untouched, as with a GradScaler. An optimizer
    without a fused kernel (``torch.optim.Muon``; AdamW on a device with none) is skipped on the
    device too: its parameters and state tensors are copied before the step (one ``_foreach_copy_``
    into buffers kept across steps) and put back after it where the flag is set (``torch.where``),
    so the step costs no host read and, for those optimizers only, one extra copy of their
    parameters and state in memory. State the step creates (the first step's momentum buffer) is
    zeroed where the flag is set.

    Counters (skipped since the last read, skipped in a row, longest run since the last read)
    stay on the device and are read with the metrics (:meth:`absorb`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], device: torch.device,
                 num_processes: int, check_grads: bool = False):
        """``optimizer``: one, or the optimizers of one step (``train.optimizer: muon``: AdamW and
        Muon); the flag is computed (and all-reduced) once per step, by the first hook that runs."""
        optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.optimizer, self.device, self.world, self.check_grads = optimizers[0], torch.device(device), num_processes, check_grads
        self.fused = all(_is_fused(o) for o in optimizers)
        self.bad = torch.zeros((), dtype=torch.float32, device=self.device)
        self.found: torch.Tensor | None = None
        self.hook_ran = False
        self.counters = torch.zeros(3, dtype=torch.float32, device=self.device)
        self._saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # id(optimizer) -> (live, copies)
        for o in optimizers:
            o.register_step_pre_hook(self._before_step)
            if not _is_fused(o):
                o.register_step_post_hook(self._after_step)

    def restore(self, in_a_row: int) -> None:
        self.counters = torch.tensor([0.0, in_a_row, in_a_row], dtype=torch.float32).to(self.device)

    def note_loss(self, loss: torch.Tensor) -> None:
        self.bad.add_(torch.isfinite(loss.detach()).logical_not().float().reshape(()))

    def note_grad_norm(self, norm: torch.Tensor | None) -> None:
        if isinstance(norm, torch.Tensor):
            self.bad.add_(torch.isfinite(norm.detach()).logical_not().float().reshape(()).to(self.device))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.hook_ran:  # a later optimizer of the same step: the flag is known
            flag = self.found
        else:
            flag = self._step_flag(optimizer)
        self.found, self.hook_ran = flag, True
        if _is_fused(optimizer):
            optimizer.found_inf = flag
            return
        live = _step_tensors(optimizer)
        saved = self._saved.get(id(optimizer))
        if saved is None or len(saved[0]) != len(live) or any(a is not b for a, b in zip(saved[0], live)):
            saved = (live, [t.detach().clone() for t in live])  # first step, or the state grew
            self._saved[id(optimizer)] = saved
        else:
            torch._foreach_copy_(saved[1], live)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Put a non-fused optimizer's parameters and state back where the step's flag is set
        (device-side; no host read)."""
        skip = self.found.bool()
        before, copies = self._saved[id(optimizer)]
        kept = {id(t): c for t, c in zip(before, copies)}
        after = _step_tensors(optimizer)
        with torch.no_grad():
            for t, c in zip(before, copies):
                t.copy_(torch.where(skip, c, t))
            for t in after:
                if id(t) not in kept:  # created by this step (Muon's momentum buffer): as if never stepped
                    t.masked_fill_(skip, 0)
        if len(after) != len(before):  # the state grew: copies for it now, so later steps only copy into them
            self._saved[id(optimizer)] = (after, [kept[id(t)] if id(t) in kept else t.detach().clone() for t in after])

    def copies(self) -> list[torch.Tensor]:
        """The copies kept across steps of the non-fused optimizers' parameters and state (empty
        for fused optimizers and before the first step): memory the guard holds."""
        return [c for _, copies in self._saved.values() for c in copies]

    def _step_flag(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """1.0 where this step must be skipped on any rank, else 0.0 (0-dim device tensor)."""
        flag = (self.bad > 0).float()
        if self.check_grads:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                norms = torch.stack([n.to(self.device) for n in torch._foreach_norm(grads)])
                flag = torch.maximum(flag, norms.isfinite().all().logical_not().float())
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

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

    def absorb(self, values: list[float], state: "TrainState", max_in_a_row: int, last_ckpt: Any,
               cause: str | None = None) -> None:
        """Take the counters read on the host (``values``, from :meth:`MetricWindow.read` or
        :meth:`read`) into ``state`` and restart them.

        Raises:
            NonFiniteLossError: ``max_in_a_row`` (``train.max_nonfinite_steps``) steps in a row
                were skipped since the last read; ``cause`` (the first shard with non-finite
                hidden states, :meth:`NonFiniteShards.cause`) is appended.
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
                f"(train.max_nonfinite_steps={max_in_a_row}); last good checkpoint: {last_ckpt}"
                + (f"; {cause}" if cause else ""))

    def read(self) -> list[float]:
        """The counters on the host (checkpoint steps)."""
        return self.counters.tolist()


class NonFiniteShards:
    """Which hidden-state shards hand the trainer non-finite states, counted on the device.

    The training items carry ``sequence_index`` (:class:`~draftsmith.train.data.SourceTagged`);
    :meth:`note` (every micro-batch, before the loss) marks the real tokens whose aux or final
    states are not finite and adds them to a per-shard count, keeping the lowest sequence index
    per shard: a few small kernels, no host read (the guard's reason, see
    :class:`NonFiniteGuard`). The counts ride along with the metrics read at logging and
    checkpoint steps (:meth:`values`); :meth:`absorb` then warns once per shard, naming its file,
    the sequence in it and its record id, and notes it in ``TrainState.nonfinite_shards`` (a
    resumed run does not warn again). :meth:`cause` is the line the trainer's stop adds: the
    lowest-numbered bad shard seen, over every process.
    """

    def __init__(self, reader: Any, device: torch.device):
        self.reader, self.device = reader, torch.device(device)
        self.files = [s["file"] for s in reader.manifest["shards"]]
        number = {f: k for k, f in enumerate(self.files)}
        self.start: dict[str, int] = {}  # file -> index of its first sequence
        for g, (f, _, _) in enumerate(reader.index):
            self.start.setdefault(f, g)
        self.none = len(reader.index)
        self.shard_of = torch.tensor([number[f] for f, _, _ in reader.index], dtype=torch.long).to(self.device)
        self.counts = torch.zeros(len(self.files), dtype=torch.float32, device=self.device)
        self.first = torch.full((len(self.files),), self.none, dtype=torch.long, device=self.device)
        self.reported: dict[str, str] = {}  # shard file -> where in it (host), warned once

    def note(self, batch: dict[str, Any], sequence: torch.Tensor) -> None:
        """Count ``batch``'s non-finite states by shard; ``sequence (B, T)``: each token's sequence
        index. Device work only."""
        bad = None
        for key in ("aux_hidden_states", "final_hidden_states"):
            x = batch.get(key)
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                b = x.isfinite().all(-1).logical_not()
                bad = b if bad is None else bad.logical_or(b)
        if bad is None:
            return
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            bad = bad.logical_and(mask.bool())
        sequence, bad = sequence.reshape(-1), bad.reshape(-1)
        shard = self.shard_of.index_select(0, sequence)
        self.counts.index_add_(0, shard, bad.float())
        self.first.scatter_reduce_(0, shard, sequence.masked_fill(bad.logical_not(), self.none), "amin")

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """``[counts, first]`` as one device tensor of ``dtype`` (read with the metrics)."""
        return torch.cat([self.counts.to(dtype), self.first.to(dtype)])

    def where(self, sequence: int) -> str:
        """``file (sequence k of the shard, id 'x')`` of global sequence index ``sequence``."""
        f = self.reader.index[sequence][0]
        k = sequence - self.start[f]
        ids = self.reader.manifest["shards"][self.files.index(f)].get("ids") or []
        rid = f", id {ids[k]!r}" if k < len(ids) else ""
        return f"{self.reader.dir / f} (sequence {k} of the shard{rid})"

    def absorb(self, values: list[float], state: Any) -> None:
        """Warn once per shard newly seen with non-finite states (``values``: :meth:`values` on
        the host), noting it in ``state.nonfinite_shards``."""
        n = len(self.files)
        for k in range(n):
            if values[k] > 0 and self.files[k] not in self.reported:
                where = self.where(int(values[n + k]))
                self.reported[self.files[k]] = where
                state.nonfinite_shards[self.files[k]] = where
                log.warning("non-finite hidden states in %s: the optimizer steps of batches holding it are skipped; "
                            "%s", where, recompute_hint(self.reader.dir, verify=True))

    def cause(self, accelerator: Any = None) -> str | None:
        """The lowest-numbered shard with non-finite states seen (every process's, when
        ``accelerator`` is given: a collective), as a clause naming it and the fix; None if none."""
        counts, first = self.counts.clone(), self.first.clone()
        if accelerator is not None and accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        host_counts, host_first = counts.tolist(), first.tolist()
        bad = [k for k, c in enumerate(host_counts) if c > 0]
        if bad:
            where = self.where(int(host_first[bad[0]]))
        elif self.reported:
            where = self.reported[min(self.reported)]
        else:
            return None
        return f"first shard with non-finite hidden states: {where}; {recompute_hint(self.reader.dir, verify=True)}"


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


class MetricsWriter:
    """The one writer of ``RUN_DIR/metrics.jsonl`` (a JSON line per logging step and per validation,
    main process only) and of the trackers of ``train.report_to`` (``accelerator.log``, every rank)."""

    def __init__(self, accelerator: Any, path: Path):
        self.accelerator, self.path = accelerator, path

    def truncate_after(self, step: int) -> None:
        """Drop the lines logged after ``step`` (a resumed run logs them again)."""
        if self.accelerator.is_main_process:
            dropped = truncate_metrics(self.path, step)
            if dropped:
                log.info("%s: dropped %d lines after step %d (logged again by this run)", self.path, dropped, step)

    def write(self, values: dict[str, Any], step: int) -> None:
        if self.accelerator.is_main_process:
            with self.path.open("a") as fh:
                fh.write(json.dumps(values) + "\n")
        self.accelerator.log(values, step=step)


class Trainer:
    """One training run of ``method``'s model on ``RUN_DIR/data``, in small steps:

    - :meth:`setup`: run directory, data, model (:func:`~draftsmith.train.activation_checkpointing.apply_recipe_checkpointing`
      with ``draft.gradient_checkpointing``), optimizer and schedule, resume, run metadata;
    - :meth:`train_step`: one micro-batch (forward, backward and, at the end of an accumulation
      window, clipping, the optimizer and the schedule), without host reads;
    - :meth:`after_step`: after an optimizer step: log, validate, checkpoint, stop;
    - :meth:`fit`: the loop over epochs, then the final checkpoint.

    :func:`fit` builds one and runs it; the arguments are :func:`fit`'s.
    """

    def __init__(self, recipe: Recipe, method: DraftMethod, run_dir: Path, resume: bool = False,
                 argv: list[str] | None = None, progress: bool = True, overwrite: bool = False,
                 accelerator: Any = None):
        self.recipe, self.method, self.cfg = recipe, method, recipe.train
        self.run_dir, self.layout = Path(run_dir), RunLayout(Path(run_dir))
        self.resume, self.argv, self.progress, self.overwrite = resume, argv, progress, overwrite
        self.accelerator = accelerator
        self.state = TrainState()
        self.last_ckpt: Path | None = None
        self.last: dict[str, float] = {}
        self.stop: _StopRequest | None = None
        self.faults: NonFiniteShards | None = None  # offline shards: non-finite states counted per shard

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first micro-batch (the order fixes the RNG draws: data, then the
        model's initialisation)."""
        from accelerate.utils import set_seed

        from .distributed import build_accelerator

        if self.accelerator is None:
            self.accelerator = build_accelerator(self.recipe, self.run_dir)
        acc = self.accelerator
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            claim_run_dir(self.run_dir, self.resume, self.overwrite)
            remove_partial_checkpoints(self.layout.checkpoints)
        acc.wait_for_everyone()
        set_seed(self.recipe.seed)
        self._build_data()
        self._build_model()
        self.method.setup(acc)
        if self.resume:
            self._load_last_checkpoint()
        self._write_run_info()
        self._start_loop_state()

    def _length_buckets(self) -> Callable[[int], int] | None:
        """Under the flex backend (``train.attention_backend`` auto on CUDA, or flex) for a method
        with attention: pad each batch to its length bucket (:func:`~draftsmith.train.packing.length_bucket`:
        ``pack_tokens`` when packing, one of 4 lengths otherwise), so ``flex_attention`` compiles
        once per bucket, not once per batch length. None (no padding) otherwise."""
        cfg = self.cfg
        if self.method.name in NO_ATTENTION_METHODS or \
                resolve_attention_backend(cfg.attention_backend, self.accelerator.device) != "flex":
            return None
        longest = (cfg.pack_tokens or self.recipe.data.max_length) if cfg.packing else self.recipe.data.max_length
        return functools.partial(length_bucket, max_length=longest, packing=cfg.packing)

    def _build_data(self) -> None:
        """The train (and held-out validation) datasets, the length-grouped sampler and the loader."""
        recipe, cfg, acc = self.recipe, self.cfg, self.accelerator
        plan_fn = getattr(self.method, "batch_plan", None)
        self.plan = plan_fn() if callable(plan_fn) else None  # run on CPU batches in the DataLoader workers
        loss_on_all = cfg.loss_on == "all"  # training batches only: validation measures assistant tokens
        pad_to = self._length_buckets()
        base = collate if pad_to is None else functools.partial(collate, pad_to=pad_to)
        dataset, collate_fn = self.method.dataset(), BatchCollator(base, self.plan, loss_on_all)
        self.val_set = None
        shards = isinstance(dataset, ShardReader)
        if shards:  # the training items name their sequence, so a non-finite state names its shard
            self.faults = NonFiniteShards(dataset, acc.device)
        if recipe.data.validation_fraction:  # held-out conversations, never packed
            train_idx, val_idx = split_by_conversation(dataset_ids(dataset), recipe.data.validation_fraction,
                                                       recipe.seed, where=str(self.layout.data.root))
            dataset, self.val_set = IndexedSubset(dataset, train_idx), IndexedSubset(dataset, val_idx)
            if shards:
                dataset = SourceTagged(dataset, train_idx)
            log.info("validation: %d sequences held out, %d train (data.validation_fraction=%g)", len(self.val_set),
                     len(dataset), recipe.data.validation_fraction)
        elif shards:
            dataset = SourceTagged(dataset)
        if cfg.packing:  # rows of several sequences; the sampler then batches rows
            dataset = PackedDataset(dataset, cfg.pack_tokens or recipe.data.max_length, recipe.seed)
            base = collate_packed if pad_to is None else functools.partial(collate_packed, pad_to=pad_to)
            collate_fn = BatchCollator(base, self.plan, loss_on_all)
        # The sampler shards every global batch across ranks itself (contiguous slices, so P processes
        # with batch b train exactly like one with P*b); the DataLoader is therefore not prepared, and
        # DeepSpeed's micro-batch comes from the recipe (launchers.check_runtime).
        self.sampler = LengthGroupedBatches(dataset.lengths(), cfg.batch_size, recipe.seed,
                                            acc.num_processes, acc.process_index)
        # pinned batches copy to the GPU asynchronously (to_device's non_blocking)
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, collate_fn=collate_fn,
                                 num_workers=cfg.num_workers, pin_memory=acc.device.type == "cuda",
                                 persistent_workers=cfg.num_workers > 0)

    def _build_model(self) -> None:
        """The draft (activation checkpointing applied), fused AdamW with the non-finite guard,
        the schedule (steps, or steps and seconds under ``train.max_time_minutes``), prepared."""
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        cfg, acc = self.cfg, self.accelerator
        model = self.method.build_model()
        set_fused_loss(cfg.fused_loss)
        if resolve_compile(cfg.compile, acc.device):
            log.info("train.compile: %d decoder layers compiled around attention", compile_regions(model))
        apply_recipe_checkpointing(model, self.recipe.draft)
        optimizers = build_optimizers(model, cfg, acc.device)
        deepspeed = acc.distributed_type.value == "DEEPSPEED"
        if deepspeed and len(optimizers) > 1:
            raise ValueError("train.optimizer: muon is not supported under DeepSpeed (it steps one optimizer); "
                             "use train.optimizer: adamw or another launcher")
        # before prepare: DeepSpeed ZeRO steps this same optimizer object on its fp32 partitions
        self.guard = NonFiniteGuard(optimizers, acc.device, acc.num_processes, check_grads=deepspeed)
        steps_per_epoch = max(1, len(self.sampler) // cfg.grad_accum_steps)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
        self.budget_s = cfg.max_time_minutes * 60.0 if cfg.max_time_minutes else None
        self.clock = _TrainClock()

        def schedule(optimizer: torch.optim.Optimizer) -> Any:
            if self.budget_s is None:
                return get_cosine_with_min_lr_schedule_with_warmup(
                    optimizer, int(cfg.warmup_ratio * self.total_steps), self.total_steps, min_lr_rate=cfg.min_lr_ratio
                )
            # warmup + cosine over max(step / total_steps, seconds / budget); self.total_steps as
            # it is when the schedule steps (an early stop or a spent budget lowers it)
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: budget_lr_factor(
                max(step / self.total_steps, self.clock.seconds() / self.budget_s), cfg.warmup_ratio,
                cfg.min_lr_ratio))

        # one schedule per optimizer (the same factor of each one's peak lr); accelerate's
        # save_state / load_state keep every prepared optimizer and scheduler (optimizer_1.bin ...)
        schedulers = [schedule(o) for o in optimizers]
        model, *prepared = acc.prepare(model, *optimizers, *schedulers)
        self.model, self.optimizers, self.schedulers = model, prepared[:len(optimizers)], prepared[len(optimizers):]
        self.optimizer, self.scheduler = self.optimizers[0], self.schedulers[0]
        self.engine = acc.deepspeed_engine_wrapped.engine if deepspeed else None

    def _load_last_checkpoint(self) -> None:
        ckpts = find_checkpoints(self.layout.checkpoints)
        if not ckpts:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.layout.checkpoints}")
        self.last_ckpt = ckpts[-1]
        state = self.state
        load_checkpoint(self.accelerator, self.last_ckpt, state, self.accelerator.unwrap_model(self.model))
        log.info("resumed from %s at step %d (epoch %d, batch %d)", self.last_ckpt, state.step, state.epoch,
                 state.batch_in_epoch)

    def _write_run_info(self) -> None:
        """The resolved recipe and ``run_meta.json`` (:mod:`~draftsmith.train.run_info`), the trackers,
        ``metrics.jsonl`` cut back to the resumed step, the checkpoint manager."""
        acc = self.accelerator
        self.meta_json = json.dumps(run_metadata(self.argv or sys.argv), indent=1)
        if acc.is_main_process:
            dump_recipe(self.recipe, self.layout.recipe)
            (self.run_dir / "run_meta.json").write_text(self.meta_json)
        init_trackers(acc, self.recipe, self.run_dir)
        self.metrics = MetricsWriter(acc, self.layout.metrics)
        self.metrics.truncate_after(self.state.step)
        self.checkpoints = CheckpointManager(acc, self.layout.checkpoints, self.cfg.keep_checkpoints,
                                             self._checkpoint_extras)
        self.monitor, self.higher_is_better = (best_metric(self.recipe, self.method) if self.val_set is not None
                                               else (None, True))

    def _start_loop_state(self) -> None:
        """Progress bar, metric window, guard counters and clock, from the resumed state."""
        from tqdm.auto import tqdm

        acc, state = self.accelerator, self.state
        self.bar = tqdm(total=self.total_steps, initial=state.step, desc=f"train {self.method.name}", unit="step",
                        disable=not (self.progress and acc.is_main_process))
        self.window = MetricWindow(acc.device)
        self.window.restore(window_sums_of_rank(state.window, state.window_format, acc.process_index,
                                                acc.num_processes, state.num_processes))
        self.guard.restore(state.nonfinite_in_a_row)
        if self.faults is not None:
            self.faults.reported.update(state.nonfinite_shards)  # warned before the resume
        self.t0, self.tokens_at_start, self.seconds_at_start = time.perf_counter(), state.tokens, state.train_seconds
        self.clock.start(self.t0, self.seconds_at_start)
        self.clock.synced = self.seconds_at_start  # the same on every rank until the first logging step syncs it
        if self.budget_s is not None and self.seconds_at_start >= self.budget_s:
            self.total_steps = min(self.total_steps, state.step)  # a resumed run whose budget is spent: nothing to do

    def _checkpoint_extras(self, directory: Path) -> None:  # main process, inside the temp checkpoint directory
        dump_recipe(self.recipe, directory / "recipe.yaml")
        (directory / "run_meta.json").write_text(self.meta_json)
        self.method.checkpoint_extras(directory)

    # -- the step ----------------------------------------------------------------------------

    def is_logging_step(self, step: int) -> bool:
        return step % self.cfg.log_every == 0 or step == self.total_steps

    def train_step(self, batch: dict[str, Any]) -> bool:
        """One micro-batch: forward and backward; at the end of the accumulation window the
        clipped optimizer step (skipped on the device when not finite) and the schedule. Reads
        nothing from the device (metrics go to the window). True: an optimizer step was taken."""
        acc, cfg, state, guard, model = self.accelerator, self.cfg, self.state, self.guard, self.model
        batch = to_device(batch, acc.device)
        sequence = batch.pop(SEQUENCE_KEY, None)
        if sequence is not None and self.faults is not None:
            self.faults.note(batch, sequence)  # device-side, read with the metrics
        with acc.accumulate(model):
            self.method.begin_step(state.step)
            loss, metrics = self.method.compute_loss(model, batch)
            guard.note_loss(loss)  # before backward: DeepSpeed steps inside it
            acc.backward(loss)
            if acc.sync_gradients:
                if self.engine is not None:
                    # DeepSpeed clipped (gradient_clipping = train.max_grad_norm) and stepped
                    # in backward, the guard's hook inside; its norm is a device tensor
                    norm = self.engine.get_global_grad_norm()
                    guard.end_step(applied=self.engine.was_step_applied())
                else:
                    norm = _full_tensor(acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                    guard.note_grad_norm(norm)
                    for optimizer in self.optimizers:
                        optimizer.step()  # skipped on the device when not finite (NonFiniteGuard)
                    guard.end_step()
                step = state.step + 1
                if self.budget_s is not None and self.is_logging_step(step):
                    with host_work("log", step):
                        self.clock.sync(acc)  # the same seconds on every rank, for lr and stop
                for scheduler in self.schedulers:
                    scheduler.step()
                if norm is not None:
                    metrics = {**metrics, "grad_norm": norm}
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        self.window.add(metrics)
        state.batch_in_epoch += 1
        state.tokens += batch["num_tokens"]
        if not acc.sync_gradients:
            return False
        state.step += 1
        self.bar.update(1)
        return True

    # -- after an optimizer step ---------------------------------------------------------------

    def after_step(self) -> bool:
        """Log, validate, checkpoint at their steps; True when this step is the last (budget spent,
        early stop, ``total_steps``). A stop signal saves a checkpoint and exits (``SystemExit``)."""
        cfg, state = self.cfg, self.state
        if self.is_logging_step(state.step):
            with host_work("log", state.step):
                if self.budget_s is not None and state.step < self.total_steps and self.clock.seconds() >= self.budget_s:
                    log.info("train.max_time_minutes=%g reached at step %d", cfg.max_time_minutes, state.step)
                    self.total_steps = state.step  # this step is the last: checkpointed as such
                self.last = self.log_window()
        if self.val_set is not None and ((cfg.eval_every and state.step % cfg.eval_every == 0)
                                         or state.step == self.total_steps):
            with host_work("validation", state.step):
                stop_early = self.validate()
            if stop_early:
                self.total_steps = state.step  # early stop: this step is the last, checkpointed as such
        if state.step % cfg.checkpoint_every == 0 and state.step < self.total_steps:
            self.last_ckpt = self.save_checkpoint()
        if state.step >= self.total_steps:
            return True
        if self.stop is not None and self.stop.signum is not None:
            self.last_ckpt = self.save_checkpoint()
            log.warning("received signal %d: saved %s, exiting (resume with --resume)", self.stop.signum,
                        self.last_ckpt or "no checkpoint (no optimizer step applied yet)")
            raise SystemExit(128 + self.stop.signum)
        return False

    def log_window(self) -> dict[str, Any]:
        """The logging step's metrics line (one all-reduce, one host read), written and tracked."""
        state = self.state
        values, counters = self.window.read(self.accelerator, extra=self._counters(self.window.dtype))
        self._absorb(counters)
        elapsed = time.perf_counter() - self.t0
        values.update(step=state.step, epoch=state.epoch, lr=self.scheduler.get_last_lr()[0],
                      tokens_per_s=(state.tokens - self.tokens_at_start) / max(elapsed, 1e-9))
        if state.nonfinite_skipped:
            values["nonfinite_skipped"] = state.nonfinite_skipped
        self.bar.set_postfix(loss=f"{values.get('loss', float('nan')):.3f}",
                             acc0=f"{values.get('acc_0', float('nan')):.3f}")
        self.metrics.write(values, state.step)
        return values

    def validate(self) -> bool:
        """Evaluate on the held-out conversations, log, keep checkpoints/best; True: stop early."""
        acc, cfg, state = self.accelerator, self.cfg, self.state
        batches = validation_batches(self.val_set, cfg.batch_size, BatchCollator(collate, self.plan),
                                     acc.num_processes, acc.process_index, cfg.eval_max_sequences)
        val = run_validation(self.method, self.model, batches, acc)
        val.update(step=state.step, epoch=state.epoch)
        self.metrics.write(val, state.step)
        monitor = self.monitor
        score = val.get(monitor)
        if score is None or not math.isfinite(score):
            log.warning("step %d: validation gave no %s (%s)", state.step, monitor, val)
            return False
        better = state.best_value is None or (score > state.best_value if self.higher_is_better
                                              else score < state.best_value)
        log.info("step %d: %s %.4f (best %s at step %s)%s", state.step, monitor, score, state.best_value,
                 state.best_step, "; new best" if better else "")
        if better:
            state.best_value, state.best_step, state.evals_since_best = score, state.step, 0
            self.checkpoints.save_best(self.model, state, val)
            return False
        state.evals_since_best += 1
        patience = cfg.early_stopping_patience
        if patience and state.evals_since_best >= patience:
            log.info("early stopping at step %d: %d validations without a better %s (best %.4f at step %d)",
                     state.step, state.evals_since_best, monitor, state.best_value, state.best_step)
            return True
        return False

    def _counters(self, dtype: torch.dtype) -> torch.Tensor:
        """The guard's counters, then (offline shards) the per-shard non-finite counts: one device
        tensor, read on the host with the metrics or at a checkpoint."""
        if self.faults is None:
            return self.guard.counters.to(dtype)
        return torch.cat([self.guard.counters.to(dtype), self.faults.values(dtype)])

    def _absorb(self, values: list[float]) -> None:
        """Take the counters read on the host: warn once per shard with non-finite states
        (:class:`NonFiniteShards`), then the guard's counts and stop (:meth:`NonFiniteGuard.absorb`,
        naming the first such shard)."""
        if self.faults is not None:
            self.faults.absorb(values[3:], self.state)
        cause = None
        if self.faults is not None and int(round(values[2])) >= self.cfg.max_nonfinite_steps:
            cause = self.faults.cause(self.accelerator)  # every rank stops here: the counters are all-reduced
        self.guard.absorb(values[:3], self.state, self.cfg.max_nonfinite_steps, self.last_ckpt, cause)

    def save_checkpoint(self) -> Path | None:
        state = self.state
        with host_work("checkpoint", state.step):
            self._absorb(self._counters(self.window.dtype).tolist())
            if state.step and state.nonfinite_skipped >= state.step:  # not one update applied
                cause = self.faults.cause(self.accelerator) if self.faults is not None else None
                if state.finished:
                    raise NonFiniteLossError(
                        f"all {state.step} optimizer steps were skipped (non-finite loss or gradient), so no "
                        "checkpoint was written; " + (cause or "the hidden states read were finite: the loss or "
                                                       "gradient overflowed (lower train.lr, check the recipe)"))
                log.warning("step %d: no checkpoint written: every optimizer step so far was skipped as non-finite%s",
                            state.step, f" ({cause})" if cause else "")
                return self.last_ckpt
            state.window, state.window_format = window_state(self.accelerator, self.window), 2
            state.train_seconds = self.seconds_at_start + time.perf_counter() - self.t0
            return self.checkpoints.save(self.model, state)

    # -- the loop ----------------------------------------------------------------------------------

    def train_epoch(self) -> bool:
        """The rest of the current epoch (resumed mid-epoch: its remaining batches); True: training is done."""
        state = self.state
        self.sampler.set_epoch(state.epoch)
        loader = self.loader  # already sharded per rank by the sampler
        if state.batch_in_epoch:
            loader = self.accelerator.skip_first_batches(loader, state.batch_in_epoch)
        for batch in _host_batches(loader):
            if self.train_step(batch) and self.after_step():
                return True
        state.epoch += 1
        state.batch_in_epoch = 0
        return False

    def fit(self) -> FitResult:
        """:meth:`setup`, the epochs, the final checkpoint."""
        self.setup()
        self.stop = _StopRequest()
        self.model.train()
        done = self.state.step >= self.total_steps
        try:
            while not done:
                done = self.train_epoch()
        finally:  # handlers restored and the bar closed on every exit, errors included
            self.bar.close()
            self.stop.restore()
        self.state.finished = True
        self.last_ckpt = self.save_checkpoint()
        self.accelerator.end_training()
        elapsed = time.perf_counter() - self.t0
        tokens = self.state.tokens - self.tokens_at_start
        return FitResult(self.state.step, tokens, elapsed, tokens / max(elapsed, 1e-9), self.last, self.last_ckpt)


def fit(recipe: Recipe, method: DraftMethod, run_dir: Path, resume: bool = False, argv: list[str] | None = None,
        progress: bool = True, overwrite: bool = False, accelerator: Any = None) -> FitResult:
    """Train ``method``'s model on ``RUN_DIR/data``; checkpoints go to ``RUN_DIR/checkpoints/step-N``
    (a :class:`Trainer` run).

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
    return Trainer(recipe, method, run_dir, resume, argv, progress, overwrite, accelerator).fit()
