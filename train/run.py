"""One training run of a recipe's draft: :func:`train`, what every training command does once its
command line is parsed (``draftsmith train``, ``accelerate launch -m draftsmith.train``,
``accelerate launch train/eagle3.py``; their parsers are :mod:`draftsmith.cli.train`), and what
``draftsmith adapt`` runs in-process.

    result = train(recipe, Path("runs/x"))            # prepares what data is missing, then fits
    print(json.dumps(fit_summary(Path("runs/x"), result), indent=1))
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..recipe import Recipe


def train(recipe: Recipe, run_dir: Path, *, method: type | None = None, resume: bool = False,
          overwrite: bool = False, prepare: bool = True, verify_shards: bool = False,
          recipe_arg: str = "RECIPE", recipe_file: str | None = None, argv: list[str] | None = None,
          resume_from: str | None = None) -> Any:
    """Prepare the data stages missing from ``RUN_DIR/data`` and train ``recipe``'s draft into
    ``RUN_DIR`` (checkpoints under ``RUN_DIR/checkpoints``, metrics in ``RUN_DIR/metrics.jsonl``).

    Before anything is written the data on disk is compared with the recipe
    (:func:`~draftsmith.data_prep.agreement.check_run_dir`) and the run directory is claimed
    (rank 0; :func:`~draftsmith.train.checkpoint.claim_run_dir`); the data stages run before the
    accelerator exists (:func:`~draftsmith.train.method_base.ensure_prepared`), so their children
    get the GPUs while no rank holds memory. Then the accelerator, the method and
    :func:`~draftsmith.train.trainer.fit`.

    Args:
        method: the training method class (default: the one :mod:`draftsmith.methods` registers
            for ``recipe.draft.method``).
        resume: continue from the last checkpoint in ``run_dir`` (:func:`~draftsmith.train.resume.plan_resume`).
        resume_from: with ``resume``, continue from this checkpoint (``step-N`` or its path) instead.
        overwrite: start over in a ``run_dir`` holding an earlier run's checkpoints / metrics
            (``data/`` is kept).
        prepare: run the missing data stages; False: a missing one raises
            :class:`~draftsmith.train.method_base.DataNotPreparedError`.
        verify_shards: hash every hidden-state shard against its manifest before training
            (default: a size and header check).
        recipe_arg: the recipe as the command line named it (with its ``--set`` overrides), for the
            commands a refused run directory's message suggests
            (:func:`~draftsmith.data_prep.agreement.recipe_arg`).
        recipe_file: the recipe file as the command line named it, for the prepare command a
            missing data stage's message suggests (default: ``recipe_arg``).
        argv: the command line recorded in the run's metadata (default: ``sys.argv``).

    Returns:
        The :class:`~draftsmith.train.trainer.FitResult`.

    Raises:
        CheckpointError, LauncherError, MemoryBudgetError: the run directory is in use (or
            ``resume`` has nothing to resume), the launcher does not fit, the online target does
            not fit one GPU.
        DataNotPreparedError, DataError, ShardError, MaskTokenError, FileNotFoundError,
            ValidationSplitError, MethodSetupError, PlanError, DataStageError, TimeoutError,
            NonFiniteLossError: the data (or its preparation), the warm start or the run failed.
    """
    from ..data_prep.agreement import check_run_dir
    from ..data_prep.prepare import missing_stages
    from ..data_prep.preflight import preflight_run
    from ..run_lock import command_line, run_dir_lock
    from ..layout import RunLayout
    from ..methods import get_method
    from .checkpoint import claim_run_dir
    from .resume import plan_resume
    from .distributed import build_accelerator
    from .method_base import DraftVocabMethod, check_draft_vocab_size, check_online_target_fits, ensure_prepared
    from .trainer import fit

    method_cls = method or get_method(recipe.draft.method).training_method
    main_rank = int(os.environ.get("RANK", "0")) == 0
    with contextlib.ExitStack() as held:
        if main_rank:  # one writer per run directory (the other ranks and the data children are this command)
            held.enter_context(run_dir_lock(run_dir, command_line(argv, "draftsmith train")))
        missing = missing_stages(recipe, run_dir) if prepare else []
        # every check the dry run makes, before anything is written
        preflight_run(recipe, [*missing, *(["hidden-states"] if recipe.data.hidden_states_mode == "online" else [])],
                      run_dir)
        # the data on disk agrees with the recipe before anything is written (--overwrite included)
        check_run_dir(recipe, run_dir, missing, recipe_arg)
        if resume and not overwrite:  # a changed recipe or a damaged checkpoint is refused before anything is written
            plan_resume(recipe, run_dir, resume_from)
        if main_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            claim_run_dir(run_dir, resume, overwrite)
        # before the accelerator: the data stage's children get the GPUs while no rank holds memory
        ensure_prepared(recipe, run_dir, recipe_arg if recipe_file is None else recipe_file, allow=prepare,
                        checked=True)
        if issubclass(method_cls, DraftVocabMethod):
            check_draft_vocab_size(recipe, RunLayout(run_dir).data)
        check_online_target_fits(recipe, run_dir)
        accelerator = build_accelerator(recipe, run_dir)
        trained = method_cls(recipe, run_dir)
        trained.verify_shards = "full" if verify_shards else "header"
        return fit(recipe, trained, run_dir, resume=resume, argv=argv, accelerator=accelerator, resume_from=resume_from)


def train_errors() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """The errors :func:`train` raises with a one-line message (no traceback is useful):
    ``(refused, failed)``: the run directory is in use, the launcher or the online target does not
    fit (the training commands exit 2); the data, its preparation, the warm start or the run
    failed (exit 1)."""
    from ..data_prep.conversations import DataError
    from ..data_prep.launch import DataStageError
    from ..data_prep.plan import PlanError
    from ..data_prep.preflight import PreflightError
    from ..fileio import ShardError
    from ..run_lock import RunDirLockedError
    from .checkpoint import CheckpointError
    from .components.nonfinite import NonFiniteLossError
    from .dry_run import MemoryBudgetError
    from .launchers import LauncherError
    from .mask_token import MaskTokenError
    from .method_base import DataNotPreparedError, MethodSetupError
    from .validation import ValidationSplitError

    return ((CheckpointError, LauncherError, MemoryBudgetError, RunDirLockedError),
            (DataNotPreparedError, DataError, ShardError, MaskTokenError, FileNotFoundError, ValidationSplitError,
             MethodSetupError, PlanError, DataStageError, TimeoutError, NonFiniteLossError, PreflightError))


def fit_summary(run_dir: Path, result: Any) -> dict[str, Any]:
    """What a training command prints when it is done (``result``: a
    :class:`~draftsmith.train.trainer.FitResult`): the run directory, steps, tokens, seconds,
    tokens per second, the last checkpoint and the last metrics."""
    return {"run_dir": str(run_dir), "steps": result.steps, "tokens": result.tokens,
            "seconds": round(result.seconds, 1), "tokens_per_s": round(result.tokens_per_s, 1),
            "checkpoint": str(result.checkpoint), "metrics": result.last_metrics}
