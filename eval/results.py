"""Typed results of the measurements: what eval/acceptance.py and the serving benchmark write as
JSON, and what eval/report.py and eval/hub.py read back.

Metrics follow docs/conventions.md ("Acceptance metrics"): acceptance rate = accepted / proposed draft tokens, mean
acceptance length = 1 + accepted / drafts (counts the bonus token), per-position acceptance[i] =
accepted_per_pos[i] / drafts; serving latencies in ms, throughputs in tokens/s, cost in dollars
per 1M output tokens.

The JSON keys are the field names (files written before these models read unchanged). Producers
validate their figures into these models and write them with :meth:`ServeResults.write` /
:func:`write_acceptance`, which keep exactly the keys that were given (``exclude_unset``); JSON
turns the integer and float dict keys (concurrency, K, temperature) into strings and the models
parse them back. Unknown keys are errors, except under ``meta`` (the run's free-form context).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        """The JSON object: the keys that were set, nothing added."""
        return self.model_dump(mode="json", exclude_unset=True)


class AcceptanceFigures(_Result):
    """Acceptance from vLLM's spec-decode counters (:func:`draftsmith.eval.acceptance.summarise`);
    the ratios are ``None`` when no draft was proposed."""

    num_drafts: int | None = Field(None, description="speculation steps (vllm:spec_decode_num_drafts)")
    num_draft_tokens: int | None = Field(None, description="proposed draft tokens")
    num_accepted_tokens: int | None = Field(None, description="accepted draft tokens")
    acceptance_rate: float | None = Field(None, description="accepted / proposed draft tokens")
    mean_acceptance_length: float | None = Field(None, description="1 + accepted / drafts (max K+1)")
    per_position_acceptance: list[float] | None = Field(None, description="accepted at position i / drafts")
    per_pos_counts: list[int] | None = Field(None, description="serving: accepted tokens per position (counter diff)")
    bench_reported_acceptance_length: float | None = Field(
        None, description="serving: vLLM's benchmark's own acceptance length (cross-check)")


class AcceptanceCounters(_Result):
    """Raw counter values of one offline run (absent keys: the engine exposed no such counter)."""

    drafts: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    per_pos: list[int] | None = None


class TemperatureFigures(AcceptanceFigures):
    """One temperature of a measurement at several (``AcceptanceResult.by_temperature``)."""

    temperature: float
    output_tokens: int | None = Field(None, description="generated tokens over all prompts")
    generate_seconds: float | None = None
    output_tokens_per_s: float | None = Field(None, description="output_tokens / generate_seconds (tok/s)")
    counters: AcceptanceCounters | None = None


class AcceptanceResult(AcceptanceFigures):
    """One configuration measured offline by eval/acceptance.py (its ``--out`` JSON holds one per
    method); the acceptance figures are absent for ``method: none``."""

    method: str | None = Field(None, description="the draft method (a name registered in draftsmith.methods), ngram or none")
    num_speculative_tokens: int | None = Field(None, description="K (0 without speculation)")
    draft_sampling: Literal["greedy", "probabilistic"] | None = Field(
        None, description="how the draft drafted at T > 0 (vLLM's draft_sample_method); absent: greedy, or no draft")
    temperature: float | None = None
    max_new_tokens: int | None = Field(None, description="most tokens generated per prompt")
    seed: int | None = Field(None, description="the vLLM engine seed")
    measured_at: str | None = Field(None, description="when generation started (ISO 8601, UTC)")
    vllm_version: str | None = Field(None, description="the vLLM distribution and version")
    device: str | None = Field(None, description="the device vLLM ran on")
    prompts: str | None = Field(None, description="the prompt file")
    num_prompts: int | None = None
    prompts_sha256: str | None = Field(None, description="SHA-256 of the conversations sent (canonical JSON)")
    prompt_tokens: dict[str, float | None] | None = Field(None, description="prompt tokens: total, min, max, mean")
    output_tokens: int | None = Field(None, description="generated tokens over all prompts")
    generate_seconds: float | None = None
    output_tokens_per_s: float | None = Field(None, description="output_tokens / generate_seconds (tok/s)")
    counters: AcceptanceCounters | None = None
    outputs: list[list[int]] | None = Field(None, description="generated token ids per prompt (never written)")
    by_temperature: dict[float, TemperatureFigures] | None = Field(
        None, description="measured at several temperatures: each one's figures (the top level's are the first's)")


def write_acceptance(path: Path, results: dict[str, AcceptanceResult]) -> Path:
    """Write ``{method: result}`` as eval/acceptance.py ``--out`` JSON (token ids left out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({m: {k: v for k, v in r.to_json().items() if k != "outputs"} for m, r in results.items()},
                               indent=1))
    return path


def read_acceptance(path: Path) -> dict[str, AcceptanceResult]:
    """Read eval/acceptance.py ``--out`` JSON.

    Raises:
        OSError, ValueError (pydantic ValidationError, JSONDecodeError): unreadable or not that schema.
    """
    return RootModel[dict[str, AcceptanceResult]].model_validate_json(Path(path).read_text()).root


