"""The study: the configurations compared (baseline, the trained draft, ngram, ...), one server
per configuration measured at every concurrency level, the K sweep and the temperature sweep,
written to ``results.json`` (:class:`draftsmith.eval.results.ServeResults`)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..results import ServeResults
from .client import bench_args, run_bench, write_custom_dataset
from . import guidellm as gl
from .metrics import diff_counters, level_metrics, recommend_k, summarise_config
from .metrics import fetch_spec_counters
from ...vllm_bridge import spec_config
from ...vllm_bridge.server import ServerOptions, ServerStartError, log_tail, vllm_server, warm_up
from ...vllm_bridge.spec_config import served_method, served_methods

@dataclass
class ServeConfiguration:
    """One server to measure: a name and its ``--speculative-config`` (``None``: baseline)."""

    name: str
    spec: dict[str, Any] | None
    k: int = 0


def configurations(draft: Path | None, k: int, draft_model: Path | None = None, ngram: bool = True,
                   ngram_min: int = 2, ngram_max: int = 4, draft_sampling: str = "greedy") -> list[ServeConfiguration]:
    """Baseline first, then the trained draft (drafting at T > 0 as ``draft_sampling`` says,
    :func:`~draftsmith.vllm_bridge.spec_config.for_export`), ngram, suffix (when ``arctic_inference``
    is importable) and a smaller same-family ``draft_model`` (when given)."""
    out = [ServeConfiguration("baseline", None)]
    if draft is not None:
        spec = served_method(draft)
        out.append(ServeConfiguration(spec.name, spec_config.for_export(spec, str(draft), k, draft_sampling), k))
    if ngram:
        out.append(ServeConfiguration("ngram", spec_config.ngram(k, ngram_min, ngram_max), k))
    if importlib.util.find_spec("arctic_inference") is not None:
        out.append(ServeConfiguration("suffix", spec_config.suffix(k), k))
    if draft_model is not None:
        out.append(ServeConfiguration("draft_model", spec_config.draft_model(str(draft_model), k), k))
    return out


@dataclass
class Study:
    """Everything one ``serve_bench`` run needs (see the module docstring for the CLI)."""

    target: Path
    out_dir: Path
    prompt_sets: dict[int, list[str]]
    configs: list[ServeConfiguration]
    max_new_tokens: int = 256
    k_sweep: list[int] = field(default_factory=list)
    your_concurrency: int = 1
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    price_per_hour: float | None = None
    server: ServerOptions = field(default_factory=ServerOptions)
    bench_timeout_s: float = 3600.0
    meta: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None  # serve-bench --plan: serving_plan.json, checked against what is measured
    guidellm: gl.GuideLLM | None = None  # serve-bench --load-generator guidellm: it drives each level, not vLLM's bench

    @property
    def load_generator(self) -> str:
        """What sent the requests: ``"vllm bench serve"`` or ``"guidellm <version>"``."""
        return self.guidellm.name if self.guidellm else "vllm bench serve"


def level_dataset(study: Study, concurrency: int) -> Path:
    """The prompt file of one level (:func:`run_study` writes it): vLLM's benchmark's, or GuideLLM's."""
    return study.out_dir / "prompts" / f"level_{concurrency}{'_guidellm' if study.guidellm else ''}.jsonl"


def _measure_level(study: Study, server: dict[str, Any], cfg_name: str, concurrency: int, temperature: float,
                   k: int) -> dict[str, Any]:
    prompts = study.prompt_sets[concurrency]
    dataset = level_dataset(study, concurrency)
    tag = f"c{concurrency}" + (f"_t{temperature:g}" if temperature else "")
    raw_dir = study.out_dir / "raw" / cfg_name
    raw_dir.mkdir(parents=True, exist_ok=True)
    before = fetch_spec_counters(server["base_url"])
    if study.guidellm is None:
        raw = raw_dir / f"{tag}.json"
        bench = run_bench(bench_args(server["port"], str(study.target), dataset, len(prompts), concurrency,
                                     study.max_new_tokens, temperature, raw_dir, raw.name),
                          raw, study.out_dir / "logs" / f"{cfg_name}_{tag}_bench.log", study.bench_timeout_s)
    else:
        raw = raw_dir / f"{tag}_guidellm.json"
        spec = gl.scenario(server["port"], str(study.target), dataset, len(prompts), concurrency, study.max_new_tokens,
                           temperature, raw)
        report = gl.run_guidellm(study.guidellm, spec, raw_dir / f"{tag}_guidellm_scenario.json",
                                 study.out_dir / "logs" / f"{cfg_name}_{tag}_guidellm.log", study.bench_timeout_s)
        try:
            bench = gl.bench_result(report, prompts)
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{raw}: not a GuideLLM report this parser reads ({type(exc).__name__}: {exc})") from None
    counters = diff_counters(before, fetch_spec_counters(server["base_url"]))
    out = level_metrics(bench, counters, k)
    out.update(concurrency=concurrency, temperature=temperature, raw=str(raw.relative_to(study.out_dir)),
               load_generator=study.load_generator)
    out["_texts"] = bench.get("generated_texts")
    return out


