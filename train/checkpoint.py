"""Checkpoints: save, resume, retention and lookup, under every accelerate launcher.

A checkpoint is the directory ``RUN_DIR/checkpoints/step-N``:

- ``model.safetensors``: the consolidated draft (every tensor of the unwrapped draft module,
  full shapes), written by the main process under every launcher: by accelerate's
  ``save_state`` for one process / DDP, gathered with ``Accelerator.save_model`` (accelerate's
  ``get_state_dict``) under FSDP and DeepSpeed. Export and the evaluators read only this file.
- what the launcher needs to resume, as accelerate's ``save_state`` writes it: ``optimizer.bin``
  / ``scheduler.bin`` (one process, DDP; ``train.optimizer: muon`` adds Muon's ``optimizer_1.bin``
  / ``scheduler_1.bin``), ``pytorch_model_fsdp_0/`` + ``optimizer_0/`` (FSDP,
  torch.distributed.checkpoint), ``pytorch_model/`` (DeepSpeed ZeRO: its own torch pickles,
  loaded only by DeepSpeed on resume), ``random_states_R.pkl`` per rank.
- ``train_state.json``: the run position (:class:`TrainState`, JSON, no pickle) with the
  launcher it was written under (distributed type, number of processes).
- ``draft_config.json`` / ``vocab.safetensors`` (the method's extras), ``recipe.yaml``,
  ``run_meta.json`` (command line, git revision, package versions).

Saves are atomic: everything goes to ``.tmp-step-N`` and is renamed once complete, so a crash
mid-save leaves the previous checkpoint whole and the partial one is removed at the next start.
A save that fills the disk removes its partial directory at once (freeing the space) and
raises :class:`CheckpointError` naming the checkpoint and the bytes it needs.

:func:`read_draft` is the one reader of a checkpoint's draft (``draft_config.json`` + weights)
for everything downstream of training: export, warm start (and so ``draftsmith simulate``) and
``draftsmith compare``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import __version__
from ..fileio import atomic_file, is_disk_full, tree_bytes
from ..layout import (DRAFT_CONFIG_FILE, DraftCheckpoint, DraftCheckpointConfig, DraftConfigError, ExportError,
                      RunLayout, too_old_message, written_before_oldest_readable)
from ..methods import UnknownMethodError, get_method
from .components.ema import EMA_WEIGHTS_NAME

log = logging.getLogger("draftsmith.train")

CHECKPOINT_PREFIX = "step-"
WEIGHTS_NAME = "model.safetensors"
BEST_NAME = "best"  # RUN_DIR/checkpoints/best: the draft of the best validation (best.json says which)
# accelerate's distributed types grouped by the resume state save_state writes
_LAYOUTS = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used as asked; the message names the file
    or key and what to do."""


class RunDirNotEmptyError(CheckpointError):
    """A new run (no ``--resume``) into a run directory that already holds training output."""


@dataclass
class TrainState:
    """Position of the run; saved with every checkpoint as ``train_state.json``."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    tokens: int = 0
    nonfinite_skipped: int = 0
    nonfinite_in_a_row: int = 0
    finished: bool = False  # the run reached its last step
    train_seconds: float = 0.0  # wall time of the training loop, summed over resumes (s)
    distributed_type: str = "NO"  # accelerate DistributedType the checkpoint was written under
    num_processes: int = 1
    # metrics since the last logged step, so a resumed run logs the same means: per key the
    # (sum, count) of every rank in rank order, [sum_0, count_0, sum_1, count_1, ...]
    # (window_format 2, components.metrics.MetricWindow); format 1 (older checkpoints): rank 0's values
    window: dict[str, list[float]] = field(default_factory=dict)
    window_format: int = 1
    # validation (data.validation_fraction): the best train.best_metric so far, at which step,
    # and validations since it improved (early stopping)
    best_value: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0
    # hidden-state shards found holding non-finite states: file -> where (sequence, record id),
    # warned about once (components.nonfinite.NonFiniteShards)
    nonfinite_shards: dict[str, str] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        # a deep copy, JSON-safe by construction; ``version``: the draftsmith that wrote it
        return {**json.loads(json.dumps(self.__dict__)), "version": __version__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state.items() if k != "version"})


def find_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints ``step-N`` (with ``train_state.json``) in step order; a half-written
    ``.tmp-step-N`` left by a crash during a save is never listed."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)
             and (p / "train_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def remove_partial_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Delete ``.tmp-step-N`` / ``.tmp-best`` directories left by a crash mid-save; returns what was removed."""
    if not ckpt_dir.is_dir():
        return []
    partial = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith((f".tmp-{CHECKPOINT_PREFIX}",
                                                                                     f".tmp-{BEST_NAME}"))]
    for p in partial:
        log.warning("removing %s: a checkpoint save that did not finish", p)
        shutil.rmtree(p, ignore_errors=True)
    return partial


