"""``draftsmith acceptance``: acceptance measured in vLLM (the command line of :mod:`draftsmith.eval.acceptance`).

Also the worker subprocess each measurement starts (``--worker``, :func:`draftsmith.eval.acceptance.measure`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

from ..eval import acceptance, profile
from ..eval.profile import ProfileError
from ..recipe import RecipeError, load_recipe
from ..runtime import HelpFormatter
from ..target.resolve import EMBEDDED_PREFIX, resolve_target
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args
from ..vllm_bridge.spec_config import DRAFT_SAMPLING


def at_least(low: float, kind: type, what: str) -> Callable[[str], Any]:
    """An argparse ``type``: a ``kind`` number of at least ``low`` (finite), else a usage error
    (exit 2) saying ``what`` the flag takes, e.g. ``an integer >= 1, e.g. --k 3``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {what}") from None
        if value < low or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range; give {what}")
        return value

    return parse


def temperatures(text: str) -> tuple[float, ...]:
    """``--temperature``: one or more comma-separated temperatures, each 0 (greedy) or positive and
    finite, no repeats (a usage error, exit 2, names the bad one)."""
    one = at_least(0, float, "0 (greedy) or a positive temperature, e.g. --temperature 0.7")
    values = tuple(one(item.strip()) for item in text.split(","))
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a temperature; give each once, the served one first, "
                                         "e.g. --temperature 1,0")
    return values


def served_temperatures(flag: tuple[float, ...] | None, recipe_temperature: float | None) -> tuple[float, ...]:
    """What ``acceptance`` measures at: ``--temperature`` when given; else the recipe's served
    ``eval.temperature`` and, when it is above 0, T=0 after it; else T=0."""
    if flag:
        return flag
    if recipe_temperature:
        return (recipe_temperature, 0.0)
    return (0.0,)


def description() -> str:
    """The help's description: :mod:`draftsmith.eval.acceptance`'s docstring, with the usage
    line's ``--method METHOD`` spelled out from the registry (:func:`~draftsmith.eval.acceptance.method_choices`)."""
    return acceptance.__doc__.replace("[--method METHOD]", f"[--method {'|'.join(acceptance.method_choices())}]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description(), formatter_class=HelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory, embedded:NAME (the "
                   "bundled default target) or a Hub id vLLM downloads")
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
    p.add_argument("--max-prompts", type=at_least(1, int, "N >= 1, the number of prompts (leave it out for all)"),
                   metavar="N", help="use the first N prompts only")
    p.add_argument("--k", type=at_least(1, int, "an integer >= 1, the draft tokens per step, e.g. --k 3"),
                   default=3, help="num_speculative_tokens")
    p.add_argument("--temperature", type=temperatures, default=None, metavar="T[,T...]",
                   help="sampling temperature (0: greedy), or several comma-separated, the served one first "
                   "(generated once each in the same engine; the profile is the first's); default: --recipe's "
                   "eval.temperature and, when above 0, 0 too; without --recipe, 0")
    p.add_argument("--max-new-tokens", type=at_least(1, int, "an integer >= 1, e.g. --max-new-tokens 256"),
                   default=256, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=0, help="vLLM engine seed")
    p.add_argument("--ngram-min", type=at_least(1, int, "an integer >= 1"), default=2,
                   help="ngram: shortest prompt lookup (tokens)")
    p.add_argument("--ngram-max", type=at_least(1, int, "an integer >= 1"), default=4,
                   help="ngram: longest prompt lookup (tokens)")
    p.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, default=None,
                   help="at T > 0: greedy drafts the argmax, verified as a one-hot q (vLLM's default "
                   "draft_sample_method); probabilistic samples from the draft and verifies with its full q "
                   "(accepted with sum min(p, q)); default: --recipe's eval.draft_sampling, else greedy")
    p.add_argument("--out", type=Path, help="write the figures as JSON, keyed by method, and "
                   "the profile beside it (<stem>.speculation_profile.json)")
    p.add_argument("--log", type=Path, help="keep the vLLM worker's log of --method here (--compare-ngram's "
                   "beside it, <stem>.ngram<suffix>); default: beside --out (<out stem>.vllm.log), else a "
                   "temporary file kept only when the run fails (the error names it)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--engine-json", help=argparse.SUPPRESS)
    p.add_argument("--groups-json", help=argparse.SUPPRESS)
    add_vllm_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..eval.results import AcceptanceResult, write_acceptance

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        acceptance.worker(args)
        return 0
    if args.ngram_min > args.ngram_max:
        parser.error(f"--ngram-min {args.ngram_min} is above --ngram-max {args.ngram_max}; give a lookup range "
                     "with --ngram-min <= --ngram-max")
    try:  # everything below is checked before any engine starts
        recipe = load_recipe(args.recipe) if args.recipe else None
        engine = vllm_config_from_args(args, recipe.vllm if recipe else None)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    temps = served_temperatures(args.temperature, recipe.eval.temperature if recipe else None)
    try:
        if str(args.target).startswith(EMBEDDED_PREFIX):  # the bundled target, unpacked once into the cache
            args.target = resolve_target(str(args.target))
        acceptance.check_target(args.target)
        if args.draft is not None and not args.draft.is_dir():
            raise FileNotFoundError(f"--draft {args.draft}: no such directory; pass the folder `draftsmith export` "
                                    "wrote")
        acceptance.check_prompts(args.prompts, args.max_prompts)
        from_flag = args.vllm_max_model_len is not None
        acceptance.check_max_model_len(engine, args.target, "--max-model-len" if from_flag else "vllm.max_model_len",
                                       None if from_flag else str(args.recipe))
    except acceptance.UnknownPromptSetError as exc:
        parser.error(str(exc))
    except (FileNotFoundError, ValueError) as exc:  # a PromptsError, a max_model_len beyond the target's
        print(f"error: {exc}", file=sys.stderr)
        return 1
    common = dict(target=args.target, prompts=args.prompts, k=args.k, temperature=temps,
                  max_new_tokens=args.max_new_tokens, max_prompts=args.max_prompts, seed=args.seed,
                  engine=engine, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                  draft_sampling=args.draft_sampling or (recipe.eval.draft_sampling if recipe else "greedy"))
    methods = [args.method] + (["ngram"] if args.compare_ngram and args.method != "ngram" else [])
    results = {}
    try:
        for i, m in enumerate(methods):
            r = acceptance.measure(method=m, draft=args.draft, log_path=log_path(args, None if i == 0 else m),
                                   **common)
            results[r["method"]] = r
            for figures in (r.get("by_temperature") or {"": r}).values():  # JSON: the keys are strings
                name = r["method"] if len(temps) == 1 else f"{r['method']} T={figures['temperature']:g}"
                print(acceptance.format_row(name, {**r, **figures}), flush=True)
    except (ValueError, RuntimeError) as exc:  # a DraftMismatchError, engine settings the offline engine
        print(f"error: {exc}", file=sys.stderr)  # refuses, or the vLLM run failed (its root cause and log)
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


def log_path(args: argparse.Namespace, method: str | None) -> Path | None:
    """Where the vLLM worker's log of ``--method``'s run (``method`` None) or of another method's
    (``ngram``: ``<stem>.ngram<suffix>``) is kept: ``--log``, else beside ``--out``
    (``<out stem>.vllm.log``); None: a temporary file, kept only when the run fails."""
    base = args.log or (args.out.with_name(f"{args.out.stem}.vllm.log") if args.out else None)
    if base is None or method is None:
        return base
    return base.with_name(f"{base.stem}.{method}{base.suffix}")


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