def serve_configuration(study: Study, cfg: ServeConfiguration, levels: list[int],
                        temperatures: list[float] = (), temperature_level: int | None = None) -> dict[str, Any]:
    """Start one server, measure ``levels`` at temperature 0 (and ``temperatures`` at
    ``temperature_level``), stop it. Failures are returned as ``{"status": "failed", ...}``."""
    log_path = study.out_dir / "logs" / f"{cfg.name}_server.log"
    result: dict[str, Any] = {"name": cfg.name, "speculative_config": cfg.spec, "k": cfg.k, "levels": {},
                              "temperatures": {}, "status": "ok", "server_log": str(log_path.relative_to(study.out_dir))}
    t0 = time.monotonic()
    try:
        with vllm_server(study.target, cfg.spec, study.server, log_path) as server:
            result.update(startup_s=time.monotonic() - t0, pgid=server["pgid"], command=shlex.join(server["command"]))
            warm_up(server["base_url"], str(study.target))
            for c in levels:
                try:
                    result["levels"][c] = _measure_level(study, server, cfg.name, c, 0.0, cfg.k)
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                    result["levels"][c] = {"concurrency": c, "error": str(exc)[-4000:]}
                print(_progress(cfg.name, c, result["levels"][c]), flush=True)
            for t in temperatures:
                if t == 0 and temperature_level in result["levels"]:
                    result["temperatures"][t] = result["levels"][temperature_level]
                    continue
                try:
                    result["temperatures"][t] = _measure_level(study, server, cfg.name, temperature_level, t, cfg.k)
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                    result["temperatures"][t] = {"temperature": t, "error": str(exc)[-4000:]}
                print(_progress(f"{cfg.name} T={t:g}", temperature_level, result["temperatures"][t]), flush=True)
    except (ServerStartError, OSError) as exc:  # OSError: the warm-up request or /metrics failed
        result.update(status="failed", error=str(exc).splitlines()[0], log_tail=log_tail(log_path))
        print(f"{cfg.name}: server failed to start ({result['error']}); see {log_path}", flush=True)
    return result


def _progress(name: str, c: int, lv: dict[str, Any]) -> str:
    if "error" in lv:
        return f"{name:<14} c={c:<3} FAILED: {lv['error'].splitlines()[0]}"
    acc = lv.get("acceptance")
    al = f"  AL {acc['mean_acceptance_length']:.2f}" if acc and acc["num_drafts"] else ("  no drafts" if acc else "")
    return (f"{name:<14} c={c:<3} {lv['output_tok_s']:8.1f} out tok/s  TTFT p50 {lv['ttft_ms'].get('p50', 0):7.1f} ms"
            f"  TPOT p50 {lv['tpot_ms'].get('p50', 0):6.1f} ms{al}")


def _match_baseline(levels: dict[int, dict[str, Any]], baseline: dict[int, dict[str, Any]]) -> None:
    """Fraction of requests whose text equals the baseline's (greedy speculation is lossless;
    batch-shape numerics can still flip a near-tie, so this is reported, not enforced)."""
    for c, lv in levels.items():
        mine, base = lv.get("_texts"), baseline.get(c, {}).get("_texts")
        if mine and base and len(mine) == len(base):
            lv["outputs_equal_baseline"] = sum(a == b for a, b in zip(mine, base)) / len(mine)


def _strip_texts(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _strip_texts(v) for k, v in tree.items() if k != "_texts"}
    if isinstance(tree, list):
        return [_strip_texts(v) for v in tree]
    return tree