def training_outputs(run_dir: Path) -> list[Path]:
    """What a training run writes into ``run_dir`` (``data/`` is the data stage's, not listed)."""
    layout = RunLayout(run_dir)
    paths = (layout.checkpoints, layout.metrics, run_dir / "train_state.json", layout.logs)
    return [p for p in paths if p.exists() and not (p.is_dir() and not any(p.iterdir()))]


def claim_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Check that a run may write into ``run_dir``; with ``overwrite`` remove earlier training
    output (checkpoints, metrics, tracker logs; ``data/`` is kept). Main process only.

    Raises:
        RunDirNotEmptyError: a new run (neither ``resume`` nor ``overwrite``) into a directory
            that already holds training output: continuing would mix two runs' metrics and
            checkpoints.
        CheckpointError: ``resume`` and ``overwrite`` together.
    """
    if resume and overwrite:
        raise CheckpointError("--resume (or --resume-from) and --overwrite contradict each other: choose one")
    found = training_outputs(run_dir)
    if not found or resume:
        return
    ckpt_dir = RunLayout(run_dir).checkpoints
    if not overwrite and not (ckpt_dir.is_dir() and any(re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)
                                                         for p in ckpt_dir.iterdir())):
        raise RunDirNotEmptyError(
            f"{run_dir} already holds a training run that wrote no checkpoint ({', '.join(p.name for p in found)}): "
            "pass --resume to train it from step 0 (its metrics.jsonl lines are dropped), --overwrite to remove "
            "its output first (data/ is kept), or choose another --run-dir")
    if not overwrite:
        raise RunDirNotEmptyError(
            f"{run_dir} already holds a training run ({', '.join(p.name for p in found)}): pass --resume to "
            f"continue it, --overwrite to start over (data/ is kept), or choose another --run-dir"
        )
    for p in found:
        log.warning("--overwrite: removing %s", p)
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def checkpoint_problem(ckpt: Path) -> str | None:
    """What is damaged in checkpoint ``ckpt`` (``"FILE: what"``, one line), or None when every file
    resume reads is whole: ``train_state.json`` (JSON with a step), ``model.safetensors`` (its
    header and every tensor's bytes present: a truncated file fails), ``draft_config.json`` /
    ``recipe.yaml`` (parse), and the torch archives accelerate's ``save_state`` writes at the top
    level (``optimizer.bin``, ``scheduler.bin``, ``random_states_R.pkl`` ...: their zip directory,
    at the end of the file, is read). Headers only: cheap for any size; a file damaged without a
    change of size may pass."""
    import zipfile

    import yaml
    from safetensors import safe_open

    state = ckpt / "train_state.json"
    try:
        saved = json.loads(state.read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("step"), int):
            return f"{state}: not a train state (no step)"
    except (OSError, ValueError) as exc:
        return f"{state}: unreadable ({_first_line(exc)})"
    weights = ckpt / WEIGHTS_NAME
    if not weights.is_file():
        return f"{weights}: missing"
    try:
        with safe_open(str(weights), framework="pt") as fh:
            for key in fh.keys():
                fh.get_slice(key).get_shape()
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        return f"{weights}: truncated or corrupt ({_first_line(exc)})"
    for name, parse in ((DRAFT_CONFIG_FILE, json.loads), ("recipe.yaml", yaml.safe_load)):
        path = ckpt / name
        if path.is_file():
            try:
                parse(path.read_text())
            except (OSError, ValueError, yaml.YAMLError) as exc:
                return f"{path}: unreadable ({_first_line(exc)})"
    for path in sorted(p for p in ckpt.iterdir() if p.is_file() and p.suffix in (".bin", ".pkl", ".pt")):
        try:
            with zipfile.ZipFile(path) as zf:
                zf.infolist()
        except (OSError, zipfile.BadZipFile) as exc:
            return f"{path}: truncated or corrupt ({_first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_checkpoint_shapes(ckpt: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint whose tensors do not fit ``model`` before anything is loaded.

    ``model`` may be wrapped (DDP ``module.`` prefix) or sharded by FSDP2 (DTensor parameters
    report their global shape).

    Raises:
        CheckpointError: naming the file, the tensor and both shapes (a checkpoint trained for
            another target: hidden size or vocab differ).
    """
    from safetensors import safe_open

    path = ckpt / WEIGHTS_NAME
    if not path.is_file():
        return
    want = {k.removeprefix("module."): tuple(v.shape) for k, v in model.state_dict().items()}
    with safe_open(str(path), framework="pt") as fh:
        for key in fh.keys():
            name, shape = key.removeprefix("module."), tuple(fh.get_slice(key).get_shape())
            if name in want and want[name] != shape:
                raise CheckpointError(
                    f"{path}: {name} has shape {list(shape)} but this run's model has {list(want[name])}: the "
                    f"checkpoint was trained for another target or draft config (hidden size / vocab differ; "
                    f"see {ckpt / 'draft_config.json'})"
                )


def check_launcher_layout(ckpt: Path, saved: dict[str, Any], distributed_type: str, num_processes: int,
                          warn: bool = True) -> None:
    """Refuse to resume a checkpoint whose resume state another launcher wrote.

    FSDP (torch.distributed.checkpoint shards), DeepSpeed (ZeRO partitions) and plain / DDP
    (``optimizer.bin``) keep optimizer state in different layouts that only their own loader
    reads; DeepSpeed ZeRO partitions also fix the number of processes.

    ``warn``: log that another number of processes changes the data order (False: a check made
    again before loading).

    Raises:
        CheckpointError: naming ``train_state.json``'s ``distributed_type`` / ``num_processes``.
    """
    was = saved.get("distributed_type", "NO")
    layout_was, layout_now = _LAYOUTS.get(was, "plain"), _LAYOUTS.get(distributed_type, "plain")
    if layout_was != layout_now:
        raise CheckpointError(
            f"{ckpt / 'train_state.json'}: distributed_type={was} (a {layout_was} checkpoint) but this run uses "
            f"{distributed_type} ({layout_now}); resume with the launcher that wrote it, or export its "
            f"{WEIGHTS_NAME} and start a new run"
        )
    n_was = int(saved.get("num_processes", 1))
    if layout_now == "deepspeed" and n_was != num_processes:
        raise CheckpointError(
            f"{ckpt / 'train_state.json'}: num_processes={n_was} but this run has {num_processes}: DeepSpeed ZeRO "
            f"optimizer partitions are per rank; resume with {n_was} processes"
        )
    if n_was != num_processes and warn:
        log.warning("%s: written by %d processes, resumed with %d: the data order differs from an uninterrupted run",
                    ckpt, n_was, num_processes)


def load_checkpoint(accelerator: Any, ckpt: Path, state: TrainState, model: torch.nn.Module | None = None) -> None:
    """Restore model, optimizer, scheduler and RNG states (accelerate ``load_state``) and the
    run position from ``train_state.json``. With ``model``, its shapes are checked against the
    checkpoint first (:func:`check_checkpoint_shapes`), and the launcher against the one that
    wrote it (:func:`check_launcher_layout`).

    Raises:
        CheckpointError: shapes or launcher do not match; a checkpoint of a draftsmith older than
            :data:`~draftsmith.layout.OLDEST_READABLE` (one line; nothing of it is loaded, so
            neither the ``custom_checkpoint_0.pkl`` pickle those held).
    """
    saved = json.loads((ckpt / "train_state.json").read_text())
    if written_before_oldest_readable(saved.get("version")):
        raise CheckpointError(too_old_message(ckpt, saved.get("version"), "resume it with the draftsmith that "
                                              "wrote it, or start over with --overwrite"))
    check_launcher_layout(ckpt, saved, accelerator.distributed_type.value, accelerator.num_processes)
    if model is not None:
        check_checkpoint_shapes(ckpt, model)
    state.load_state_dict(saved)
    accelerator.load_state(str(ckpt))


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the ``metrics.jsonl`` lines of steps ``<= step`` (those a killed run wrote after its
    last checkpoint are logged again on resume); atomic rewrite. Returns the lines dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):
            keep = False  # a line torn by the kill
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        with atomic_file(path) as fh:
            fh.write("".join(line + "\n" for line in kept).encode())
    return dropped


