"""What ``--resume`` does with a recipe that differs from the one the checkpoint was trained with.

Every recipe key is classed (:data:`KEY_CLASSES`, by dotted key or section prefix; the longest
match wins):

- ``free``: changes nothing that trained (step budget, logging, trackers, checkpoint frequency,
  workers, kernels, the evaluation and vLLM sections, how data would be prepared): taken as is.
- ``applied``: a training hyperparameter (learning rate and schedule, optimizer hyperparameters,
  loss weights): taken from the resumed step on, with one logged note; the restored optimizer
  groups and schedules are given the new values (:func:`apply_hyperparameters`), so the
  ``recipe.yaml`` saved with the next checkpoint says what really trained.
- ``refused``: the draft's method or geometry, ``draft.ttt_steps``, the optimizer, the target and
  every data key that changes the data or its order: one line names every such key with its
  old and new value and the ways out (``--overwrite``, a fresh ``--run-dir``), and nothing is
  written (:class:`ResumeRefusedError`).

:func:`plan_resume` decides before anything is written (the training command calls it before
its data check; the :class:`~draftsmith.train.trainer.Trainer` again before it builds the
model): which checkpoint (the last, or ``--resume-from``), that it is intact (a truncated
``model.safetensors``, an unreadable ``train_state.json``: :class:`CorruptCheckpointError`
naming the file and the previous checkpoint), that it was trained by the recipe's method, and
the recipe comparison. The checkpoint's own ``recipe.yaml`` is compared (every checkpoint holds
one); a checkpoint without one falls back to ``RUN_DIR/recipe.yaml``. The aux layer ids the
checkpoint's draft was trained on (its ``draft_config.json`` ``target``) are compared with the run
directory's data as well (``prepare --overwrite-data`` with other ids).

A run directory with training output but no checkpoint at all (every step of the earlier run
was skipped as non-finite, or it stopped before its first checkpoint) resumes from step 0
(:attr:`ResumePlan.checkpoint` None; the trainer says so in one warning).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..layout import DRAFT_CONFIG_FILE, RunLayout
from .checkpoint import (
    CHECKPOINT_PREFIX,
    CheckpointError,
    check_launcher_layout,
    checkpoint_problem,
    find_checkpoints,
    training_outputs,
)

log = logging.getLogger("draftsmith.train")

FREE, APPLIED, REFUSED = "free", "applied", "refused"

_GEOMETRY = (REFUSED, "the draft's architecture: the checkpoint's tensors are of the old one")
_START = (REFUSED, "how the draft started: the checkpoint's weights already hold that start")
_DATA = (REFUSED, "changes the training data or its order")
_LOSS = (APPLIED, "loss of the steps from now on")
_SCHEDULE = (APPLIED, "optimizer / schedule hyperparameter of the steps from now on")
_FREE = (FREE, "changes nothing that trained")

KEY_CLASSES: dict[str, tuple[str, str]] = {
    # -- top level
    "name": _FREE,
    "launcher": (FREE, "the launcher itself is checked against the checkpoint's resume state"),
    "seed": (REFUSED, "fixes the data order and the validation split"),
    # -- the target
    "target.name_or_path": (REFUSED, "the target the draft learns"),
    "target.dtype": (REFUSED, "the hidden states and distributions the draft learns"),
    "target.trust_remote_code": _FREE,
    # -- data: what the data is (refused) vs how it is made or evaluated (free)
    "data.sources": _DATA,
    "data.max_samples": _DATA,
    "data.max_length": _DATA,
    "data.overlong": _DATA,
    "data.harmony_channels": _DATA,
    "data.chat_template_kwargs": _DATA,
    "data.history_turns": _DATA,
    "data.draft_vocab_size": (REFUSED, "the draft's vocab: its lm_head rows"),
    "data.aux_layer_ids": (REFUSED, "the target layers the draft reads"),
    "data.hidden_states_mode": _DATA,
    "data.hidden_states_dtype": _DATA,
    "data.validation_fraction": _DATA,
    "data.select": _DATA,
    "data.regenerate.enabled": _DATA,
    "data.regenerate.max_new_tokens": _DATA,
    "data.regenerate.temperatures": _DATA,
    "data.regenerate.samples_per_prompt": _DATA,
    "data.regenerate.reasoning_effort": _DATA,
    "data.regenerate.engine": _FREE,
    "data.regenerate.batch_size": _FREE,
    "data.regenerate.concurrency": _FREE,
    "data.regenerate.max_retries": _FREE,
    "data.regenerate.tensor_parallel_size": _FREE,
    "data.regenerate.server_urls": _FREE,
    "data.eval_prompts": _FREE,
    "data.strict": _FREE,
    "data.hidden_states_engine": _FREE,
    "data.expected_tokens": _FREE,
    "data.sequences_per_shard": _FREE,
    "data.shard_bytes": _FREE,
    "data.capture_placement": _FREE,
    "data.capture_batch_tokens": _FREE,
    "data.num_proc": _FREE,
    # -- draft: the method and geometry (refused), the loss (applied), memory (free)
    "draft.method": (REFUSED, "the draft's method"),
    "draft.ttt_steps": (REFUSED, "the unrolled steps the draft is trained for (draft_config.json)"),
    "draft.sliding_window": _GEOMETRY,
    "draft.norm_before_residual": _GEOMETRY,
    "draft.norm_before_fc": _GEOMETRY,
    "draft.fc_norm": _GEOMETRY,
    "draft.norm_output": _GEOMETRY,
    "draft.layer": _GEOMETRY,
    "draft.mla": _GEOMETRY,
    "draft.num_heads": _GEOMETRY,
    "draft.num_layers": _GEOMETRY,
    "draft.n_predict": _GEOMETRY,
    "draft.inner_dim": _GEOMETRY,
    "draft.tie_weights": _GEOMETRY,
    "draft.scale_input": _GEOMETRY,
    "draft.block_size": _GEOMETRY,
    "draft.mask_token_id": _GEOMETRY,
    "draft.num_depths": _GEOMETRY,
    "draft.train_embeddings": (REFUSED, "the trainable parameters (the optimizer's state is of the old ones)"),
    "draft.freeze_lm_head": (REFUSED, "the trainable parameters (the optimizer's state is of the old ones)"),
    "draft.markov_rank": _GEOMETRY,
    "draft.confidence_head": _GEOMETRY,
    "draft.confidence_head_with_markov": _GEOMETRY,
    "draft.conv_kernel_size": _GEOMETRY,
    "draft.conv_group_size": _GEOMETRY,
    "draft.selector_rank": _GEOMETRY,
    "draft.selector_top_k": _GEOMETRY,
    "draft.xpress_rank": _GEOMETRY,
    "draft.xpress_mlp_ratio": _GEOMETRY,
    "draft.init_from": _START,
    "draft.init_lm_head_from_target": _START,
    "draft.init_layer_from_target": _START,
    "draft.init_fc": _START,
    "draft.init_from_target": _START,
    "draft.loss": _LOSS,
    "draft.lk_kl_scale": _LOSS,
    "draft.lk_kl_decay": _LOSS,
    "draft.distill_temperature": _LOSS,
    "draft.aux_noise_std": _LOSS,
    "draft.gamma": _LOSS,
    "draft.accept_weighting": _LOSS,
    "draft.opd": _LOSS,
    "draft.opd_gamma": _LOSS,
    "draft.head_decay": _LOSS,
    "draft.num_anchors": _LOSS,
    "draft.loss_decay_gamma": _LOSS,
    "draft.down_sample_ratio": _LOSS,
    "draft.down_sample_ratio_min": _LOSS,
    "draft.max_anchors": _LOSS,
    "draft.ce_weight": _LOSS,
    "draft.distill_weight": _LOSS,
    "draft.confidence_weight": _LOSS,
    "draft.selector_loss_alpha": _LOSS,
    "draft.loss_weights": _LOSS,
    "draft.consistency_weight": _LOSS,
    "draft.consistency_passes": _LOSS,
    "draft.base_anchor_weight": _LOSS,
    "draft.base_anchor_full_weight": _LOSS,
    "draft.stage2_start_step": (APPLIED, "the data schedule of the steps from now on"),
    "draft.stage2_new_tokens": (APPLIED, "the data schedule of the steps from now on"),
    "draft.stage2_temperature": (APPLIED, "the data schedule of the steps from now on"),
    "draft.gradient_checkpointing": (FREE, "memory only: the same values"),
    "draft.num_jacobi_passes": (FREE, "inference only (written to the export)"),
    "draft.xpress_topc": (FREE, "inference only (written to the export)"),
    # -- train
    "train.optimizer": (REFUSED, "the optimizer whose state the checkpoint holds"),
    "train.batch_size": (REFUSED, ("per process; refused unless batch_size x processes, the global batch, is "
                                   "the same: the data position is counted in global batches of the old size")),
    "train.grad_accum_steps": (REFUSED, "the optimizer steps the data position and schedule count"),
    "train.packing": _DATA,
    "train.pack_tokens": _DATA,
    "train.best_metric": (REFUSED, "checkpoints/best and early stopping so far follow the old measure"),
    "train.eval_temperatures": (REFUSED, "checkpoints/best so far follows the measure at the old first temperature"),
    "train.eval_draft_sampling": (REFUSED, "checkpoints/best so far follows the old measure"),
    "train.lr": _SCHEDULE,
    "train.muon_lr": _SCHEDULE,
    "train.weight_decay": _SCHEDULE,
    "train.muon_weight_decay": _SCHEDULE,
    "train.ema_decay": (APPLIED, "the weight average of the steps from now on (a checkpoint without one starts it "
                                 "from its weights)"),
    "train.betas": _SCHEDULE,
    "train.warmup_ratio": _SCHEDULE,
    "train.min_lr_ratio": _SCHEDULE,
    "train.max_grad_norm": _SCHEDULE,
    "train.loss_on": (APPLIED, "the tokens the loss of the steps from now on predicts"),
    "train.epochs": (FREE, "the step budget (the schedule follows the new total)"),
    "train.max_steps": (FREE, "the step budget (the schedule follows the new total)"),
    "train.max_time_minutes": (FREE, "the time budget"),
    "train.loss_chunk_rows": (FREE, "kernels only: the same values"),
    "train.attention_backend": (FREE, "kernels only: the same values"),
    "train.fused_loss": (FREE, "kernels only: the same values"),
    "train.compile": (FREE, "kernels only: the same values"),
    "train.max_nonfinite_steps": _FREE,
    "train.collective_timeout_s": _FREE,
    "train.log_every": _FREE,
    "train.eval_every": _FREE,
    "train.eval_max_sequences": _FREE,
    "train.early_stopping_patience": _FREE,
    "train.checkpoint_every": _FREE,
    "train.keep_checkpoints": _FREE,
    "train.num_workers": _FREE,
    "train.report_to": _FREE,
    "train.tracker_project": _FREE,
    "train.run_name": _FREE,
    "train.wandb_mode": _FREE,
    # -- whole sections used after training only
    "eval": (FREE, "export and evaluation only"),
    "vllm": (FREE, "the vLLM engines of the other stages only"),
}


class ResumeRefusedError(CheckpointError):
    """``--resume`` with a recipe that changes a refused key (or the method): one line naming
    every such key, old -> new, and the ways out. Raised before anything is written."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint to resume is damaged (a truncated ``model.safetensors``, an unreadable
    ``train_state.json`` ...): one line naming the file and the previous checkpoint to resume
    from (``--resume-from``)."""


def classify(key: str) -> tuple[str, str] | None:
    """``(class, why)`` of the dotted recipe ``key``: the entry of :data:`KEY_CLASSES` for the
    key itself or its longest section prefix; None when none covers it."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        found = KEY_CLASSES.get(".".join(parts[:n]))
        if found is not None:
            return found
    return None


