"""``draftsmith adapt``: continue a deployed draft on the traffic it served (the command line of
:mod:`draftsmith.serve.adapt`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..recipe import RecipeError
from ..runtime import HelpFormatter, setup_logging
from ..serve import adapt as ad


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``draftsmith adapt``."""
    p = argparse.ArgumentParser(prog="draftsmith adapt", description=ad.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--log", required=True, help="traffic log written by draftsmith proxy (rotated files are read too)")
    p.add_argument("--deployed", required=True, help="the deployed draft's export folder (read only)")
    p.add_argument("--recipe", required=True, help="recipe of the deployed draft (target, data, train settings)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (repeatable)")
    p.add_argument("--replay", help="conversations with target-written replies to replay (the base run's "
                                    "data/regen.jsonl); without it no forgetting guard")
    p.add_argument("--replay-share", type=float, default=0.25,
                   help="share of the training conversations drawn from --replay")
    p.add_argument("--run-dir", required=True, type=Path, help="adaptation run directory")
    p.add_argument("--out", type=Path, help="where the adapted draft is exported (default: RUN_DIR/export/adapted)")
    p.add_argument("--model", help="the deployment's served model name (default: the one most requests name)")
    p.add_argument("--holdout", type=float, default=0.1, help="share of prompts held out for evaluation")
    p.add_argument("--drop-cut-replies", action="store_true",
                   help="skip replies cut by max_tokens (default: train on them, without an end-of-turn label at the cut)")
    p.add_argument("--min-conversations", type=int, default=64,
                   help="refuse a log with fewer usable training conversations")
    p.add_argument("--budget-minutes", type=float, default=30.0,
                   help="wall-clock budget of preparation + training (training gets what preparation leaves)")
    p.add_argument("--export-reserve-minutes", type=float, default=1.0, help="part of the budget kept for export")
    p.add_argument("--seed", type=int, default=0, help="hold-out and replay sampling seed")
    p.add_argument("--swap", metavar="PROXY_URL", help="then ask this managed draftsmith proxy to serve the new draft")
    p.add_argument("--admin-token", help="the proxy's --admin-token")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an interrupted adaptation in RUN_DIR")
    mode.add_argument("--overwrite", action="store_true", help="start RUN_DIR over (its traffic/ and data/ too)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.replay_share < 1:
        print(f"error: --replay-share {args.replay_share} must be in [0, 1)", file=sys.stderr)
        return 2
    args.out = args.out or args.run_dir / "export" / "adapted"
    setup_logging()
    from ..run_lock import RunDirLockedError, command_line, run_dir_lock

    try:
        with run_dir_lock(args.run_dir, command_line(argv, "draftsmith adapt")):  # one writer per run directory
            result = ad.adapt(ad.AdaptOptions(**{f.name: getattr(args, f.name)
                                                 for f in dataclasses.fields(ad.AdaptOptions)}))
    except RunDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ad.AdaptError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
