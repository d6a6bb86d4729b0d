"""Markdown report with plots from a serving benchmark's saved ``results.json`` alone.

    draftsmith report RUN/serve

Writes ``RUN/serve/report.md`` (answer first, then tables: summary geomeans and change vs
baseline, cost, per level, per-position acceptance, K sweep with its recommendation,
temperature sweep, failed configurations with their log tails) and PNGs beside it
(matplotlib, Agg): ``throughput_vs_concurrency.png``, ``latency_vs_concurrency.png``,
``acceptance_vs_k.png``, ``per_position_acceptance.png``. Input:
:class:`draftsmith.eval.results.ServeResults` (``results.json`` read back typed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from .results import AcceptanceFigures, ConfigResult, ConfigSummary, LevelResult, ServeResults

V = TypeVar("V")

PLOTS = {
    "throughput": "throughput_vs_concurrency.png",
    "latency": "latency_vs_concurrency.png",
    "k": "acceptance_vs_k.png",
    "per_pos": "per_position_acceptance.png",
}


def _sorted(d: dict[Any, V] | None) -> dict[Any, V]:
    """``d`` by ascending key (concurrency, K, temperature); ``{}`` for ``None``."""
    return dict(sorted((d or {}).items()))


def _f(v: Any, spec: str = ".1f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:+.1f}%"


def _per_level(counts: dict[str, int] | None) -> str:
    values = set((counts or {}).values())
    return str(values.pop()) if len(values) == 1 else ", ".join(f"{n} at {c}" for c, n in (counts or {}).items())


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _ok_levels(cfg: ConfigResult) -> dict[int, LevelResult]:
    return {c: lv for c, lv in _sorted(cfg.levels).items() if lv.output_tok_s}


def _al(acc: AcceptanceFigures | None) -> str:
    """Acceptance length, or why there is none (a speculative server that proposed nothing)."""
    if not acc:
        return "—"
    return "no drafts" if not acc.num_drafts else f"{acc.mean_acceptance_length:.2f}"


def _per_pos(acc: AcceptanceFigures | None) -> str:
    if not acc or not acc.per_position_acceptance:
        return "—"
    return " / ".join(f"{p:.2f}" for p in acc.per_position_acceptance)


# ---------------------------------------------------------------------------- plots


def _concurrency_axis(ax: Any, levels: list[int]) -> None:
    """Log-2 x axis labelled with exactly the measured levels (no minor-tick clutter)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.xaxis.set_minor_locator(NullLocator())


def _plots(results: ServeResults, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    configs = {n: c for n, c in results.configs.items() if c.status == "ok" and _ok_levels(c)}
    if configs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, cfg in configs.items():
            lv = _ok_levels(cfg)
            ax.plot(list(lv), [x.output_tok_s for x in lv.values()], marker="o", label=name)
        ax.set(xlabel="concurrency (requests in flight)", ylabel="output tokens/s", title="Output throughput vs concurrency")
        _concurrency_axis(ax, results.meta.levels)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS["throughput"], dpi=110)
        plt.close(fig)
        written.append(PLOTS["throughput"])

        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for ax, (metric, title) in zip(axes, [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "request latency")]):
            for i, (name, cfg) in enumerate(configs.items()):
                lv = _ok_levels(cfg)
                color = f"C{i}"
                for p, style in (("p50", "-"), ("p95", "--")):
                    ys = [getattr(getattr(x, metric), p) for x in lv.values()]
                    if all(y is not None for y in ys):
                        ax.plot(list(lv), ys, style, marker="o", color=color, label=f"{name} {p}")
            ax.set(xlabel="concurrency", ylabel="ms", title=f"{title} (solid p50, dashed p95)")
            _concurrency_axis(ax, results.meta.levels)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS["latency"], dpi=110)
        plt.close(fig)
        written.append(PLOTS["latency"])

    sweep = _sweep_rows(results)
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        points = [(k, s.acceptance.mean_acceptance_length) for k, s in sweep
                  if s.acceptance and s.acceptance.mean_acceptance_length is not None]
        ks = [k for k, _ in points]
        ax.plot(ks, [al for _, al in points], marker="o", label="measured")
        ax.plot(ks, [k + 1 for k in ks], ":", color="gray", label="upper bound K+1")
        ax.set(xlabel="num_speculative_tokens K", ylabel="mean acceptance length",
               title=f"Acceptance length vs K (concurrency {results.k_sweep.levels})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS["k"], dpi=110)
        plt.close(fig)
        written.append(PLOTS["k"])

    curves = [(f"{n} (K={c.k})", c.summary.acceptance) for n, c in configs.items() if c.summary]
    curves += [(f"sweep K={k}", s.acceptance) for k, s in sweep]
    curves = [(label, acc) for label, acc in curves if acc and acc.per_position_acceptance]
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, acc in curves:
            pp = acc.per_position_acceptance
            ax.plot(range(1, len(pp) + 1), pp, marker="o", label=label)
        ax.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1),
               title="Per-position acceptance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS["per_pos"], dpi=110)
        plt.close(fig)
        written.append(PLOTS["per_pos"])
    return written


