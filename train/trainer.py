"""The training loop of every draft method (:class:`Trainer`: setup, train step, after step), on accelerate.

One process on a laptop CPU or many under ``accelerate launch`` (DDP, DeepSpeed, FSDP from
the launcher config). DDP and FSDP run the same code as one process; the loop branches on one
backend, DeepSpeed (:func:`~draftsmith.train.distributed.uses_deepspeed`), whose engine clips and
steps the optimizer inside ``accelerator.backward``: under it :meth:`Trainer.train_step` reads the
engine's gradient norm and whether it applied the step instead of clipping and stepping itself,
:meth:`Trainer._build_model` refuses Muon (DeepSpeed steps one optimizer), and the non-finite
guard also checks the gradients the optimizer is about to apply.

A :class:`DraftMethod` supplies the model and the per-batch loss; the loop supplies data
order, gradient accumulation and clipping, and checkpoints. Its parts live in
:mod:`draftsmith.train.components`: the optimizers (AdamW, or AdamW + Muon) and their
warmup/cosine schedule (:mod:`~draftsmith.train.components.optimizer`), logging (tqdm, JSONL,
wandb / tensorboard: :mod:`~draftsmith.train.components.metrics`), the non-finite guard
(:mod:`~draftsmith.train.components.nonfinite`) and the time-budget clock
(:mod:`~draftsmith.train.components.clock`). Checkpoints: :mod:`draftsmith.train.checkpoint` (a
consolidated ``model.safetensors`` under every launcher beside the launcher's own resume state,
with ``train_state.json``, the resolved recipe, command line (secrets redacted), git revision
and package versions). The Accelerator comes from :mod:`draftsmith.train.distributed`.

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
  the device per log window (:class:`~draftsmith.train.components.metrics.MetricWindow`: sum
  and count per key, non-finite values left out); a logging step all-reduces the sums over ranks and reads them once. The logged
  value is the window mean over every micro-batch of every rank.
- ``num_tokens`` is counted on the CPU in the collate function (:class:`~draftsmith.train.data.BatchCollator`),
  which also runs the method's optional ``batch_plan()`` in the DataLoader workers; batches
  are moved with ``non_blocking=True`` from pinned memory on CUDA.
- Non-finite steps are skipped on the device
  (:class:`~draftsmith.train.components.nonfinite.NonFiniteGuard`): a flag (any non-finite loss
  of the accumulation window, the gradient norm, under DeepSpeed the gradients the optimizer is
  about to apply), all-reduced (max) over ranks, is handed to the
  fused AdamW as ``found_inf``, which then leaves weights and optimizer state untouched on
  every rank. Skip counters stay on the device; ``train.max_nonfinite_steps`` is checked when
  they are read, at logging and checkpoint steps. The learning-rate schedule advances on
  skipped steps too (it follows the optimizer-step count). With offline shards the non-finite
  hidden states are counted per shard on the device too
  (:class:`~draftsmith.train.components.nonfinite.NonFiniteShards`), read with
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
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
from torch.utils.data import DataLoader

from ..data_prep.shards import ShardReader
from ..layout import RunLayout
from ..models.common import compile_regions, resolve_attention_backend, resolve_compile
from .data import SEQUENCE_KEY, BatchCollator, SourceTagged, collate, to_device
from ..recipe import Recipe, dump_recipe
from .checkpoint import CheckpointManager, TrainState, claim_run_dir, remove_partial_checkpoints
from .resume import ResumePlan, apply_hyperparameters, load_resumed, plan_resume, set_aside_later, warn_nothing_to_resume
from .activation_checkpointing import apply_recipe_checkpointing
from .components.clock import TrainClock, time_budget_s
from .components.ema import EMA_WEIGHTS_NAME, WeightEMA, build_ema, resume_ema
from .components.metrics import (
    MetricsWriter,
    MetricWindow,
    best_metric,
    init_trackers,
    window_state,
    window_sums_of_rank,
)
from .components.nonfinite import NonFiniteGuard, NonFiniteLossError, NonFiniteShards
from .components.optimizer import build_optimizers, build_scheduler
from .distributed import full_tensor, uses_deepspeed
from .packing import PackedDataset, collate_packed, length_bucket
from .run_info import run_metadata
from .sampler import LengthGroupedBatches
from .selection import select_training
from .validation import (
    IndexedSubset,
    ValidationSpec,
    dataset_ids,
    run_validation,
    split_by_conversation,
    validation_batches,
)

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
                 accelerator: Any = None, resume_from: str | Path | None = None):
        self.recipe, self.method, self.cfg = recipe, method, recipe.train
        self.run_dir, self.layout = Path(run_dir), RunLayout(Path(run_dir))
        self.resume, self.argv, self.progress, self.overwrite = resume or resume_from is not None, argv, progress, overwrite
        self.resume_from = resume_from
        self.resume_plan: ResumePlan | None = None  # what --resume loads and which recipe keys changed
        self.accelerator = accelerator
        self.state = TrainState()
        self.last_ckpt: Path | None = None
        self.last: dict[str, float] = {}
        self.stop: _StopRequest | None = None
        self.faults: NonFiniteShards | None = None  # offline shards: non-finite states counted per shard
        self.ema: WeightEMA | None = None  # train.ema_decay's average of the trained weights

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first micro-batch (the order fixes the RNG draws: data, then the
        model's initialisation)."""
        from accelerate.utils import set_seed

        from .distributed import build_accelerator

        if self.accelerator is None:
            self.accelerator = build_accelerator(self.recipe, self.run_dir)
        acc = self.accelerator
        if self.resume and not self.overwrite:  # every rank: read only, before anything is written
            self.resume_plan = plan_resume(self.recipe, self.run_dir, self.resume_from, acc.distributed_type.value,
                                           acc.num_processes)
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            claim_run_dir(self.run_dir, self.resume, self.overwrite)
            remove_partial_checkpoints(self.layout.checkpoints)
        acc.wait_for_everyone()
        set_seed(self.recipe.seed)
        self._build_data()
        self._build_model()
        self.ema = build_ema(acc, self.model, self.cfg.ema_decay)  # main process only, None when off
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
        if not self.method.uses_attention or \
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
        train_idx = None
        if recipe.data.validation_fraction:  # held-out conversations, never packed
            train_idx, val_idx = split_by_conversation(dataset_ids(dataset), recipe.data.validation_fraction,
                                                       recipe.seed, where=str(self.layout.data.root))
            self.val_set = IndexedSubset(dataset, val_idx)
        if recipe.data.select is not None:  # the top fraction of the training sequences (train/selection.py)
            train_idx = select_training(dataset, train_idx, recipe.data.select, self.layout.data)
        if train_idx is not None:
            dataset = IndexedSubset(dataset, train_idx)
            if shards:
                dataset = SourceTagged(dataset, train_idx)
            if self.val_set is not None:
                log.info("validation: %d sequences held out, %d train (data.validation_fraction=%g)",
                         len(self.val_set), len(dataset), recipe.data.validation_fraction)
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
        cfg, acc = self.cfg, self.accelerator
        model = self.method.build_model()
        if resolve_compile(cfg.compile, acc.device):
            log.info("train.compile: %d decoder layers compiled around attention", compile_regions(model))
        apply_recipe_checkpointing(model, self.recipe.draft)
        optimizers = build_optimizers(model, cfg, acc.device)
        deepspeed = uses_deepspeed(acc)
        if deepspeed and len(optimizers) > 1:
            raise ValueError("train.optimizer: muon is not supported under DeepSpeed (it steps one optimizer); "
                             "use train.optimizer: adamw or another launcher")
        # before prepare: DeepSpeed ZeRO steps this same optimizer object on its fp32 partitions
        self.guard = NonFiniteGuard(optimizers, acc.device, acc.num_processes, check_grads=deepspeed)
        steps_per_epoch = max(1, len(self.sampler) // cfg.grad_accum_steps)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
        self.budget_s = time_budget_s(cfg)
        self.clock = TrainClock()
        # one schedule per optimizer (the same factor of each one's peak lr); accelerate's
        # save_state / load_state keep every prepared optimizer and scheduler (optimizer_1.bin ...)
        schedulers = [build_scheduler(o, cfg, lambda: self.total_steps, self.clock.seconds, self.budget_s)
                      for o in optimizers]
        model, *prepared = acc.prepare(model, *optimizers, *schedulers)
        self.model, self.optimizers, self.schedulers = model, prepared[:len(optimizers)], prepared[len(optimizers):]
        self.optimizer, self.scheduler = self.optimizers[0], self.schedulers[0]
        self.engine = acc.deepspeed_engine_wrapped.engine if deepspeed else None
        # the hyperparameters of this recipe, for a resume that applies changed ones (load_state restores the old)
        self.fresh_groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                             for o in self.optimizers]
        self.fresh_base_lrs = [list(getattr(s, "scheduler", s).base_lrs) for s in self.schedulers]

    def _load_last_checkpoint(self) -> None:
        """Load the checkpoint :func:`~draftsmith.train.resume.plan_resume` chose, give the restored
        optimizers and schedules the recipe's changed hyperparameters (one note), and move the
        checkpoints after a ``--resume-from`` one aside; with none to load, start from step 0 (one
        warning)."""
        acc = self.accelerator
        plan = self.resume_plan or plan_resume(self.recipe, self.run_dir, self.resume_from,
                                               acc.distributed_type.value, acc.num_processes)
        if plan.checkpoint is None:
            warn_nothing_to_resume(self.layout)
            return
        self.last_ckpt = plan.checkpoint
        state = self.state
        load_resumed(acc, self.last_ckpt, state, acc.unwrap_model(self.model), self.run_dir)
        resume_ema(self.ema, self.last_ckpt)
        if plan.applied:
            apply_hyperparameters(self.optimizers, self.schedulers, self.fresh_groups, self.fresh_base_lrs)
            log.warning("%s", plan.note())
        if plan.free:
            log.info("--resume: changed since %s, nothing trained differs: %s", self.last_ckpt.name,
                     ", ".join(str(c) for c in plan.free))
        if plan.later and acc.is_main_process:
            set_aside_later(plan)
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
        if self.ema is not None:
            self.ema.save(directory / EMA_WEIGHTS_NAME)

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
                    norm = full_tensor(acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                    guard.note_grad_norm(norm)
                    for optimizer in self.optimizers:
                        optimizer.step()  # skipped on the device when not finite (NonFiniteGuard)
                    guard.end_step()
                step = state.step + 1
                if self.ema is not None:
                    self.ema.update(step)
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
        (:class:`~draftsmith.train.components.nonfinite.NonFiniteShards`), then the guard's counts and
        stop (:meth:`~draftsmith.train.components.nonfinite.NonFiniteGuard.absorb`, naming the first such shard)."""
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
        progress: bool = True, overwrite: bool = False, accelerator: Any = None,
        resume_from: str | Path | None = None) -> FitResult:
    """Train ``method``'s model on ``RUN_DIR/data``; checkpoints go to ``RUN_DIR/checkpoints/step-N``
    (a :class:`Trainer` run).

    Args:
        resume: continue from the last checkpoint (exactly: same parameters and metrics as an
            uninterrupted run); recipe keys changed since are applied or refused
            (:mod:`draftsmith.train.resume`); a run directory with training output but no
            checkpoint starts from step 0.
        resume_from: resume from this checkpoint of ``run_dir`` (``step-N`` or its path) instead
            of the last (implies ``resume``); the later ones are moved to ``abandoned-step-M``.
        overwrite: start over in a run directory that holds an earlier run's training output
            (removed; ``data/`` is kept).
        accelerator: built by :func:`draftsmith.train.distributed.build_accelerator` when None.

    Raises:
        RunDirNotEmptyError: a new run into a directory with training output, without ``overwrite``.
        FileNotFoundError: ``resume`` without a checkpoint nor training output.
        CheckpointError: ``resume`` from a checkpoint whose tensors do not fit this model or that
            another launcher wrote; :class:`~draftsmith.train.resume.ResumeRefusedError`: another
            method or a refused recipe key; :class:`~draftsmith.train.resume.CorruptCheckpointError`:
            a damaged checkpoint file.
        LauncherError: the launcher asked for a distributed setup that was not built.
        NonFiniteLossError: ``train.max_nonfinite_steps`` optimizer steps in a row were not finite.
    """
    return Trainer(recipe, method, run_dir, resume, argv, progress, overwrite, accelerator, resume_from).fit()