def consolidated_state_is_saved_by_accelerate(distributed_type: str) -> bool:
    """True when accelerate's ``save_state`` already writes the full ``model.safetensors``
    (one process, DDP); FSDP and DeepSpeed write sharded state instead."""
    return distributed_type not in _LAYOUTS


class CheckpointManager:
    """Saves ``step-N`` checkpoints of one run and keeps the newest ``keep`` of them.

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (after ``prepare``).
        ckpt_dir: ``RUN_DIR/checkpoints``.
        keep: checkpoints kept; the one just written is never deleted.
        extras: called by the main process with the temp directory, to write what export needs
            (the method's ``checkpoint_extras``, the recipe, run metadata).
    """

    def __init__(self, accelerator: Any, ckpt_dir: Path, keep: int, extras: Callable[[Path], None]):
        self.accelerator, self.ckpt_dir, self.keep, self.extras = accelerator, ckpt_dir, keep, extras

    def _fresh_tmp(self, name: str) -> Path:
        """An empty ``ckpt_dir/name`` made by the main process, seen by every rank (collective)."""
        acc, tmp = self.accelerator, self.ckpt_dir / name
        acc.wait_for_everyone()
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        return tmp

    @contextlib.contextmanager
    def _disk_full_is_an_error(self, tmp: Path, final: Path) -> Iterator[None]:
        """A full disk inside the body: remove ``tmp`` (main process) and raise one line."""
        try:
            yield
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            written = tree_bytes(tmp)
            if self.accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = find_checkpoints(self.ckpt_dir)
            need = (f"about {tree_bytes(previous[-1])} bytes (the size of {previous[-1].name})" if previous
                    else f"more than the {written} bytes written before the disk filled up")
            raise CheckpointError(
                f"{final}: disk full while saving: the checkpoint needs {need}, "
                f"{shutil.disk_usage(self.ckpt_dir).free} bytes are free; the partial save was removed and earlier "
                "checkpoints are intact: free space and rerun with --resume") from exc

    def save(self, model: torch.nn.Module, state: TrainState) -> Path:
        """Write ``step-{state.step}`` atomically; collective (every process must call it).

        Returns:
            The checkpoint directory.

        Raises:
            CheckpointError: the disk filled up (the partial save is removed, earlier
                checkpoints are untouched); the message names the checkpoint and the bytes needed.
        """
        acc = self.accelerator
        final = self.ckpt_dir / f"{CHECKPOINT_PREFIX}{state.step}"
        tmp = self._fresh_tmp(f".tmp-{CHECKPOINT_PREFIX}{state.step}")
        with self._disk_full_is_an_error(tmp, final):
            acc.save_state(str(tmp))
            dtype = acc.distributed_type.value
            if not consolidated_state_is_saved_by_accelerate(dtype):
                # gathers the full draft on the main process (FSDP: full_state_dict; ZeRO-2: module state)
                acc.save_model(model, str(tmp), max_shard_size="1000GB", safe_serialization=True)
            # accelerate's save_state ends without a barrier and every rank writes its own RNG state
            # into tmp last: a slower rank would find tmp already renamed (seen under CPU load with
            # DeepSpeed ZeRO-2), or its state would be missing from the checkpoint
            acc.wait_for_everyone()
            if acc.is_main_process:
                if not (tmp / WEIGHTS_NAME).is_file():
                    raise CheckpointError(f"{tmp}: {WEIGHTS_NAME} was not written under distributed_type={dtype}")
                state.distributed_type, state.num_processes = dtype, acc.num_processes
                (tmp / "train_state.json").write_text(json.dumps(state.state_dict()))
                self.extras(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)  # atomic: a crash before this leaves the previous checkpoint whole
                self.apply_retention(final)
        acc.wait_for_everyone()
        return final

    def save_best(self, model: torch.nn.Module, state: TrainState, metrics: dict[str, Any]) -> Path:
        """Write ``checkpoints/best`` atomically: the consolidated ``model.safetensors`` and what
        export needs (no resume state), with ``best.json`` (step, monitored metric, validation
        metrics). Collective (every process must call it). ``draftsmith export RUN_DIR/checkpoints/best``
        exports it.

        Returns:
            The directory.

        Raises:
            CheckpointError: the disk filled up (as :meth:`save`).
        """
        acc = self.accelerator
        final, tmp = self.ckpt_dir / BEST_NAME, self._fresh_tmp(f".tmp-{BEST_NAME}")
        with self._disk_full_is_an_error(tmp, final):
            # gathers the full draft on the main process under FSDP / DeepSpeed; plain state dict otherwise
            acc.save_model(model, str(tmp), max_shard_size="1000GB", safe_serialization=True)
            acc.wait_for_everyone()
            if acc.is_main_process:
                if not (tmp / WEIGHTS_NAME).is_file():
                    raise CheckpointError(f"{tmp}: {WEIGHTS_NAME} was not written")
                self.extras(tmp)
                (tmp / "best.json").write_text(json.dumps({"step": state.step, "best_value": state.best_value,
                                                           "metrics": metrics}, indent=1))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
        acc.wait_for_everyone()
        return final

    def apply_retention(self, just_written: Path) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints, never ``just_written`` (even when older
        checkpoints carry higher step numbers). Returns what was removed."""
        others = [c for c in find_checkpoints(self.ckpt_dir) if c != just_written]
        drop = others[: max(0, len(others) - (self.keep - 1))]
        for old in drop:
            shutil.rmtree(old, ignore_errors=True)
        return drop


def read_draft(path: Path, method: str | None = None, weights: bool = True, average: bool = True) -> DraftCheckpoint:
    """The draft of training checkpoint ``path``: its ``draft_config.json``, the method's model
    config built from it and (``weights``) its state dict with ``module.`` prefixes (a wrapped
    model's) stripped.

    Args:
        method: the method the caller reads (None: any registered one).
        weights: False reads ``draft_config.json`` only (``state`` is empty).
        average: where the checkpoint holds ``ema.safetensors`` (``train.ema_decay``), its
            tensors replace the trained ones of the same names; False: the trained weights.

    Raises:
        ExportError: ``model.safetensors`` missing (with ``weights``; naming the launcher's sharded
            state when only that is there) or ``draft_config.json`` missing / invalid; a checkpoint of another
            method than ``method``, or of none registered; a config its method refuses.
    """
    from safetensors.torch import load_file

    path = Path(path)
    weights_path = path / WEIGHTS_NAME
    if weights and not weights_path.is_file():
        sharded = [d for d in ("pytorch_model_fsdp_0", "pytorch_model") if (path / d).exists()]
        if sharded:
            raise ExportError(
                f"{weights_path} missing: {path} holds only the launcher's sharded state ({sharded[0]}/), "
                "which export does not read; checkpoints written by this draftsmith version always carry the "
                "consolidated model.safetensors (resume the run for one more checkpoint to get it)")
    for f in (path / DRAFT_CONFIG_FILE, *([weights_path] if weights else [])):
        if not f.is_file():
            raise ExportError(f"{f} missing: not a draftsmith training checkpoint")
    try:
        meta = DraftCheckpointConfig.read(path)
    except DraftConfigError as exc:
        raise ExportError(str(exc)) from None
    if method is not None and meta.method != method:
        raise ExportError(f"{path / DRAFT_CONFIG_FILE}: method is {meta.method!r}, expected {method!r}")
    try:
        spec = get_method(meta.method)
    except UnknownMethodError as exc:
        raise ExportError(f"{path / DRAFT_CONFIG_FILE}: {exc}") from None
    try:
        config = spec.config_class(**meta.config)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{path / DRAFT_CONFIG_FILE}: invalid {meta.method} config ({exc})") from None
    state = {k.removeprefix("module."): v for k, v in load_file(str(weights_path)).items()} if weights else {}
    ema_path = path / EMA_WEIGHTS_NAME
    if weights and average and ema_path.is_file():
        ema = load_file(str(ema_path))
        unknown = sorted(set(ema) - set(state))
        if unknown:
            raise ExportError(f"{ema_path}: tensors {unknown[:3]} are not in {WEIGHTS_NAME}")
        state.update({k: v.to(state[k].dtype) for k, v in ema.items()})
    return DraftCheckpoint(path, meta, config, state)
