"""``draftsmith compare``: several trained drafts, one table (the command line of :mod:`draftsmith.eval.compare_drafts`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..eval import compare_drafts as cd
from ..runtime import DTYPE_AUTO_HELP, DTYPE_CHOICES, HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``eval/compare_drafts.py`` (``draftsmith compare``)."""
    from ..target import DEVICE_HELP

    p = argparse.ArgumentParser(description=cd.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", required=True, help="target dir, hub id or embedded:SmolLM2-135M-Instruct")
    p.add_argument("--run", type=Path, action="append", required=True, help="training run directory (repeat)")
    p.add_argument("--prompts", default="builtin:eval", help="prompt set: builtin:NAME or a JSONL file")
    p.add_argument("--max-prompts", type=int, help="use at most this many prompts (default: all)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--draft-sampling", choices=["greedy", "probabilistic"], default="greedy",
                   help="how the draft picks its tokens at temperature > 0")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"target and draft dtype; {DTYPE_AUTO_HELP}, by --device")
    p.add_argument("--out", type=Path, help="write the figures as JSON (and the table as .md beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..layout import DraftLoadError

    try:
        temps = [float(x) for x in args.temperatures.split(",") if x.strip()]
        results = cd.compare(args.target, args.run, args.prompts, args.max_prompts, args.k, temps,
                             args.max_new_tokens, args.seed, args.draft_sampling, args.dtype, device=args.device)
    except (cd.RunError, DraftLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    table = cd.markdown_table(results)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

