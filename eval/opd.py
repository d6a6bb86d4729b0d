"""``draftsmith opd``: on-policy distillation after SFT, one stage on a trained run directory
(Draft-OPD, arXiv:2605.29343; docs/training.md, "On-policy distillation").

    draftsmith opd RUN_DIR [--variant offline|replay] [--from best|latest] [--split soft|hard]
        [--opd-gamma 0.8] [--epochs 1] [--max-steps N] [--budget-minutes M] [--set KEY=VALUE ...]
        [--conversations 64] [--prefixes 2] [--new-tokens 64] [--span K+1] [--seed 0] [--prompts SOURCE]
        [--sft-rows 0] [--overwrite]

It starts from RUN_DIR's trained draft (``checkpoints/best``, or the latest ``checkpoints/step-N``;
``draft.init_from``) and writes only under ``RUN_DIR/opd/``: its recipe (``recipe.yaml``),
``plan.json`` (the variant and the checkpoint it started from), checkpoints, ``metrics.jsonl``,
the export (``opd/export``) and ``opd.json`` (what it prints). Re-running the command continues
from the last OPD checkpoint (replay rows already written are kept); ``--overwrite`` starts over.

- ``offline``: the run's own data (``opd/data`` links to ``RUN_DIR/data``), trained with
  ``draft.opd`` (:mod:`draftsmith.train.opd_loss`): on the teacher-forced TTT steps (EAGLE-3) or
  block slots (DFlash, DFlash2, DSpark, XPress), forward KL where the draft's own earlier positions of the chain
  were accepted, reverse KL decayed ``opd_gamma**k`` where they were not. No target forward: the
  data cost is 0 target tokens scored per trained token.
- ``replay``: the draft decodes with the target from prefixes of the run's tokenised training
  conversations, or from the prompts of ``--prompts SOURCE`` (the reference speculative decoder, :mod:`draftsmith.eval.spec_decode`, at
  ``eval.temperature``); the continuations, their loss mask on the tokens where verification
  rejected a draft token and the ``--span`` tokens after it, become ``opd/data`` (the target's
  hidden states captured by the data stage's own capture), trained with ``draft.opd`` too
  (:mod:`draftsmith.eval.opd_replay`); ``--sft-rows N`` adds N of the run's training
  conversations to those rows, so the stage trains on both. Its data cost counts the target
  tokens of the prefixes, of each verification (K + 1 per round) and of the capture.

The data cost printed is target tokens scored by this stage per trained token (the trained
tokens of the OPD run so far).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..draft_section import OPD_METHODS, opd_unsupported
from ..layout import DRAFT_CONFIG_FILE, RunLayout
from ..recipe import Recipe, load_recipe

OPD_DIR = "opd"
VARIANTS = ("offline", "replay")


class OpdError(ValueError):
    """The stage cannot run on this run directory; the message is one line saying why and what to do."""


@dataclass
class OpdOptions:
    """``draftsmith opd``'s flags (:mod:`draftsmith.cli.opd`), same names and meanings.

    Attributes:
        run_dir: the trained run directory (read; the stage writes under ``run_dir/opd``).
        variant: ``offline`` or ``replay``. start: ``best`` (``checkpoints/best`` when there is
            one, else the latest) or ``latest``.
        split: ``draft.opd`` (``soft``: expected acceptance at the served temperature ``Recipe.validation_temperatures[0]``,
            hard at T = 0; ``hard``: argmax hits). opd_gamma: ``draft.opd_gamma``.
        epochs / max_steps / budget_minutes: the OPD run's ``train.epochs`` / ``train.max_steps``
            / ``train.max_time_minutes`` (None: the run's recipe's).
        overrides: further ``KEY=VALUE`` recipe overrides.
        conversations / prefixes / new_tokens / span / seed: replay: conversations sampled,
            prefixes per conversation, tokens decoded after each prefix, tokens trained from each
            rejection on (None: ``eval.num_speculative_tokens + 1``), sampling seed.
        prompts: replay: a prompt set to decode from instead of the training conversations
            (``--conversations`` of its prompts, one prefix each; :mod:`draftsmith.eval.opd_replay`).
        sft_rows: replay: training conversations of the run added to the replay rows, with their
            SFT loss masks (0: the replay rows alone).
        device: where replay runs the target and the draft (None: this process's accelerator).
        overwrite: start ``run_dir/opd`` over.
    """

    run_dir: Path
    variant: str = "offline"
    start: str = "best"
    split: str = "soft"
    opd_gamma: float = 0.8
    epochs: float | None = 1.0
    max_steps: int | None = None
    budget_minutes: float | None = None
    overrides: list[str] = field(default_factory=list)
    conversations: int = 64
    prefixes: int = 2
    prompts: str | None = None
    sft_rows: int = 0
    new_tokens: int = 64
    span: int | None = None
    seed: int = 0
    device: str | None = None
    overwrite: bool = False


def trained_checkpoint(run_dir: Path, start: str = "best") -> Path:
    """RUN_DIR's trained checkpoint: ``checkpoints/best`` (``start="best"``, when it is complete)
    or the latest complete ``checkpoints/step-N``.

    Raises:
        OpdError: none there (the message names the command that makes one).
    """
    from ..train.checkpoint import find_checkpoints

    ckpts = RunLayout(run_dir).checkpoints
    best = ckpts / "best"
    if start == "best" and (best / DRAFT_CONFIG_FILE).is_file():
        return best
    found = [c for c in find_checkpoints(ckpts) if (c / DRAFT_CONFIG_FILE).is_file()]
    if found:
        return found[-1]
    raise OpdError(f"{run_dir} has no trained checkpoint (no complete checkpoints/step-N or checkpoints/best): "
                   f"make one with `draftsmith train RECIPE --run-dir {run_dir}`, then run draftsmith opd on it")


def run_recipe(run_dir: Path) -> Recipe:
    """RUN_DIR's resolved recipe (``recipe.yaml``), checked to be one OPD applies to.

    Raises:
        OpdError: no recipe (never trained: the train command); its draft.method has no OPD loss.
    """
    path = RunLayout(run_dir).recipe
    if not path.is_file():
        raise OpdError(f"{run_dir} has no recipe.yaml and no trained checkpoint: make one with "
                       f"`draftsmith train RECIPE --run-dir {run_dir}`, then run draftsmith opd on it")
    recipe = load_recipe(path)
    if recipe.draft.method not in OPD_METHODS:
        raise OpdError(opd_unsupported(recipe.draft.method))
    return recipe


def opd_recipe(run_dir: Path, checkpoint: Path, opts: OpdOptions) -> Recipe:
    """The OPD run's recipe: RUN_DIR's, starting from ``checkpoint`` (``draft.init_from``) with
    ``draft.opd`` on and the stage's budget, then ``opts.overrides``.

    Raises:
        OpdError: the method has no OPD loss. RecipeError: an override does not validate.
    """
    base = run_recipe(run_dir)
    sets = [f"draft.init_from={json.dumps(str(checkpoint.resolve()))}", f"draft.opd={opts.split}",
            f"draft.opd_gamma={opts.opd_gamma}", "draft.accept_weighting=none"]
    if base.draft.method == "eagle3":  # a whole trained draft: the target-layer starts do not apply
        sets += ["draft.init_layer_from_target=null", "draft.init_fc=random"]
    if opts.epochs is not None:
        sets.append(f"train.epochs={opts.epochs}")
    # the stage's own budget: --max-steps, else --epochs (the run's train.max_steps does not carry over)
    sets.append(f"train.max_steps={'null' if opts.max_steps is None else opts.max_steps}")
    if opts.budget_minutes is not None:
        sets.append(f"train.max_time_minutes={opts.budget_minutes}")
    return load_recipe(RunLayout(run_dir).recipe, sets + list(opts.overrides))


def _link_data(run_dir: Path, opd: Path) -> None:
    """``opd/data`` -> ``../data`` (the offline variant trains on the run's own data, read only)."""
    link = opd / "data"
    if link.is_symlink() and link.resolve() == RunLayout(run_dir).data.root.resolve():
        return
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.exists():
        shutil.rmtree(link)
    os.symlink(os.path.relpath(RunLayout(run_dir).data.root, opd), link)


def _stage_plan(run_dir: Path, opts: OpdOptions) -> tuple[Path, dict[str, Any]]:
    """Start ``run_dir/opd`` (``--overwrite``: over) or continue it: ``(opd dir, plan)`` where the
    plan (``opd/plan.json``) records the variant and the checkpoint the stage started from.

    Raises:
        OpdError: ``opd/`` holds the other variant (without ``--overwrite``), no trained checkpoint.
    """
    opd = run_dir / OPD_DIR
    plan_file = opd / "plan.json"
    if plan_file.is_file() and not opts.overwrite:
        plan = json.loads(plan_file.read_text())
        if plan["variant"] != opts.variant:
            raise OpdError(f"{opd} holds a {plan['variant']} OPD stage: re-run with --variant {plan['variant']} to "
                           f"continue it, or --overwrite to start a {opts.variant} stage over")
        if not Path(plan["checkpoint"]).is_dir():
            raise OpdError(f"{plan['checkpoint']} (the checkpoint {opd} started from) is gone: --overwrite starts "
                           "over from the run's current one")
        return opd, plan
    checkpoint = trained_checkpoint(run_dir, opts.start)  # refuses before anything is removed
    if opd.is_symlink() or opd.is_file():
        raise OpdError(f"{opd} is not a directory: move it away")
    if opd.exists():
        for child in opd.iterdir():  # the OPD stage's own files only: RUN_DIR itself is never touched
            if child.is_symlink() or child.is_file():
                child.unlink()
            else:
                shutil.rmtree(child)
    opd.mkdir(parents=True, exist_ok=True)
    plan = {"variant": opts.variant, "checkpoint": str(checkpoint.resolve()), "run_dir": str(run_dir.resolve())}
    plan_file.write_text(json.dumps(plan, indent=1))
    return opd, plan


def trained_tokens(opd: Path, fallback: int) -> int:
    """Tokens trained by the OPD run so far: its latest checkpoint's ``train_state.json``
    ``tokens`` (all invocations), else ``fallback`` (this invocation's)."""
    from ..train.checkpoint import find_checkpoints

    found = find_checkpoints(RunLayout(opd).checkpoints)
    if found:
        state = json.loads((found[-1] / "train_state.json").read_text())
        return int(state.get("tokens", fallback))
    return fallback


def run_opd(opts: OpdOptions) -> dict[str, Any]:
    """The whole stage (module docstring); returns what ``RUN_DIR/opd/opd.json`` holds.

    Raises:
        OpdError: unknown variant, no trained checkpoint, a method without an OPD loss, the other
            variant in ``opd/``, a replay that produced no row to train on or a failed stage (its
            own message printed to stderr first).
        RecipeError: an override does not validate.
    """
    from ..eval.export import export
    from ..train.checkpoint import find_checkpoints
    from ..train.run import train, train_errors

    run_dir = Path(opts.run_dir)
    if opts.variant not in VARIANTS:
        raise OpdError(f"--variant {opts.variant}: one of {', '.join(VARIANTS)}")
    if not run_dir.is_dir():
        raise OpdError(f"{run_dir} is no run directory: make one with `draftsmith train RECIPE --run-dir {run_dir}`")
    # the method, the checkpoint and the overrides are checked before anything under opd/ is touched
    run_recipe(run_dir)
    opd_recipe(run_dir, trained_checkpoint(run_dir, opts.start), opts)
    opd, plan = _stage_plan(run_dir, opts)
    recipe = opd_recipe(run_dir, Path(plan["checkpoint"]), opts)
    scored = 0
    replay: dict[str, Any] | None = None
    if opts.variant == "offline":
        _link_data(run_dir, opd)
    else:
        from .opd_replay import ReplayError, build_replay_data

        try:
            replay = build_replay_data(recipe, run_dir, opd, Path(plan["checkpoint"]), opts)
        except ReplayError as exc:
            raise OpdError(str(exc)) from None
        scored = replay["target_tokens_scored"]
    resume = bool(find_checkpoints(RunLayout(opd).checkpoints))
    refused, failed = train_errors()
    try:  # without an OPD checkpoint yet, a killed first attempt's metrics are started over (data/ is kept)
        fitted = train(recipe, opd, resume=resume, overwrite=not resume, prepare=False,
                       recipe_arg=f"{RunLayout(opd).recipe}", argv=["draftsmith", "opd", str(run_dir)])
    except (*refused, *failed) as exc:
        print(f"draftsmith opd: error: {exc}", file=sys.stderr)
        raise OpdError(f"training in {opd} failed (exit {2 if isinstance(exc, refused) else 1}); see the error "
                       "above; re-running the command continues from the last OPD checkpoint") from None
    best = RunLayout(opd).checkpoints / "best"
    ckpt = best if (best / DRAFT_CONFIG_FILE).is_file() else find_checkpoints(RunLayout(opd).checkpoints)[-1]
    out = export(ckpt, RunLayout(opd).export, num_speculative_tokens=recipe.eval.num_speculative_tokens)
    tokens = trained_tokens(opd, fitted.tokens)
    result = {"variant": opts.variant, "run_dir": str(run_dir), "opd_dir": str(opd), "started_from": plan["checkpoint"],
              "split": recipe.draft.opd, "opd_gamma": recipe.draft.opd_gamma,
              "served_temperature": float(recipe.validation_temperatures[0]), "steps": fitted.steps,
              "trained_tokens": tokens, "target_tokens_scored": scored,
              "target_tokens_per_trained_token": round(scored / max(tokens, 1), 4),
              "checkpoint": str(ckpt), "export": str(out), "last_metrics": fitted.last_metrics}
    if replay is not None:
        result["replay"] = replay
    (opd / "opd.json").write_text(json.dumps(result, indent=1))
    return result


def cost_line(result: dict[str, Any]) -> str:
    """The data cost line the command prints."""
    return (f"data cost: {result['target_tokens_per_trained_token']:.3f} target tokens scored per trained token "
            f"({result['target_tokens_scored']} scored by the {result['variant']} stage, "
            f"{result['trained_tokens']} trained)")
