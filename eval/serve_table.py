"""One serving table from several ``draftsmith serve-bench`` runs (one trained draft each).

    draftsmith serve-table eagle3=runs/types/eagle3/serve/results.json dflash=runs/types/dflash/serve/results.json

Per draft and concurrency level: plain vLLM's output tok/s (the run's own ``baseline``
configuration, measured in the same run just before the draft), the draft's output tok/s, their
ratio, and the draft's mean acceptance length with per-position acceptance from vLLM's counters
at that level; then, where the run swept temperatures, the acceptance length per temperature.
Metric definitions: docs/conventions.md, "Acceptance metrics". Output: a markdown table on stdout.
"""

from __future__ import annotations

from .results import AcceptanceFigures, ConfigResult, ServeResults


def _draft_config(results: ServeResults) -> tuple[str, ConfigResult]:
    """The trained draft's configuration: the one named after a method vLLM serves, as serve-bench
    itself picks it (:func:`~draftsmith.vllm_bridge.spec_config.served_methods`). Raises
    ValueError when the run has none."""
    from ..vllm_bridge.spec_config import served_methods

    for name, cfg in results.configs.items():
        if name in served_methods():
            return name, cfg
    raise ValueError("no trained-draft configuration (serve-bench ran without --draft?)")


def _al(acc: AcceptanceFigures | None) -> str:
    if acc is None or acc.mean_acceptance_length is None:
        return "-"
    per = " / ".join(f"{p:.3f}" for p in acc.per_position_acceptance or [])
    return f"{acc.mean_acceptance_length:.3f} ({per})" if per else f"{acc.mean_acceptance_length:.3f}"


def _tok_s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def serving_table(runs: dict[str, ServeResults]) -> str:
    """The markdown table of ``runs`` (label -> results), in the given order.

    Raises:
        ValueError: a run has no trained-draft configuration (names the label).
    """
    lines = ["| draft | concurrency | plain vLLM output tok/s | with the draft | speedup | "
             "AL at T=0 (per position) |", "|---|---|---|---|---|---|"]
    temps: list[str] = []
    for label, results in runs.items():
        try:
            name, cfg = _draft_config(results)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        base = results.configs.get("baseline")
        if cfg.status != "ok":
            lines.append(f"| {label} | - | - | failed: {(cfg.error or '').splitlines()[0][:120]} | - | - |")
            continue
        for level in sorted(cfg.levels):
            got = cfg.levels[level]
            plain = base.levels.get(level) if base is not None and base.status == "ok" else None
            ratio = (f"{got.output_tok_s / plain.output_tok_s:.2f}x"
                     if got.output_tok_s and plain is not None and plain.output_tok_s else "-")
            lines.append(f"| {label if label == name else f'{label} ({name})'} | {level} | {_tok_s(plain.output_tok_s if plain else None)} | "
                         f"{_tok_s(got.output_tok_s)} | {ratio} | {_al(got.acceptance)} |")
        sweep = results.temperature_sweep
        if sweep is not None:
            temps.append(f"| {label} | " + "; ".join(
                f"T={t:g}: {_al(r.acceptance)}" for t, r in sorted(sweep.temperatures.items())) + " |")
    if temps:
        lines += ["", "| draft | acceptance length by temperature (per position; vLLM's counters) |", "|---|---|"]
        lines += temps
    return "\n".join(lines)
