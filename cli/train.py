"""``draftsmith train``: train the draft of a recipe (the command line of :mod:`draftsmith.train.run`).

One command line for every draft method, three ways in:

    draftsmith train RECIPE.yaml [--run-dir DIR] ...                   :func:`main`
    accelerate launch -m draftsmith.train RECIPE.yaml [--run-dir DIR]   train/__main__.py: :func:`main`
    accelerate launch train/eagle3.py RECIPE.yaml [--run-dir DIR]      the published command: :func:`launch`

The first two read the method from the recipe's ``draft.method``; ``train/eagle3.py`` trains
EAGLE-3 recipes only. Each rank of a launch parses the same command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..recipe import add_recipe_arguments, recipe_from_args
from ..runtime import HelpFormatter, setup_logging

TRAIN_DOC = """Train the draft of a recipe with the training method of its draft.method (its flags, below,
are every method's), after preparing whatever of RUN_DIR/data is missing.

    draftsmith train RECIPE.yaml [--run-dir DIR] [--resume|--resume-from step-N|--overwrite] [--set train.lr=3e-4 ...]
    draftsmith train RECIPE.yaml --dry-run         size and memory estimates, no weights
    draftsmith train RECIPE.yaml --help            the method's own description
"""



def build_parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The command line every training command shares (``doc``: its description; ``prog``: its
    name in usage lines and errors, default the running file's)."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", type=Path, help="run directory (default: runs/<recipe name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in RUN_DIR; recipe keys changed since are applied (lr, "
                        "schedule, loss weights: one note) or refused (method, draft geometry, optimizer, data: one "
                        "line naming them); with training output but no checkpoint, trains from step 0")
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="continue from this checkpoint of RUN_DIR instead of the last: step-N or its path (implies "
                        "--resume); the later checkpoints are moved to RUN_DIR/checkpoints/abandoned-step-M")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a RUN_DIR that holds an earlier run's checkpoints/metrics (data/ is kept)")
    p.add_argument("--no-prepare", action="store_true",
                   help="fail instead of running the data stages whose outputs are missing from RUN_DIR/data")
    p.add_argument("--verify-shards", action="store_true",
                   help="hash every hidden-state shard against its manifest sha256 before training "
                        "(default: a size and header check only)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the recipe (and its launcher) and print size estimates; no weights")
    p.add_argument("--target-config", type=Path, help="with --dry-run: the target's config.json (no hub access)")
    p.add_argument("--launcher", type=Path,
                   help="with --dry-run: accelerate launcher YAML to validate (default: the recipe's `launcher`)")
    p.add_argument("--device-memory-gib", type=float, default=80.0,
                   help="with --dry-run: memory of one GPU; a per-GPU estimate above it is refused (exit 2)")
    return p


def main(argv: list[str] | None = None, prog: str = "draftsmith train") -> int:
    """``draftsmith train`` (and ``python -m draftsmith.train``, ``prog``): the training command of
    the recipe's ``draft.method`` (:func:`launch`). Without a recipe first, the flags every method
    shares are parsed here: ``--help`` prints them (exit 0), no recipe at all is a usage error
    (exit 2); ``RECIPE --help`` is the method's own description."""
    from ..recipe import RecipeError, load_recipe

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(TRAIN_DOC, prog)
    if not argv or argv[0].startswith("-"):
        args = parser.parse_args(argv)  # --help: exit 0; no recipe: exit 2
    else:  # `draftsmith train RECIPE --help` is the method's help: the method is needed first
        args, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    try:
        method = load_recipe(args.recipe, args.overrides).draft.method
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2
    return launch(argv, method=method, script=prog, prog=prog)


def launch(argv: list[str] | None = None, *, method: str | type, script: str, prog: str | None = None,
           doc: str | None = None) -> int:
    """Parse a training command line and train: the recipe and ``--set`` overrides, then
    ``--dry-run`` (size and launcher report) or :func:`~draftsmith.train.run.train` (prepare what
    data is missing, then fit) with ``method``.

    The run directory defaults to ``runs/<recipe name>``, so ``accelerate launch
    train/eagle3.py RECIPE.yaml`` alone prepares and trains.

    Args:
        method: the registered method (name) or the training method class (tests inject one) the
            recipe must be for.
        script: the command its errors name (``draftsmith train``, ``train/eagle3.py``).
        prog: the parser's name in usage lines (default: the running file's).
        doc: the ``--help`` description (default: the method's ``help_text``).

    Returns the exit code: 0; 1 (dry run failed, data not prepared with ``--no-prepare``, bad
    data, a mask token that occurs in the data); 2 (recipe invalid or for another method, run directory in use,
    ``--dry-run`` estimate above ``--device-memory-gib``, a resume that refuses the recipe or a damaged
    checkpoint: :mod:`draftsmith.train.resume`).
    """
    from ..methods import get_method
    from ..recipe import RecipeError, require_method
    from ..train.dry_run import MemoryBudgetError
    from ..train.run import fit_summary, train, train_errors

    method_cls = method if isinstance(method, type) else get_method(method).training_method
    args = build_parser((method_cls.help_text or TRAIN_DOC) if doc is None else doc, prog).parse_args(argv)
    setup_logging()
    recipe = recipe_from_args(args)
    try:
        require_method(recipe, method_cls.name, script)
    except RecipeError as exc:
        print(f"{args.recipe}: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from ..train.dry_run import check_fits, dry_run, format_report

        try:
            report = dry_run(recipe, args.target_config, args.launcher, args.device_memory_gib)
            check_fits(report, args.device_memory_gib)
        except MemoryBudgetError as exc:
            print(f"{args.recipe}: {exc}", file=sys.stderr)
            return 2
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(format_report(report))
        from ..train.selection import dry_run_line

        if (line := dry_run_line(recipe, args.run_dir)) is not None:  # data.select: what it keeps
            print(line)
        if args.run_dir is not None:  # what the real run into RUN_DIR would refuse of its data
            from ..data_prep.agreement import disagreements, mismatch_message, recipe_arg
            from ..data_prep.prepare import missing_stages

            for key, on_disk, where, wanted in disagreements(recipe, args.run_dir,
                                                             missing_stages(recipe, args.run_dir)):
                print("the real run refuses: " + mismatch_message(args.run_dir, key, on_disk, where, wanted,
                                                                  recipe_arg(args)))
        return 0
    run_dir = args.run_dir or Path("runs") / recipe.name
    refused, failed = train_errors()
    try:
        from ..data_prep.agreement import recipe_arg

        result = train(recipe, run_dir, method=method_cls, resume=args.resume or args.resume_from is not None,
                       overwrite=args.overwrite, prepare=not args.no_prepare, verify_shards=args.verify_shards,
                       recipe_arg=recipe_arg(args), recipe_file=args.recipe, argv=sys.argv if argv is None else argv,
                       resume_from=args.resume_from)
    except refused as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        return 2
    except failed as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        return 1
    from accelerate import PartialState

    if PartialState().is_main_process:  # the accelerator train built: one process prints
        print(json.dumps(fit_summary(run_dir, result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