def _sweep_rows(results: ServeResults) -> list[tuple[int, ConfigSummary]]:
    if results.k_sweep is None:
        return []
    return [(k, s.summary) for k, s in _sorted(results.k_sweep.k).items() if s.status == "ok" and s.summary]


# ---------------------------------------------------------------------------- markdown


def _where_it_pays(speedup: dict[int, float]) -> str:
    """Which concurrency levels a configuration beats the baseline at (speedup >= 1), in words.

    "Stops paying off" names the first slower level above the highest faster one, so a
    configuration that loses at concurrency 1 but wins at 2 and 4 is not said to stop at 1.
    """
    faster = [c for c, s in speedup.items() if s >= 1.0]
    slower = [c for c, s in speedup.items() if s < 1.0]
    if not slower:
        return f"it pays off at every measured level (up to {max(speedup)})"
    if not faster:
        best = max(speedup, key=speedup.get)
        return f"it is slower than baseline at every measured level (best {speedup[best]:.2f}x at concurrency {best})"
    text = f"faster at concurrency {', '.join(map(str, faster))}, slower at {', '.join(map(str, slower))}"
    above = [c for c in slower if c > max(faster)]
    if above:
        text += f"; it stops paying off at concurrency {above[0]} ({speedup[above[0]]:.2f}x)"
    return text


def _answer(results: ServeResults) -> list[str]:
    """The few sentences a user reads first: speedup at the lowest level, where it stops paying off."""
    lines = []
    for name, cfg in results.configs.items():
        sp = _sorted(cfg.summary.speedup_per_level if cfg.summary else None)
        if name == "baseline" or not sp:
            continue
        first = next(iter(sp))
        lines.append(f"- **{name}**: {sp[first]:.2f}x baseline output tok/s at concurrency {first}; {_where_it_pays(sp)}; "
                     f"geomean change {_pct(cfg.summary.output_tok_s_change_vs_baseline_pct)}.")
    rec = results.k_sweep.recommendation if results.k_sweep else None
    if rec and rec.k is not None:
        verdict = ""
        if rec.speculation_pays_off is not None:
            verdict = (f" ({rec.speedup_vs_baseline:.2f}x baseline)" if rec.speculation_pays_off
                       else f" — but even it is slower than no speculation ({rec.speedup_vs_baseline:.2f}x): serve without a draft")
        lines.append(f"- **Recommended num_speculative_tokens: {rec.k}**{verdict}. Rule: {rec.rule}.")
    return lines


