"""``draftsmith plan``: a per-batch-size serving plan (``serving_plan.json``) from a draft's
speculation profile and the serving machine's measured step costs (:mod:`draftsmith.eval.serving_plan`).

    draftsmith plan --draft RUN/export --target DIR|embedded:SmolLM2-135M-Instruct --temperature 0 \
        --batch-sizes 1,2,4,8,16 --max-batch-size 16 --price-per-hour 3.5 --out RUN/export/serving_plan.json
    draftsmith plan --method ngram --profile ngram_profile.json --costs cost_table.json --out plan.json

The profile (``--profile``; default ``DRAFT/speculation_profile.json``, written by ``draftsmith
acceptance``) gives the acceptance length at each K; it must be measured at the served
``--temperature``, on the served target and draft (refused otherwise, naming the field). The cost
table (``--costs``) is read when it exists and was measured on this machine for this target, draft
and vLLM; otherwise it is measured (one vLLM engine per K, every batch size; see
:mod:`draftsmith.eval.serving_costs`) and written there (default ``DRAFT/cost_table.json``).
A vLLM older than the first release that reads ``num_speculative_tokens_per_batch_size``
(``--vllm``, default the installed one) gets the best fixed K instead, and the plan says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from ..runtime import HelpFormatter


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers >= 0, e.g. 1,2,4,8")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    from ..vllm_bridge.engine import add_vllm_arguments
    from ..vllm_bridge.spec_config import DRAFT_SAMPLING

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--draft", type=Path, help="the draft's export folder (its speculation_profile.json and "
                   "cost_table.json are the defaults)")
    p.add_argument("--recipe", type=Path, help="recipe YAML: its target, served temperature (eval.temperature) and "
                   "vllm engine settings are the defaults")
    p.add_argument("--method", default="draft", help="'draft' (the export's own method) or ngram")
    p.add_argument("--target", help="the served target (a folder or embedded:NAME); needed to measure costs")
    p.add_argument("--profile", type=Path, help="speculation_profile.json (default: DRAFT/speculation_profile.json)")
    p.add_argument("--costs", type=Path, help="cost_table.json to read, or to write when it does not fit "
                   "(default: DRAFT/cost_table.json)")
    p.add_argument("--temperature", type=float, help="the served sampling temperature (default: --recipe's "
                   "eval.temperature, else 0)")
    p.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, help="at T > 0, how the draft drafts (vLLM's "
                   "draft_sample_method, docs/temperature.md); default: --recipe's eval.draft_sampling, else greedy")
    p.add_argument("--ks", type=int_list, help="K measured and planned (default: 0 to the profile's K)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16], help="batch sizes measured")
    p.add_argument("--max-batch-size", type=int, help="vLLM's max_num_seqs the plan is for (default: the largest "
                   "batch size)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the cost measurement")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request in the cost measurement")
    p.add_argument("--output-tokens", type=int, help="the served requests' output length: predictions include "
                   "their prefill, as a serving benchmark measures (default: --new-tokens)")
    p.add_argument("--repeats", type=int, default=3, help="most passes per batch size and K in the cost measurement; "
                   "the table keeps the fastest, and two passes within 2%% of each other settle an entry")
    p.add_argument("--hysteresis", type=float, default=0.03, help="keep the previous range's K unless another "
                   "beats it by more than this fraction")
    p.add_argument("--price-per-hour", type=float, help="the machine's price (dollars per hour): cost per 1M "
                   "output tokens in the plan")
    p.add_argument("--vllm", help="the serving vLLM's version (default: the installed one)")
    p.add_argument("--ngram-min", type=int, default=2, help="--method ngram: shortest n-gram matched")
    p.add_argument("--ngram-max", type=int, default=4, help="--method ngram: longest n-gram matched")
    p.add_argument("--roofline", metavar="GPU", help="estimate the cost table from GPU's datasheet (a100, h100, h200) "
                   "instead of measuring it: a labelled lower bound for a machine not at hand "
                   "(draftsmith.eval.serving_roofline); the context is --prompt-tokens + --new-tokens / 2")
    p.add_argument("--log-dir", type=Path, help="keep the cost measurement's engine logs here")
    p.add_argument("--out", type=Path, help="serving_plan.json (default: DRAFT/serving_plan.json)")
    add_vllm_arguments(p)
    # the cost measurement's worker subprocess (draftsmith.eval.serving_costs.measure_costs)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--engine-json", help=argparse.SUPPRESS)
    p.add_argument("--worker-ks", help=argparse.SUPPRESS)  # e.g. 0,1,2,off (off: K = 0 inside the draft's engine)
    p.add_argument("--spec-json", default="", help=argparse.SUPPRESS)
    return p


def _fits(table, target: str, draft: str | None, engine_version: str | None) -> bool:
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count()}
    return (table.machine == machine and Path(table.target).name == Path(target).name
            and (table.draft or None) == (draft or None) and table.engine_version == engine_version)


def roofline_table(args: argparse.Namespace, recipe, method: str, ks: list[int]):
    """The cost table ``--roofline GPU`` estimates for ``--target`` and ``--draft`` (not written to
    ``--costs``: that file holds measurements).

    Raises:
        PlanError: an unknown GPU, or no --target.
    """
    from ..eval.profile import chain_drafts
    from ..eval.serving_plan import PlanError
    from ..eval.serving_roofline import gpu_named, roofline_costs
    from ..target import resolve_target
    from ..target.resolve import bundled_target_config
    from ..vllm_bridge.engine import vllm_config_from_args

    gpu = gpu_named(args.roofline)
    if not args.target:
        raise PlanError("--roofline needs the target's config.json: pass --target (or --recipe)")
    shipped = bundled_target_config(args.target)  # a GPU target's config.json ships in recipes/targets
    config_json = json.loads((shipped or resolve_target(args.target) / "config.json").read_text())
    engine = vllm_config_from_args(args, recipe.vllm if recipe is not None else None)
    return roofline_costs(config_json, gpu, ks, args.batch_sizes, draft=args.draft if method != "ngram" else None,
                          chain=chain_drafts(method), context_tokens=args.prompt_tokens + args.new_tokens // 2,
                          tensor_parallel_size=engine.tensor_parallel_size, target=str(args.target), method=method)


def main(argv: list[str] | None = None) -> int:
    from ..eval import serving_plan as sp
    from ..eval.acceptance import vllm_speculative_config, vllm_version
    from ..eval.profile import ProfileError, read_profile
    from ..recipe import RecipeError
    from ..vllm_bridge.engine import vllm_config_from_args
    from ..vllm_bridge.releases import installed_vllm_version

    args = build_parser().parse_args(argv)
    if args.worker:
        from ..eval.serving_costs import worker

        worker(args)
        return 0
    if args.draft is None and (args.method != "ngram" or args.profile is None or args.out is None):
        print("error: --draft DIR (or --method ngram with --profile and --out)", file=sys.stderr)
        return 2
    recipe = None
    if args.recipe is not None:
        from ..recipe import load_recipe

        try:
            recipe = load_recipe(args.recipe)
        except RecipeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        args.target = args.target or recipe.target.name_or_path
    if args.temperature is None:
        args.temperature = float(recipe.eval.temperature) if recipe is not None else 0.0
    if args.draft_sampling is None:
        args.draft_sampling = recipe.eval.draft_sampling if recipe is not None else "greedy"
    profile_path = args.profile or args.draft / "speculation_profile.json"
    costs_path = args.costs or (args.draft / "cost_table.json" if args.draft else None)
    out = args.out or args.draft / sp.PLAN_FILE
    try:
        profile = read_profile(profile_path)
        draft_sha = None
        if args.draft is not None:
            from ..eval.profile import file_sha256
            weights = next(iter(sorted(args.draft.glob("*.safetensors"))), None)
            draft_sha = file_sha256(weights) if weights else None
        sp.check_binding(profile, {"temperature": args.temperature, "target": args.target,
                                   "draft_sha256": draft_sha,
                                   "draft_sampling": args.draft_sampling if args.method != "ngram" else None},
                         str(profile_path))
        k_top = profile.num_speculative_tokens
        ks = args.ks or list(range(0, k_top + 1))
        if 0 not in ks:
            ks = [0, *ks]
        method, spec = vllm_speculative_config(args.method, args.draft, max(max(ks), 1), args.ngram_min, args.ngram_max,
                                               args.draft_sampling)
        fixed = {k: v for k, v in (spec or {}).items() if k != "num_speculative_tokens"}
        installed = vllm_version()
        table = None
        if args.roofline:
            table = roofline_table(args, recipe, method, ks)
        elif costs_path is not None and costs_path.is_file():
            table = sp.read_cost_table(costs_path)
            if args.target and not _fits(table, args.target, str(args.draft) if args.draft else method, installed):
                print(f"{costs_path}: measured on another machine, target, draft or vLLM: measuring again", file=sys.stderr)
                table = None
        if table is None:
            if not args.target:
                print(f"error: {costs_path or '--costs'}: no cost table; pass --target to measure one", file=sys.stderr)
                return 2
            from ..eval.serving_costs import measure_costs
            from ..target import resolve_target
            engine = vllm_config_from_args(args, recipe.vllm if recipe is not None else None)
            table = measure_costs(resolve_target(args.target), fixed, ks, args.batch_sizes,
                                  prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
                                  temperature=args.temperature, engine=engine,
                                  draft=str(args.draft) if args.draft else method, method=method, log_dir=args.log_dir)
            table.target = str(args.target)
            if costs_path is not None:
                costs_path.parent.mkdir(parents=True, exist_ok=True)
                costs_path.write_text(table.model_dump_json(indent=1) + "\n")
        plan = sp.make_plan(profile, table, fixed, max_batch_size=args.max_batch_size or max(table.batch_sizes),
                            hysteresis=args.hysteresis, price_per_hour=args.price_per_hour,
                            output_tokens=args.output_tokens or args.new_tokens,
                            vllm_version=args.vllm or installed_vllm_version(),
                            sources={"profile": str(profile_path),
                                     "cost_table": f"roofline {args.roofline}" if args.roofline else str(costs_path or "measured")})
    except (sp.PlanError, ProfileError, RecipeError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sp.write_plan(plan, out)
    print(f"step costs: {table.source}")
    print(f"schedule (batch-size ranges, K): {json.dumps(plan['schedule'])}")
    print("options (sum over batch sizes of tok/s relative to the best there): "
          + ", ".join(f"{n} {o['score']:.3f}" for n, o in plan["options"].items()) + f"; serving: {plan['choice']}")
    for b, row in plan["chosen"].items():
        print(f"  batch {b:>3}: K={row['k']}  {row['output_tok_s']:.4g} tok/s predicted  TPOT {row['tpot_ms']:.3g} ms")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
