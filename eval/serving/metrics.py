"""Serving metrics (docs/conventions.md, "Acceptance metrics"): per-level figures from vLLM's ``bench serve`` result and
the server's Prometheus spec-decode counters, summaries over levels, and the K recommendation.

Output and total tok/s, TTFT / TPOT / ITL / request latency percentiles (ms), acceptance rate =
accepted / proposed draft tokens, mean acceptance length = 1 + accepted / drafts, per-position
acceptance = accepted_per_pos[i] / drafts, cost per 1M output tokens = 1e6 / output_tok_s *
price_per_hour / 3600 (dollars).
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..acceptance import summarise
from ...vllm_bridge.net import LOOPBACK

BENCH_PERCENTILES = (50, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# Prometheus counter families (docs/conventions.md, "Acceptance metrics"); exposition adds a ``_total`` suffix.
SPEC_COUNTER_KEYS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"
K_TIE_TOLERANCE = 0.02


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
        "input_tokens": bench.get("total_input_tokens"),
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


def fetch_spec_counters(base_url: str) -> dict[str, Any]:
    """The spec-decode counters of the vLLM server at ``base_url`` (its ``/metrics``)."""
    with LOOPBACK.open(f"{base_url}/metrics", timeout=30) as r:
        return parse_spec_counters(r.read().decode())
