"""``draftsmith opd``: on-policy distillation after SFT on a trained run directory (the command
line of :mod:`draftsmith.eval.opd`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..recipe import RecipeError
from ..runtime import HelpFormatter, setup_logging


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``draftsmith opd``."""
    from ..eval import opd

    p = argparse.ArgumentParser(prog="draftsmith opd", description=opd.__doc__, formatter_class=HelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory trained by draftsmith train")
    p.add_argument("--variant", choices=opd.VARIANTS, default="offline",
                   help="offline: the run's own data with the OPD loss; replay: rows where the target rejected the "
                        "draft's proposals from prefixes of the training conversations (or of --prompts)")
    p.add_argument("--from", dest="start", choices=("best", "latest"), default="best",
                   help="start from checkpoints/best (when there is one) or the latest checkpoints/step-N")
    p.add_argument("--split", choices=("soft", "hard"), default="soft",
                   help="draft.opd: accepted / rejected by the expected acceptance at the served temperature "
                        "(train.eval_temperatures[0], else eval.temperature; the argmax hits at 0) or by the argmax hits")
    p.add_argument("--opd-gamma", type=float, default=0.8,
                   help="draft.opd_gamma: the rejected positions' reverse KL at draft position k weighs opd_gamma**k")
    p.add_argument("--epochs", type=float, default=1.0, help="train.epochs of the OPD run")
    p.add_argument("--max-steps", type=int, help="train.max_steps of the OPD run (overrides --epochs)")
    p.add_argument("--budget-minutes", type=float, help="train.max_time_minutes of the OPD run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the run's recipe for the OPD run (repeatable)")
    p.add_argument("--conversations", type=int, default=64,
                   help="replay: training conversations sampled (with --prompts: prompts sampled)")
    p.add_argument("--prefixes", type=int, default=2, help="replay: prefixes cut per conversation")
    p.add_argument("--new-tokens", type=int, default=64, help="replay: tokens decoded after each prefix")
    p.add_argument("--prompts", metavar="SOURCE",
                   help="replay: decode from the prompts of this set (a JSONL file, builtin:<name>, a Hub dataset; "
                        "one prefix each) instead of prefixes of the training conversations")
    p.add_argument("--sft-rows", type=int, default=0, metavar="N",
                   help="replay: also train on N of the run's training conversations (seeded sample, their SFT loss "
                        "masks), mixed with the replay rows (default 0: the replay rows alone)")
    p.add_argument("--span", type=int,
                   help="replay: tokens trained from each rejected position on (default: eval.num_speculative_tokens + 1)")
    p.add_argument("--seed", type=int, default=0, help="replay: sampling seed of the prefixes and the decoding")
    p.add_argument("--device", help="replay: where the target and the draft decode (default: this process's accelerator)")
    p.add_argument("--overwrite", action="store_true", help="start RUN_DIR/opd over (default: continue it)")
    return p


def main(argv: list[str] | None = None) -> int:
    from ..eval import opd

    args = build_parser().parse_args(argv)
    for name in ("conversations", "prefixes", "new_tokens", "span"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"error: --{name.replace('_', '-')} {value} must be at least 1", file=sys.stderr)
            return 2
    if not 0 < args.opd_gamma <= 1:
        print(f"error: --opd-gamma {args.opd_gamma} must be in (0, 1]", file=sys.stderr)
        return 2
    if args.sft_rows < 0:
        print(f"error: --sft-rows {args.sft_rows} must be at least 0", file=sys.stderr)
        return 2
    for flag, given in (("--prompts", args.prompts is not None), ("--sft-rows", args.sft_rows > 0)):
        if given and args.variant != "replay":
            print(f"error: {flag} is for --variant replay (the {args.variant} variant trains on the run's own data)",
                  file=sys.stderr)
            return 2
    if args.prompts is not None:
        from ..eval.acceptance import PromptsError, UnknownPromptSetError, check_prompts

        try:
            check_prompts(args.prompts)
        except PromptsError as exc:  # as draftsmith acceptance: an unknown builtin set is a usage error
            print(f"error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, UnknownPromptSetError) else 1
    setup_logging()
    from ..run_lock import RunDirLockedError, command_line, run_dir_lock

    options = opd.OpdOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(opd.OpdOptions)})
    try:
        if not args.run_dir.is_dir():
            raise opd.OpdError(f"{args.run_dir} is no run directory: make one with "
                               f"`draftsmith train RECIPE --run-dir {args.run_dir}`")
        with run_dir_lock(args.run_dir, command_line(argv, "draftsmith opd")):  # nothing trains RUN_DIR meanwhile
            result = opd.run_opd(options)
    except RunDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (opd.OpdError, RecipeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    print(opd.cost_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
