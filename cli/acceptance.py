"""``draftsmith acceptance``: acceptance measured in vLLM (the command line of :mod:`draftsmith.eval.acceptance`).

Also the worker subprocess each measurement starts (``--worker``, :func:`draftsmith.eval.acceptance.measure`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..eval import acceptance, profile
from ..eval.profile import ProfileError
from ..recipe import RecipeError, load_recipe
from ..runtime import HelpFormatter
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=acceptance.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory (or a Hub id vLLM "
                   "downloads)")
    p.add_argument("--recipe", type=Path, help="recipe YAML whose vllm section gives the engine settings "
                   "(the vLLM flags below override it)")
    p.add_argument("--draft", type=Path, help="exported draft directory (draftsmith export), any method vLLM serves; "
                   "its measurement is written into it as speculation_profile.json")
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
    p.add_argument("--out", type=Path, help="write the figures as JSON, keyed by method, and "
                   "the profile beside it (<stem>.speculation_profile.json)")
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
    try:
        for path in write_profiles(args, next(iter(results.values())), engine.model_dump()):
            print(f"speculation profile: {path}")
    except (ProfileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def write_profiles(args: argparse.Namespace, result: dict[str, Any], engine: dict[str, Any]) -> list[Path]:
    """Write the ``speculation_profile.json`` of ``--method``'s measurement into ``--draft`` (the
    export it describes) and beside ``--out`` (``<out stem>.speculation_profile.json``); none
    without speculation (``--method none``), none into ``--draft`` for ``ngram``.

    Raises:
        ProfileError: counters that are not vLLM's longest-prefix counts.
        OSError: a file cannot be written.
    """
    if not result.get("num_speculative_tokens"):
        return []
    served_draft = args.draft if result["method"] not in acceptance.NO_DRAFT_METHODS else None
    cfg = json.loads((served_draft / "config.json").read_text()) if served_draft else None
    prof = profile.build_profile(result, args.target, served_draft, cfg, engine)
    paths = [served_draft] if served_draft else []
    if args.out:
        paths.append(args.out.with_name(f"{args.out.stem}.{profile.PROFILE_FILE}"))
    return [profile.write_profile(p, prof) for p in paths]


if __name__ == "__main__":
    sys.exit(main())