def render_markdown(results: ServeResults, plots: list[str]) -> str:
    meta = results.meta
    price = meta.price_per_hour
    out = ["# Serving benchmark", ""]
    target = meta.target_name if "target_name" in meta.model_fields_set else meta.target
    out += [f"- target: `{target}`; draft: `{meta.draft}`",
            f"- prompts: `{meta.prompts}`, {_per_level(meta.prompts_per_level)} per level (no prompt shared "
            f"between levels), up to {meta.max_new_tokens} output tokens each, temperature 0",
            f"- engine: {meta.vllm_version}, dtype {meta.dtype}, "
            f"{'eager (--enforce-eager, no torch.compile / graphs)' if meta.enforce_eager else 'compiled'}",
            f"- load generator: {meta.load_generator or 'vllm bench serve'}",
            f"- price: {'$' + format(price, '.2f') + '/hour' if price else 'not given (no cost figures)'}",
            f"- command: `{meta.command}`", ""]
    answer = _answer(results)
    if answer:
        out += ["## Answer", ""] + answer + [""]

    out += ["## Summary (geometric mean over concurrency levels)", ""]
    rows = []
    for name, cfg in results.configs.items():
        s = cfg.summary or ConfigSummary()
        acc = s.acceptance or AcceptanceFigures()
        rows.append([name, cfg.status, _f(s.geomean_output_tok_s), _pct(s.output_tok_s_change_vs_baseline_pct),
                     _f(s.geomean_total_tok_s), _f(s.geomean_p50_ttft_ms), _f(s.geomean_p50_tpot_ms),
                     _f(s.geomean_median_request_latency_ms, ".0f"), _pct(s.request_latency_change_vs_baseline_pct),
                     _al(s.acceptance), _f(acc.acceptance_rate, ".1%"),
                     _f(s.cost_per_1m_output_tokens, ".2f")])
    out += [_table(["config", "status", "output tok/s", "vs baseline", "total tok/s", "TTFT p50 ms", "TPOT p50 ms",
                    "median latency ms", "latency vs baseline", "accept. length", "accept. rate", "$ / 1M out tok"], rows), ""]

    out += ["## Per concurrency level", ""]
    rows = []
    for name, cfg in results.configs.items():
        sp = _sorted(cfg.summary.speedup_per_level if cfg.summary else None)
        for c, lv in _sorted(cfg.levels).items():
            if lv.error is not None:
                rows.append([name, str(c), "failed: " + lv.error.splitlines()[0][:80]] + [""] * 12)
                continue
            acc = lv.acceptance or AcceptanceFigures()
            t, p, i = lv.ttft_ms, lv.tpot_ms, lv.itl_ms
            rows.append([name, str(c), _f(lv.output_tok_s), _f(lv.total_tok_s),
                         f"{_f(t.p50)} / {_f(t.p95)} / {_f(t.p99)}",
                         f"{_f(p.p50)} / {_f(p.p95)} / {_f(p.p99)}",
                         f"{_f(i.p50)} / {_f(i.p95)} / {_f(i.p99)}",
                         _f(lv.median_request_latency_ms, ".0f"), _al(lv.acceptance),
                         _f(acc.acceptance_rate, ".1%"), _f(sp.get(c), ".2f", "x"),
                         _f(lv.outputs_equal_baseline, ".0%"), f"{lv.completed}/{lv.num_prompts}",
                         _f((1e6 / lv.output_tok_s * price / 3600) if price and lv.output_tok_s else None, ".2f"),
                         _f(lv.duration_s, ".1f")])
    out += [_table(["config", "conc.", "output tok/s", "total tok/s", "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99",
                    "ITL ms p50/p95/p99", "median latency ms", "accept. length", "accept. rate", "speedup",
                    "same text as baseline", "completed", "$ / 1M out tok", "duration s"], rows), ""]
    out += ["Acceptance figures are differences of the server's Prometheus counters (`vllm:spec_decode_*`) "
            "before and after each level: acceptance rate = accepted / proposed draft tokens, acceptance length "
            "= 1 + accepted / drafts. \"Same text as baseline\" is the share of requests whose output equals the "
            "baseline's (greedy speculation is lossless up to batch-dependent numerics).", ""]

    pp_rows = [[name, str(cfg.k), _per_pos(cfg.summary.acceptance)]
               for name, cfg in results.configs.items() if cfg.summary and cfg.summary.acceptance]
    if pp_rows:
        out += ["## Per-position acceptance (accepted at position i / drafts, all levels pooled)", "",
                _table(["config", "K", "positions 1..K"], pp_rows), ""]

    sweep = results.k_sweep
    if sweep:
        out += [f"## Draft-token sweep ({sweep.method}, concurrency {sweep.levels})", ""]
        rows = []
        for k, s in _sorted(sweep.k).items():
            summ = s.summary or ConfigSummary()
            acc = summ.acceptance or AcceptanceFigures()
            rows.append([str(k), s.status, _f(summ.geomean_output_tok_s),
                         _pct(summ.output_tok_s_change_vs_baseline_pct), _f(summ.geomean_p50_tpot_ms),
                         _f(summ.geomean_median_request_latency_ms, ".0f"), _al(summ.acceptance),
                         _f(acc.acceptance_rate, ".1%"), _per_pos(summ.acceptance)])
        out += [_table(["K", "status", "output tok/s", "vs baseline", "TPOT p50 ms", "median latency ms",
                        "accept. length", "accept. rate", "per position"], rows), ""]
        rec = sweep.recommendation
        if rec and rec.k is not None:
            out += [f"**Recommendation: K = {rec.k}.** Rule: {rec.rule}.", ""]
        elif rec and rec.error:
            out += [f"No recommendation: {rec.error}.", ""]

    temp = results.temperature_sweep
    if temp:
        out += [f"## Temperature sweep ({temp.method}, K={temp.k}, concurrency {temp.concurrency})", "",
                f"Measured by: {temp.measured_by}.", ""]
        rows = []
        for t, lv in _sorted(temp.temperatures).items():
            if lv.error is not None:
                rows.append([f"{t:g}", "failed", "", "", ""])
                continue
            acc = lv.acceptance or AcceptanceFigures()
            rows.append([f"{t:g}", _al(lv.acceptance), _f(acc.acceptance_rate, ".1%"),
                         _per_pos(lv.acceptance), _f(lv.output_tok_s)])
        out += [_table(["temperature", "accept. length", "accept. rate", "per position", "output tok/s"], rows), ""]

    failed = [(n, c) for n, c in results.configs.items() if c.status != "ok"]
    if sweep:
        failed += [(f"{sweep.method} K={k}", s) for k, s in _sorted(sweep.k).items() if s.status != "ok"]
    if failed:
        out += ["## Failed configurations", ""]
        for name, cfg in failed:
            tail = "\n".join((cfg.log_tail or "").splitlines()[-30:])
            out += [f"### {name}", "", f"{cfg.error}", "", "```", tail, "```", ""]

    if plots:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(out)


def write_report(run_dir: Path) -> Path:
    """Read ``run_dir/results.json``; write ``report.md`` and the PNGs into ``run_dir``.

    Raises:
        FileNotFoundError: no ``results.json`` in ``run_dir``.
        ValueError (pydantic ValidationError): it is not :class:`ServeResults` JSON.
    """
    run_dir = Path(run_dir)
    path = run_dir / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `draftsmith serve-bench ... --out-dir {run_dir}` first")
    results = ServeResults.read(path)
    plots = _plots(results, run_dir)
    report = run_dir / "report.md"
    report.write_text(render_markdown(results, plots))
    return report