def run_study(study: Study) -> ServeResults:
    """Run every configuration, the K sweep and the temperature sweep; write ``results.json``
    (:class:`draftsmith.eval.results.ServeResults`) after each server (so an interrupted run
    keeps what it measured) and return it.
    """
    levels = sorted(study.prompt_sets)
    for c, prompts in study.prompt_sets.items():  # once per level, in the load generator's format
        write_custom_dataset(prompts, level_dataset(study, c), None if study.guidellm else study.max_new_tokens)
    sweep_levels = [c for c in levels if c <= study.your_concurrency] or levels[:1]
    temp_level = levels[0]
    results: dict[str, Any] = {
        "meta": {**study.meta, "levels": levels, "prompts_per_level": {c: len(p) for c, p in study.prompt_sets.items()},
                 "max_new_tokens": study.max_new_tokens, "price_per_hour": study.price_per_hour,
                 "your_concurrency": study.your_concurrency, "enforce_eager": study.server.engine.enforce_eager,
                 "dtype": study.server.engine.dtype, "engine": study.server.engine.model_dump(mode="json"),
                 "target": str(study.target), "load_generator": study.load_generator},
        "configs": {}, "k_sweep": None, "temperature_sweep": None,
    }
    draft_cfg = swept_configuration(study)
    runs: dict[str, dict[str, Any]] = {}
    try:
        for cfg in study.configs:
            is_draft = cfg is draft_cfg
            runs[cfg.name] = serve_configuration(study, cfg, levels, study.temperatures if is_draft else (),
                                                 temp_level if is_draft else None)
            _finish(study, results, runs, draft_cfg, {}, temp_level)
        sweep: dict[int, dict[str, Any]] = {}
        if draft_cfg is not None and study.k_sweep:
            for k in study.k_sweep:
                if k == draft_cfg.k and runs[draft_cfg.name]["status"] == "ok":
                    sweep[k] = {"levels": {c: runs[draft_cfg.name]["levels"][c] for c in sweep_levels}, "status": "ok"}
                    continue
                spec = {**draft_cfg.spec, "num_speculative_tokens": k}
                sweep[k] = serve_configuration(study, ServeConfiguration(f"{draft_cfg.name}_k{k}", spec, k), sweep_levels)
                _finish(study, results, runs, draft_cfg, sweep, temp_level)
        _finish(study, results, runs, draft_cfg, sweep, temp_level)
    finally:
        _write_results(study, results)
    return ServeResults.model_validate(_strip_texts(results))


def swept_configuration(study: Study) -> ServeConfiguration | None:
    """The configuration the K sweep and the temperature sweep serve: the trained draft; without
    one, ngram when the plan (``serve-bench --plan``) is ngram's (its schedule's or, where it
    serves no speculation, its fixed-K alternative's method), so that the plan is checked against
    every fixed K of the method it weighed."""
    draft = next((c for c in study.configs if c.name in served_methods()), None)
    if draft is not None or study.plan is None:
        return draft
    served = study.plan.get("vllm") or {}
    planned = (served.get("speculative_config") or served.get("fixed_k_alternative") or {}).get("method")
    return next((c for c in study.configs if c.name == "ngram" and planned == "ngram"), None)


def _finish(study: Study, results: dict[str, Any], runs: dict[str, dict[str, Any]], draft_cfg: ServeConfiguration | None,
            sweep: dict[int, dict[str, Any]], temp_level: int) -> None:
    """Summaries, K recommendation and temperature sweep from what ``runs`` holds so far;
    rewrites ``results.json``."""
    baseline = runs.get("baseline", {}).get("levels") if runs.get("baseline", {}).get("status") == "ok" else None
    for name, run in runs.items():
        if run["status"] == "ok":
            if baseline and name != "baseline":
                _match_baseline(run["levels"], baseline)
            run["summary"] = summarise_config(run["levels"], None if name == "baseline" else baseline,
                                              study.price_per_hour, run["k"])
        results["configs"][name] = {k: v for k, v in run.items() if k != "temperatures"}
    if sweep:
        table = {}
        for k, s in sweep.items():
            if s["status"] == "ok":
                s["summary"] = summarise_config(s["levels"], baseline, study.price_per_hour, k)
                table[k] = {c: lv["output_tok_s"] for c, lv in s["levels"].items() if lv.get("output_tok_s")}
        rec = None
        if any(table.values()):
            base = {c: lv["output_tok_s"] for c, lv in (baseline or {}).items() if lv.get("output_tok_s")}
            try:
                rec = recommend_k(table, study.your_concurrency, base or None)
            except ValueError as exc:  # e.g. a K failed at one of the levels
                rec = {"k": None, "error": str(exc)}
        results["k_sweep"] = {"method": draft_cfg.name, "levels": sorted({c for s in sweep.values() for c in s["levels"]}),
                              "k": {k: {kk: v for kk, v in s.items() if kk != "temperatures"} for k, s in sweep.items()},
                              "recommendation": rec}
    if draft_cfg is not None and runs.get(draft_cfg.name, {}).get("temperatures"):
        results["temperature_sweep"] = {
            "method": draft_cfg.name, "k": draft_cfg.k, "concurrency": temp_level,
            "measured_by": "server chat requests at each temperature (vllm bench --temperature), engine seed "
                           f"{study.server.seed}, {len(study.prompt_sets[temp_level])} prompts",
            "temperatures": runs[draft_cfg.name]["temperatures"],
        }
    if study.plan is not None:
        from ..serving_plan import plan_check

        results["plan_check"] = plan_check(study.plan, results["configs"], results.get("k_sweep"))
    _write_results(study, results)


def _write_results(study: Study, results: dict[str, Any]) -> None:
    """Validate the figures gathered so far and write them to ``results.json``."""
    ServeResults.model_validate(_strip_texts(results)).write(study.out_dir / "results.json")