class LatencyStats(_Result):
    """One latency metric in ms: the mean and the percentiles vLLM's benchmark reported."""

    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


class LevelResult(_Result):
    """One concurrency level (or temperature) of one served configuration; a failed level holds
    its ``concurrency`` or ``temperature`` and ``error`` only."""

    num_prompts: int | None = None
    completed: int | None = None
    failed: int | None = None
    duration_s: float | None = None
    output_tokens: int | None = None
    input_tokens: int | None = Field(None, description="prompt tokens over all requests")
    output_tok_s: float | None = Field(None, description="output tokens/s")
    total_tok_s: float | None = Field(None, description="input + output tokens/s")
    request_per_s: float | None = None
    ttft_ms: LatencyStats | None = Field(None, description="time to first token")
    tpot_ms: LatencyStats | None = Field(None, description="time per output token after the first")
    itl_ms: LatencyStats | None = Field(None, description="inter-token latency")
    e2el_ms: LatencyStats | None = Field(None, description="request latency")
    median_request_latency_ms: float | None = None
    acceptance: AcceptanceFigures | None = Field(None, description="absent without speculation")
    concurrency: int | None = None
    temperature: float | None = None
    raw: str | None = Field(None, description="the load generator's result, relative to the run directory")
    load_generator: str | None = Field(None, description="what sent the requests: vllm bench serve or guidellm <version>")
    outputs_equal_baseline: float | None = Field(None, description="share of requests with the baseline's text")
    error: str | None = None


class ConfigSummary(_Result):
    """Geometric means over the levels of one configuration and its change vs the baseline."""

    levels: list[int] = Field(default_factory=list, description="levels with a measurement")
    geomean_output_tok_s: float | None = None
    geomean_total_tok_s: float | None = None
    geomean_p50_ttft_ms: float | None = None
    geomean_p50_tpot_ms: float | None = None
    geomean_p50_itl_ms: float | None = None
    geomean_median_request_latency_ms: float | None = None
    cost_per_1m_output_tokens: float | None = Field(None, description="dollars per 1M output tokens")
    acceptance: AcceptanceFigures | None = Field(None, description="counters pooled over the levels")
    output_tok_s_change_vs_baseline_pct: float | None = None
    request_latency_change_vs_baseline_pct: float | None = None
    speedup_per_level: dict[int, float] | None = Field(None, description="output tok/s / baseline's, per level")


class ConfigResult(_Result):
    """One configuration (one server) of the study, or one K of the draft-token sweep."""

    name: str | None = None
    speculative_config: dict[str, Any] | None = Field(None, description="None: the baseline")
    k: int = Field(0, description="num_speculative_tokens")
    status: Literal["ok", "failed"]
    levels: dict[int, LevelResult] = Field(default_factory=dict)
    summary: ConfigSummary | None = None
    server_log: str | None = None
    startup_s: float | None = None
    pgid: int | None = None
    command: str | None = None
    error: str | None = None
    log_tail: str | None = None


class KRecommendation(_Result):
    """The num_speculative_tokens advised for the deployment's concurrency (``error`` when none)."""

    k: int | None
    rule: str | None = None
    levels: list[int] | None = None
    geomean_output_tok_s: dict[int, float] | None = None
    baseline_geomean_output_tok_s: float | None = None
    speedup_vs_baseline: float | None = None
    speculation_pays_off: bool | None = None
    error: str | None = None


class KSweep(_Result):
    method: str
    levels: list[int]
    k: dict[int, ConfigResult]
    recommendation: KRecommendation | None = None


class TemperatureSweep(_Result):
    method: str
    k: int
    concurrency: int
    measured_by: str
    temperatures: dict[float, LevelResult]


class ServeMeta(BaseModel):
    """The run's context (target, prompts, engine, command, ...); other keys are kept."""

    model_config = ConfigDict(extra="allow")

    levels: list[int] = Field(default_factory=list, description="concurrency levels measured")
    prompts_per_level: dict[int, int] | None = None
    max_new_tokens: int | None = None
    price_per_hour: float | None = Field(None, description="dollars per hour of the machine")
    your_concurrency: int | None = None
    enforce_eager: bool | None = None
    dtype: str | None = None
    target: str | None = None
    target_name: str | None = None
    draft: str | None = None
    prompts: str | None = None
    command: str | None = None
    vllm_version: str | None = None
    load_generator: str | None = Field(None, description="vllm bench serve or guidellm <version> (serve-bench --load-generator)")


class ServeResults(_Result):
    """The serving benchmark's ``results.json``."""

    meta: ServeMeta
    configs: dict[str, ConfigResult]
    k_sweep: KSweep | None = None
    temperature_sweep: TemperatureSweep | None = None
    plan_check: dict[str, Any] | None = Field(None, description="serve-bench --plan: predicted against measured "
                                              "(draftsmith.eval.serving_plan.plan_check)")

    def write(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def read(cls, path: Path) -> ServeResults:
        """Raises:
            OSError, ValueError (pydantic ValidationError): unreadable or not that schema."""
        return cls.model_validate_json(Path(path).read_text())