def recipe_sections() -> set[str]:
    """The dotted keys of the recipe's sections (``data``, ``data.regenerate``, ``draft``, ...):
    a dict under any other key is a value (``vllm.extra_engine_args``, ``draft.loss_weights``)."""
    from ..recipe import recipe_schema

    return {row["key"] for row in recipe_schema() if row["type"] == "section"}


def flatten(tree: dict[str, Any], sections: set[str], prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a recipe dict (a dumped recipe, a ``recipe.yaml``)."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and key in sections:
            out.update(flatten(value, sections, f"{key}."))
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    kind: str
    why: str = ""
    where: str = ""  # the file the old value was read from, when not the checkpoint's recipe

    def __str__(self) -> str:
        return f"{self.key} {show(self.old)} -> {show(self.new)}" + (f" ({self.where})" if self.where else "")


def show(value: Any, limit: int = 80) -> str:
    """A recipe value as the user wrote it in YAML flow style (lists, null, plain strings), cut
    to ``limit`` characters."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(", ", ": ")) if isinstance(value, (list, dict, tuple)) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compare_recipes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The keys whose value differs between two flattened recipes (keys only one of them has,
    e.g. keys added since the checkpoint was written, are not compared), classed. A key no
    entry of :data:`KEY_CLASSES` covers is refused (a new key is unknown until classed)."""
    changes = []
    for key, value in new.items():
        if key not in old or _same(old[key], value):
            continue
        kind, why = classify(key) or (REFUSED, "not classed for resume")
        changes.append(Change(key, old[key], value, kind, why))
    return changes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


WAY_OUT = "start over with --overwrite, or train into a fresh --run-dir"


def refusal_message(ckpt: Path, changes: list[Change]) -> str:
    """The one line of :class:`ResumeRefusedError` for the refused ``changes``."""
    return (f"--resume: {ckpt} was trained with other values of keys a resumed run cannot change: "
            f"{', '.join(str(c) for c in changes)}; nothing was written: set them back "
            f"(the checkpoint's recipe: {ckpt / 'recipe.yaml'}), {WAY_OUT}")


def method_message(ckpt: Path, old: str, new: str) -> str:
    """The one line of a resume whose recipe asks for another method than the checkpoint's."""
    return (f"--resume: checkpoint {ckpt.name} was trained by {old}, the recipe asks for {new} ({ckpt}); "
            f"nothing was written: resume with the recipe it was trained with ({ckpt / 'recipe.yaml'}), {WAY_OUT}")


def previous_checkpoint_offer(ckpt: Path, run_dir: Path) -> str:
    """How to go on without ``ckpt``: ``--resume-from`` the newest earlier checkpoint, or start over."""
    earlier = [c for c in find_checkpoints(RunLayout(run_dir).checkpoints) if _step(c) < _step(ckpt)]
    if earlier:
        return (f"resume from the previous checkpoint with --resume-from {earlier[-1].name} (later ones are "
                f"moved aside), or {WAY_OUT}")
    return f"no earlier checkpoint is left: {WAY_OUT}"


def _step(ckpt: Path) -> int:
    m = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", ckpt.name)
    return int(m.group(1)) if m else -1


@dataclass
class ResumePlan:
    """What :func:`plan_resume` decided: the checkpoint to load (None: the run directory holds
    training output but no checkpoint; start from step 0) and the recipe keys that changed."""

    checkpoint: Path | None
    applied: list[Change] = field(default_factory=list)
    free: list[Change] = field(default_factory=list)
    recipe_source: Path | None = None  # the recipe the new one was compared with
    later: list[Path] = field(default_factory=list)  # checkpoints after ``checkpoint`` (--resume-from)

    def note(self) -> str | None:
        """The one logged line of the applied keys (None: none)."""
        if not self.applied:
            return None
        return (f"--resume: {', '.join(str(c) for c in self.applied)} (changed since {self.checkpoint.name}): "
                f"applied from step {_step(self.checkpoint)} on; the checkpoints from now on record the new values")


def resolve_resume_from(run_dir: Path, resume_from: str | Path) -> Path:
    """The checkpoint ``--resume-from`` names: ``step-N`` (or ``N``) of ``RUN_DIR/checkpoints``, or
    the path of one of them.

    Raises:
        CheckpointError: not a checkpoint of this run directory, or not a complete one.
    """
    ckpt_dir = RunLayout(run_dir).checkpoints
    text = str(resume_from)
    if re.fullmatch(r"\d+", text):
        text = f"{CHECKPOINT_PREFIX}{text}"
    path = ckpt_dir / text if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", text) else Path(text)
    have = ", ".join(c.name for c in find_checkpoints(ckpt_dir)) or "none"
    if not path.is_dir() or path.resolve().parent != ckpt_dir.resolve() or _step(path) < 0:
        raise CheckpointError(f"--resume-from {resume_from}: not a checkpoint of {run_dir} (give step-N or "
                              f"{ckpt_dir}/step-N; there: {have})")
    if not (path / "train_state.json").is_file():
        raise CheckpointError(f"--resume-from {resume_from}: {path} is not a complete checkpoint (no "
                              f"train_state.json; complete ones: {have})")
    return ckpt_dir / path.name


def plan_resume(recipe: Any, run_dir: Path, resume_from: str | Path | None = None,
                distributed_type: str | None = None, num_processes: int | None = None) -> ResumePlan:
    """Decide a resume of ``run_dir`` with ``recipe`` before anything is written: the checkpoint
    (the last one, or ``resume_from``), that it is intact and of the recipe's method, and which
    recipe keys changed since it was written, in this order: the method, the checkpoint's files,
    the launcher that wrote it (:func:`~draftsmith.train.checkpoint.check_launcher_layout` with
    ``distributed_type`` / ``num_processes``: this run's, by default what the launcher's
    environment asks for and ``WORLD_SIZE``), the recipe keys. Reads only.

    ``train.batch_size`` is per process: a change that keeps the global batch (batch size x
    processes, against the checkpoint's ``train_state.json``) is free, as one process with batch
    4 trains like two with batch 2.

    Raises:
        FileNotFoundError: nothing to resume (no checkpoint and no training output; or
            ``step-N`` directories none of which is complete).
        CheckpointError: ``resume_from`` is not a complete checkpoint of ``run_dir``; another
            launcher wrote it.
        ResumeRefusedError: another method, or a refused key changed (one line, every key).
        CorruptCheckpointError: a file of the checkpoint is damaged (one line, the previous checkpoint).
    """
    run_dir = Path(run_dir)
    ckpt_dir = RunLayout(run_dir).checkpoints
    found = find_checkpoints(ckpt_dir)
    if resume_from is not None:
        ckpt = resolve_resume_from(run_dir, resume_from)
    elif found:
        ckpt = found[-1]
    else:
        started = ckpt_dir.is_dir() and any(_step(p) >= 0 for p in ckpt_dir.iterdir())
        if training_outputs(run_dir) and not started:
            return ResumePlan(None)  # the earlier run wrote no checkpoint: from step 0
        raise FileNotFoundError(f"--resume: no checkpoint under {ckpt_dir}: nothing to resume (train without "
                                "--resume to start, or --overwrite to start over)")
    later = [c for c in found if _step(c) > _step(ckpt)]
    saved_method = _saved_method(ckpt)
    if saved_method is not None and saved_method != recipe.draft.method:
        raise ResumeRefusedError(method_message(ckpt, saved_method, recipe.draft.method))
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        raise CorruptCheckpointError(f"{problem}: cannot resume from {ckpt.name}; {previous_checkpoint_offer(ckpt, run_dir)}")
    if distributed_type is None:
        from .launchers import requested_distributed_type

        distributed_type = requested_distributed_type() or "NO"
    if num_processes is None:
        num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    check_launcher_layout(ckpt, json.loads((ckpt / "train_state.json").read_text()), distributed_type, num_processes,
                          warn=False)
    source, old = _saved_recipe(ckpt, run_dir)
    sections = recipe_sections()
    changes = compare_recipes(flatten(old, sections), flatten(recipe.model_dump(mode="json"), sections)) \
        if old is not None else []
    changes = [_global_batch(c, ckpt, num_processes) if c.key == "train.batch_size" else c for c in changes]
    refused = [c for c in changes if c.kind == REFUSED]
    if not any(c.key == "data.aux_layer_ids" for c in refused):
        refused += _aux_ids_against_data(ckpt, run_dir)
    if refused:
        raise ResumeRefusedError(refusal_message(ckpt, refused))
    return ResumePlan(ckpt, [c for c in changes if c.kind == APPLIED], [c for c in changes if c.kind == FREE],
                      source, later)


def _global_batch(change: Change, ckpt: Path, now: int) -> Change:
    """``train.batch_size`` changed: free when the global batch (x processes) is the same, else
    refused with both global batches."""
    saved = _read_json(ckpt / "train_state.json")
    was = int(saved.get("num_processes", 1)) if isinstance(saved, dict) else 1
    if not all(isinstance(v, int) for v in (change.old, change.new)):
        return change
    if change.old * was == change.new * now:
        return Change(change.key, change.old, change.new, FREE, f"the same global batch over {now} processes")
    return Change(change.key, change.old, change.new, REFUSED, change.why,
                  where=f"global batch {change.old * was} -> {change.new * now} over {was} -> {now} processes")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _saved_method(ckpt: Path) -> str | None:
    """The method that trained ``ckpt``: its ``draft_config.json``'s, else its recipe's."""
    meta = _read_json(ckpt / DRAFT_CONFIG_FILE)
    if isinstance(meta, dict) and isinstance(meta.get("method"), str):
        return meta["method"]
    recipe = _read_yaml(ckpt / "recipe.yaml")
    draft = recipe.get("draft") if isinstance(recipe, dict) else None
    return draft.get("method") if isinstance(draft, dict) else None


def _saved_recipe(ckpt: Path, run_dir: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The recipe ``ckpt`` was trained with (its ``recipe.yaml``; written by draftsmith before
    that was saved with every checkpoint: ``RUN_DIR/recipe.yaml``) as a dict; None without one."""
    for path in (ckpt / "recipe.yaml", RunLayout(run_dir).recipe):
        tree = _read_yaml(path) if path.is_file() else None
        if isinstance(tree, dict):
            return path, tree
    return None, None


def _aux_ids_against_data(ckpt: Path, run_dir: Path) -> list[Change]:
    """The aux layer ids ``ckpt``'s draft was trained on (``draft_config.json`` ``target``) against
    those of the run directory's data (the shards' manifest, else ``target.json``): a change
    when they differ (``prepare --overwrite-data`` with other ids)."""
    from ..data_prep.agreement import captured_aux_layer_ids

    meta = _read_json(ckpt / DRAFT_CONFIG_FILE)
    trained = (meta.get("target") or {}).get("aux_layer_ids") if isinstance(meta, dict) else None
    if trained is None:
        return []
    paths = RunLayout(run_dir).data
    try:
        now, where = captured_aux_layer_ids(paths), paths.hidden_states / "manifest.json"
    except Exception:  # noqa: BLE001 - an unreadable manifest is the data check's to report
        now = None
    if now is None:
        info = _read_json(paths.target_info)
        now, where = (info.get("aux_layer_ids") if isinstance(info, dict) else None), paths.target_info
    if now is None or list(now) == list(trained):
        return []
    return [Change("data.aux_layer_ids", list(trained), list(now), REFUSED, "the target layers the draft reads",
                   where=f"{ckpt / DRAFT_CONFIG_FILE} -> {where}")]


def set_aside_later(plan: ResumePlan) -> list[Path]:
    """Rename the checkpoints after the one resumed (``--resume-from`` an earlier one) to
    ``checkpoints/abandoned-step-M``, so that retention and a later ``--resume`` follow the resumed
    run; each move is logged. Main process. Returns the new paths."""
    moved = []
    for ckpt in plan.later:
        dest = ckpt.with_name(f"abandoned-{ckpt.name}")
        n = 1
        while dest.exists():
            n += 1
            dest = ckpt.with_name(f"abandoned-{ckpt.name}-{n}")
        ckpt.rename(dest)
        log.warning("--resume-from %s: moved the later checkpoint %s to %s (delete it when no longer needed)",
                    plan.checkpoint.name, ckpt.name, dest)
        moved.append(dest)
    return moved


def apply_hyperparameters(optimizers: list[Any], schedulers: list[Any], fresh_groups: list[list[dict[str, Any]]],
                          fresh_base_lrs: list[list[float]]) -> None:
    """Give the restored ``optimizers`` / ``schedulers`` the hyperparameters the new recipe built
    them with (``fresh_*``: their param groups without ``params`` and their base lrs, taken before
    the checkpoint was loaded): accelerate's ``load_state`` restores the old ones (the optimizer's
    ``param_groups``, the schedule's ``base_lrs``). Each group's current lr is recomputed from the
    new base lr at the restored schedule step."""
    for opt, groups in zip(optimizers, fresh_groups):
        for group, fresh in zip(opt.param_groups, groups):
            group.update({k: v for k, v in fresh.items() if k != "lr"})
    for sched, base_lrs in zip(schedulers, fresh_base_lrs):
        inner = getattr(sched, "scheduler", sched)  # accelerate's AcceleratedScheduler wraps it
        inner.base_lrs = list(base_lrs)
        lambdas = getattr(inner, "lr_lambdas", None)
        groups = inner.optimizer.param_groups
        for i, (group, base) in enumerate(zip(groups, base_lrs)):
            group["initial_lr"] = base
            group["lr"] = base * lambdas[i](inner.last_epoch) if lambdas else base
        inner._last_lr = [g["lr"] for g in groups]



def load_resumed(accelerator: Any, ckpt: Path, state: Any, model: Any, run_dir: Path) -> None:
    """:func:`~draftsmith.train.checkpoint.load_checkpoint` of the checkpoint the plan chose.

    Raises:
        CheckpointError: as ``load_checkpoint`` (tensors that do not fit, another launcher's state).
        CorruptCheckpointError: any other failure to load it (a damaged accelerate / DeepSpeed state
            file the header check could not see), one line offering the previous checkpoint.
    """
    from .checkpoint import load_checkpoint

    try:
        load_checkpoint(accelerator, ckpt, state, model)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch / accelerate raise many types for a damaged file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CorruptCheckpointError(f"{ckpt}: its training state does not load ({type(exc).__name__}: {first}); "
                                     f"{previous_checkpoint_offer(ckpt, run_dir)}") from None


def warn_nothing_to_resume(layout: RunLayout) -> None:
    """The one warning of ``--resume`` in a run directory whose earlier run wrote no checkpoint."""
    lines = len(layout.metrics.read_text().splitlines()) if layout.metrics.is_file() else 0
    log.warning("--resume: nothing to resume: %s holds no checkpoint (the earlier run wrote none); training from "
                "step 0%s", layout.checkpoints, f", the {lines} lines of its metrics.jsonl are dropped" if lines else "")
