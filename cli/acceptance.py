"""``draftsmith acceptance``: acceptance measured in vLLM (the command line of :mod:`draftsmith.eval.acceptance`).

Also the worker subprocess each measurement starts (``--worker``, :func:`draftsmith.eval.acceptance.measure`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..eval import acceptance
from ..recipe import RecipeError, load_recipe
from ..runtime import HelpFormatter
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=acceptance.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory (or a Hub id vLLM "
                   "downloads)")
    p.add_argument("--recipe", type=Path, help="recipe YAML whose vllm section gives the engine settings "
                   "(the vLLM flags below override it)")
    p.add_argument("--draft", type=Path, help="exported draft directory (draftsmith export), any method vLLM serves")
    p.add_argument("--method", default=acceptance.EXPORT_METHOD, choices=acceptance.method_choices(),
                   help="draft: the method the export in --draft was exported by; a registered method: the same, "
                   "checked; ngram: vLLM's prompt lookup; none: no speculation")
    p.add_argument("--compare-ngram", action="store_true", help="also measure vLLM's ngram method")
    p.add_argument("--prompts", default="builtin:eval", help="prompt file (JSONL: prompts, MT-bench, ShareGPT, "
                   "messages) or builtin:<name>")
    p.add_argument("--max-prompts", type=int, help="use the first N prompts only")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=0, help="vLLM engine seed")
    p.add_argument("--ngram-min", type=int, default=2, help="ngram: shortest prompt lookup (tokens)")
    p.add_argument("--ngram-max", type=int, default=4, help="ngram: longest prompt lookup (tokens)")
    p.add_argument("--out", type=Path, help="write the figures as JSON, keyed by method")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--engine-json", help=argparse.SUPPRESS)
    p.add_argument("--groups-json", help=argparse.SUPPRESS)
    add_vllm_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..eval.results import AcceptanceResult, write_acceptance

    args = build_parser().parse_args(argv)
    if args.worker:
        acceptance.worker(args)
        return 0
    try:
        engine = vllm_config_from_args(args, load_recipe(args.recipe).vllm if args.recipe else None)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        acceptance.check_target(args.target)
        if args.draft is not None and not args.draft.is_dir():
            raise FileNotFoundError(f"--draft {args.draft}: no such directory; pass the folder `draftsmith export` "
                                    "wrote")
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    common = dict(target=args.target, prompts=args.prompts, k=args.k, temperature=args.temperature,
                  max_new_tokens=args.max_new_tokens, max_prompts=args.max_prompts, seed=args.seed,
                  engine=engine, ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    methods = [args.method] + (["ngram"] if args.compare_ngram and args.method != "ngram" else [])
    results = {}
    try:
        for m in methods:
            r = acceptance.measure(method=m, draft=args.draft, **common)
            results[r["method"]] = r
            print(acceptance.format_row(r["method"], r), flush=True)
    except (ValueError, RuntimeError) as exc:  # a DraftMismatchError, engine settings the offline engine
        print(f"error: {exc}", file=sys.stderr)  # refuses, or the vLLM run failed (its log tail)
        return 1
    if args.out:
        write_acceptance(args.out, {m: AcceptanceResult.model_validate(r) for m, r in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
