"""A per-batch-size serving plan from a draft's measured acceptance and the serving machine's step costs.

Speculation pays where the extra tokens a verify step accepts outweigh what the K draft steps and
the K + 1 verified positions cost, and that balance moves with the batch: at batch 1 the target is
memory-bound and verifying K + 1 tokens costs about as much as verifying one; at a large batch it
is compute-bound and every verified position is paid. So the best K is a function of the batch
size, and vLLM (0.32 on) takes one: ``speculative_config.num_speculative_tokens_per_batch_size``,
a list of inclusive ``(start, end, K)`` batch-size ranges starting at 1, K = 0 turning speculation
off for that range (``vllm/v1/spec_decode/dynamic/utils.py``).

The model (docs/serving_plan.md), for a batch of ``b`` sequences decoding at K draft tokens:

    tokens per step   = b * AL(K)                    (AL: mean acceptance length, bonus token included)
    seconds per step  = T(b, K)                      (one target verification of b * (K + 1) positions
                                                      plus K draft steps: the cost table, measured)
    output tok/s      = b * AL(K) / T(b, K)          (K = 0: b / T(b, 0), AL(0) = 1)

and, for requests of N output tokens whose prompts the table says take P(b, K) to prefill together
(what a serving benchmark measures, each request paying its prefill and (N - 1) / AL steps):

    output tok/s      = b * N / (P(b, K) + (N - 1) * T(b, K) / AL(K))

``AL(K)`` comes from the draft's ``speculation_profile.json`` at the served temperature: for a chain
drafter (its K = n draft is the first n tokens of its K = n + 1 draft: EAGLE-3, Medusa, the MLP
speculator, ngram) ``AL(K) = 1 + sum(marginal_accept_rates[:K])`` for every K up to the measured
one; for block and parallel drafters (DFlash, DSpark, P-EAGLE) only the K it was measured at
(``accept_length_by_k``). ``T(b, K)`` comes from a :class:`CostTable` measured on the serving
machine (:mod:`draftsmith.eval.serving_costs`).

The plan picks the K of highest predicted tok/s at each measured batch size, keeps the previous
range's K unless another beats it by more than ``hysteresis`` (so that two nearly equal Ks do not
flap from one batch size to the next), and merges equal neighbours into ranges; a batch size
between two measured ones takes the lower one's K (what vLLM's lookup does with a gap).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..fileio import atomic_file
from .profile import SpeculationProfile, chain_drafts

PLAN_FILE = "serving_plan.json"
SCHEMA_VERSION = "1.0"
PER_BATCH_SIZE_FROM = "0.32.0"
"""The first vLLM release whose ``SpeculativeConfig`` reads ``num_speculative_tokens_per_batch_size``."""


class PlanError(ValueError):
    """A plan that cannot be made from these inputs; one line naming the file and field."""


class StepCost(BaseModel):
    """The measured cost of one engine step at batch size ``batch_size`` and ``k`` draft tokens."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(ge=1)
    k: int = Field(ge=0)
    step_s: float = Field(gt=0, allow_inf_nan=False, description="seconds per decode step (verify + K draft steps)")
    steps: int | None = Field(None, ge=1, description="decode steps the figure is the mean of")
    prefill_s: float | None = Field(None, ge=0, allow_inf_nan=False,
                                    description="seconds to prefill the batch's prompts together (the table's prompt_tokens each)")
    scheduled_off: bool = Field(False, description="K = 0 scheduled inside the draft's engine (a per-batch-size range "
                                "with K = 0): the target's step plus what the drafter still does there (an EAGLE "
                                "drafter keeps its KV cache up to date)")


class CostTable(BaseModel):
    """``cost_table.json``: seconds per decode step by batch size and K, on one machine, for one
    target, draft and engine version (:mod:`draftsmith.eval.serving_costs` measures it)."""

    model_config = ConfigDict(extra="allow")

    schema_version: str = SCHEMA_VERSION
    source: str = Field(description="'measured: vllm engine', 'vllm bench forward' or 'roofline (estimate)'")
    machine: dict[str, Any]
    target: str
    draft: str | None
    method: str | None
    engine_version: str | None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    costs: list[StepCost]

    def step_s(self, b: int, k: int) -> float | None:
        """Seconds per step at batch ``b`` and ``k`` draft tokens, None where not measured."""
        cost = self.cost(b, k)
        return cost.step_s if cost else None

    def cost(self, b: int, k: int, scheduled_off: bool = False) -> StepCost | None:
        """The entry at batch ``b`` and ``k``; ``scheduled_off``: K = 0 inside the draft's engine."""
        return next((c for c in self.costs if c.batch_size == b and c.k == k and c.scheduled_off == scheduled_off), None)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({c.batch_size for c in self.costs})

    @property
    def ks(self) -> list[int]:
        return sorted({c.k for c in self.costs})


def read_cost_table(path: Path) -> CostTable:
    """Raises:
        PlanError: unreadable, or not a cost table (one line naming the file)."""
    try:
        return CostTable.model_validate_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        first = str(exc).splitlines()
        raise PlanError(f"{path}: not a cost table ({' '.join(first[:3])})") from None


def accept_lengths(profile: SpeculationProfile, max_k: int) -> dict[int, float]:
    """``AL(K)`` for every K the profile gives, 0..``max_k`` (AL(0) = 1).

    A chain drafter's profile measured at K gives every K' <= K: ``1 + sum(marginal[:K'])``;
    another method's gives the Ks of its ``accept_length_by_k``. K above ``max_k`` is left out."""
    out = {0: 1.0}
    if chain_drafts(profile.method):
        marginal = profile.marginal_accept_rates
        for k in range(1, min(max_k, len(marginal)) + 1):
            out[k] = 1.0 + sum(marginal[:k])
    for key, al in (profile.accept_length_by_k or {}).items():
        if 1 <= int(key) <= max_k:
            out.setdefault(int(key), float(al))
    return out


def drafted_fraction(profile: SpeculationProfile) -> float:
    """The share of decode steps that carried a draft in the profile's measurement (ngram drafts
    only where the prompt lookup matched; a trained draft at every step): ``D / (D + U)``, ``U``
    the tokens decoded beyond what ``D`` drafted steps of mean length AL account for
    (``output_tokens - prompts - D * AL``, each prompt's first token coming from its prefill).
    1.0 where the profile does not record its output tokens."""
    counts, cond = profile.counts, profile.measurement_conditions or {}
    out, n, al = cond.get("output_tokens"), (cond.get("prompts") or {}).get("count"), profile.mean_accept_length
    if not (counts and counts.num_drafts and out and n and al):
        return 1.0
    undrafted = max(0.0, out - n - counts.num_drafts * al)
    return counts.num_drafts / (counts.num_drafts + undrafted)


@dataclass(frozen=True)
class Prediction:
    batch_size: int
    k: int
    output_tok_s: float
    tpot_ms: float  # time per output token of one sequence: step time / AL
    # what it was computed from (predict_for_traffic re-evaluates it at a measured traffic's lengths)
    accept_length: float | None = None
    step_s: float | None = None
    prefill_s: float | None = None
    output_tokens: int | None = None


def predict(b: int, k: int, al: float, step_s: float, prefill_s: float | None = None,
            output_tokens: int | None = None) -> Prediction:
    """Output tok/s of ``b`` sequences decoding at ``k`` draft tokens of mean acceptance length
    ``al`` (bonus token included) when one step takes ``step_s`` seconds: ``b AL / step_s``, the
    decode rate. With ``prefill_s`` (the ``b`` prompts prefilled together) and ``output_tokens``
    (``N`` per request), the rate a serving benchmark of such requests measures, each paying its
    prefill (which yields the first token) and ``(N - 1) / AL`` steps:
    ``b N / (prefill_s + (N - 1) step_s / AL)``."""
    if prefill_s is not None and output_tokens:
        return Prediction(b, k, b * output_tokens / (prefill_s + (output_tokens - 1) * step_s / al), 1e3 * step_s / al,
                          al, step_s, prefill_s, output_tokens)
    return Prediction(b, k, b * al / step_s, 1e3 * step_s / al, al, step_s)


def predict_for_traffic(chosen: dict[str, Any], batch_size: int, prompt_tokens: float, output_tokens: float,
                        table_prompt_tokens: int | None) -> float | None:
    """A plan's prediction (``chosen`` of :func:`make_plan`, with its ``model``) re-evaluated at a
    measured traffic's mean prompt and output lengths: the prefill scaled by ``prompt_tokens /
    table_prompt_tokens`` (prefill cost grows with the prompt), ``output_tokens`` per request.
    None where the plan kept no prefill time (a decode-rate prediction) or the lengths are missing."""
    model = chosen.get("model") or {}
    if model.get("prefill_s") is None or not (table_prompt_tokens and prompt_tokens and output_tokens):
        return None
    prefill = model["prefill_s"] * prompt_tokens / table_prompt_tokens
    return batch_size * output_tokens / (prefill + (output_tokens - 1) * model["step_s"] / model["accept_length"])


def best_ks(table: CostTable, als: dict[int, float], hysteresis: float = 0.03,
            output_tokens: int | None = None, drafted: float = 1.0,
            in_schedule: bool = False) -> list[tuple[int, int, list[Prediction]]]:
    """``(batch size, chosen K, predictions for every K)`` at each measured batch size, smallest
    first. The chosen K is the one of highest predicted tok/s, except that the previous batch
    size's K is kept unless the best beats it by more than ``hysteresis`` (a fraction).
    ``output_tokens``: the served requests' length, with the table's prefill times (:func:`predict`);
    None: the decode rate. ``drafted``: the share of steps that carry a draft
    (:func:`drafted_fraction`); the others decode one token at the cost of a K = 0 step.
    ``in_schedule``: K = 0 is a range of a schedule, served by the draft's engine: its cost is the
    table's ``scheduled_off`` entry where it has one.

    Raises:
        PlanError: a batch size with no K both measured and in ``als`` (K = 0 is always in ``als``:
            the table must hold it).
    """
    rows, previous = [], None
    for b in table.batch_sizes:
        plain = table.step_s(b, 0)
        preds = [predict(b, k, *_mixed(k, als[k], c.step_s, plain, drafted), c.prefill_s, output_tokens)
                 for k in table.ks if k in als and (c := _entry(table, b, k, in_schedule)) is not None]
        if not preds:
            raise PlanError(f"cost table: batch size {b} has no K that the profile gives an acceptance length for "
                            f"(table K {table.ks}, profile K {sorted(als)})")
        best = max(preds, key=lambda p: p.output_tok_s)
        chosen = best
        if previous is not None:
            kept = next((p for p in preds if p.k == previous), None)
            if kept is not None and best.output_tok_s <= kept.output_tok_s * (1 + hysteresis):
                chosen = kept
        rows.append((b, chosen.k, preds))
        previous = chosen.k
    return rows


def _entry(table: CostTable, b: int, k: int, in_schedule: bool) -> StepCost | None:
    if k == 0 and in_schedule:
        return table.cost(b, 0, scheduled_off=True) or table.cost(b, 0)
    return table.cost(b, k)


def _mixed(k: int, al: float, step_s: float, plain_s: float | None, drafted: float) -> tuple[float, float]:
    """``(AL, seconds)`` of a mean step when a share ``drafted`` of steps carry a K-token draft
    and the rest decode one token at the K = 0 cost ``plain_s``."""
    if k == 0 or drafted >= 1.0:
        return al, step_s
    return drafted * al + (1 - drafted), drafted * step_s + (1 - drafted) * (plain_s or step_s)


def schedule(rows: list[tuple[int, int, list[Prediction]]], max_batch_size: int) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: inclusive ``[start, end, K]`` ranges from
    batch 1 to ``max_batch_size``, each measured batch size's K holding until the next measured
    batch size, equal neighbours merged."""
    ranges: list[list[int]] = []
    points = [(b, k) for b, k, _ in rows]
    for i, (b, k) in enumerate(points):
        start = 1 if i == 0 else b
        end = (points[i + 1][0] - 1) if i + 1 < len(points) else max(max_batch_size, b)
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
    return ranges


def cost_per_million(output_tok_s: float, price_per_hour: float | None) -> float | None:
    """Dollars per 1M output tokens at ``price_per_hour`` for the machine (None without a price)."""
    if price_per_hour is None or output_tok_s <= 0:
        return None
    return 1e6 / output_tok_s * price_per_hour / 3600.0


def check_binding(profile: SpeculationProfile, served: dict[str, Any], where: str) -> None:
    """Refuse a profile measured at another temperature, target or draft than the one served.

    ``served``: ``{"temperature", "target", "draft_sha256", "method", "draft_sampling"}`` (a None entry
    is not checked; ``draft_sampling`` only at T > 0, where it changes what is accepted, and a profile
    that records none was measured ``greedy``, vLLM's default).

    Raises:
        PlanError: one line naming ``where`` and the field that differs.
    """
    conditions = profile.measurement_conditions or {}
    t = served.get("temperature")
    if t is not None and conditions.get("temperature") is not None and not math.isclose(float(conditions["temperature"]), float(t)):
        raise PlanError(f"{where}: measurement_conditions.temperature is {conditions['temperature']}, the plan serves "
                        f"temperature {t}: measure the profile at the served temperature "
                        f"(draftsmith acceptance --temperature {t})")
    sampling = served.get("draft_sampling")
    measured_sampling = conditions.get("draft_sampling") or "greedy"
    if sampling and t and measured_sampling != sampling:
        raise PlanError(f"{where}: measurement_conditions.draft_sampling is {measured_sampling}, the plan serves "
                        f"draft_sampling {sampling} at temperature {t}: measure the profile that way "
                        f"(draftsmith acceptance --draft-sampling {sampling})")
    target = served.get("target")
    measured_target = (profile.target_model or {}).get("name_or_path")
    if target and measured_target and _model_name(measured_target) != _model_name(target):
        raise PlanError(f"{where}: target_model.name_or_path is {measured_target}, the plan serves {target}")
    sha = served.get("draft_sha256")
    measured_sha = (profile.draft_checkpoint or {}).get("weights_sha256")
    if sha and measured_sha and sha != measured_sha:
        raise PlanError(f"{where}: draft_checkpoint.weights_sha256 is {measured_sha[:12]}..., the served draft's "
                        f"weights are {sha[:12]}...: measure the profile of the draft you serve")
    method = served.get("method")
    if method and profile.method and method != profile.method:
        raise PlanError(f"{where}: method is {profile.method}, the plan serves {method}")


def _model_name(name: Any) -> str:
    """A model's own name, whatever names it: ``embedded:NAME``, a hub id ``org/NAME`` or a folder."""
    return str(name).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]


def sglang_config(ranges: list[list[int]]) -> dict[str, Any]:
    """SGLang's adaptive speculation tiers (``--speculative-adaptive --speculative-adaptive-config``):
    one tier per range, by its largest batch size, with its number of draft steps (0: off)."""
    return {"tiers": [{"max_batch_size": end, "num_steps": k, "enabled": k > 0} for _, end, k in ranges]}


def make_plan(profile: SpeculationProfile, table: CostTable, speculative_config: dict[str, Any], *,
              max_batch_size: int, hysteresis: float = 0.03, price_per_hour: float | None = None,
              vllm_version: str | None = None, sources: dict[str, str] | None = None,
              output_tokens: int | None = None) -> dict[str, Any]:
    """The ``serving_plan.json`` document (docs/serving_plan.md has its fields).

    Args:
        speculative_config: the fixed-K ``--speculative-config`` of the draft (its ``method``,
            ``model``, ...); the plan sets ``num_speculative_tokens`` (the largest K any range uses)
            and ``num_speculative_tokens_per_batch_size``.
        max_batch_size: vLLM's ``max_num_seqs`` the plan is for (the last range ends there).
        vllm_version: the serving vLLM; one older than :data:`PER_BATCH_SIZE_FROM` gets the best
            fixed K instead of a schedule (``plan.kind`` says which).
        output_tokens: the served requests' output length: predictions are then what a serving
            benchmark of such requests measures, prefill included (where the table has prefill
            times); None: the decode rate.
    """
    k_measured = profile.max_supported_k or profile.num_speculative_tokens
    als = accept_lengths(profile, max(table.ks))
    prefill = output_tokens is not None and all(c.prefill_s is not None for c in table.costs)
    drafted = drafted_fraction(profile)
    per_batch = vllm_version is None or _release(vllm_version) >= _release(PER_BATCH_SIZE_FROM)
    rows = best_ks(table, als, hysteresis, output_tokens, drafted)  # each K served alone (K = 0: no draft)
    sched_rows = best_ks(table, als, hysteresis, output_tokens, drafted, in_schedule=True)
    ranges = schedule(sched_rows, max_batch_size)
    predictions = {str(b): {str(p.k): _pred_json(p, price_per_hour) for p in preds} for b, _, preds in rows}
    # the options, each predicted at every measured batch size: the schedule (its K = 0 ranges
    # served by the draft's engine), no speculation, and every fixed K; the one with the highest
    # sum over the batch sizes of its tok/s relative to the best option there is served
    fixed_ks = {f"fixed K={k}": k for k in table.ks if k > 0 and k in als}
    options: dict[str, dict[int, Prediction]] = {
        name: {b: next(p for p in preds if p.k == k) for b, _, preds in rows}
        for name, k in {"none": 0, **fixed_ks}.items()}
    if per_batch and any(k for _, _, k in ranges):
        options["schedule"] = {b: next(p for p in preds if p.k == k) for b, k, preds in sched_rows}
    best_at = {b: max(o[b].output_tok_s for o in options.values()) for b, _, _ in rows}
    score = {name: sum(o[b].output_tok_s / best_at[b] for b in best_at) for name, o in options.items()}
    choice = next(n for n in options if score[n] >= max(score.values()) - 1e-9)  # ties go to the simpler (earlier)
    # the best fixed K: the fixed-K alternative, and what is served when a fixed K is the choice
    fixed = fixed_ks[max(fixed_ks, key=score.get)] if fixed_ks else None
    chosen = {str(b): _pred_json(p, price_per_hour) for b, p in options[choice].items()}
    top = max((k for _, _, k in ranges), default=0)
    vllm_plan: dict[str, Any] | None
    if choice == "none":
        vllm_plan = None  # speculation does not pay over these batch sizes: serve without a speculative config
    elif choice == "schedule":
        vllm_plan = {**speculative_config, "num_speculative_tokens": top,
                     "num_speculative_tokens_per_batch_size": ranges}
    else:
        vllm_plan = {**speculative_config, "num_speculative_tokens": fixed}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "per_batch_size" if per_batch else "fixed_k",
        "why_fixed_k": None if per_batch else (f"vLLM {vllm_version} does not read num_speculative_tokens_per_batch_size "
                                               f"(from {PER_BATCH_SIZE_FROM} on): the best fixed K instead"),
        "vllm": {"speculative_config": vllm_plan,
                 "fixed_k_alternative": ({**speculative_config, "num_speculative_tokens": fixed} if fixed else None),
                 "cuda_graph_note": "a per-batch-size schedule makes vLLM's V1 GPU runner capture PIECEWISE instead of "
                                    "FULL_AND_PIECEWISE CUDA graphs (vLLM issue #49548: about 14% slower single-stream); "
                                    "where the schedule's predicted gain over fixed_k_alternative is smaller than that, "
                                    "serve the fixed K"},
        "sglang": sglang_config(ranges),
        "choice": choice,
        "options": {n: {"score": round(score[n], 4), "output_tok_s": {str(b): round(p.output_tok_s, 3) for b, p in o.items()}}
                    for n, o in options.items()},
        "schedule": ranges,
        "hysteresis": hysteresis,
        "max_batch_size": max_batch_size,
        "chosen": chosen,
        "predictions": predictions,
        "accept_length_by_k": {str(k): round(v, 6) for k, v in sorted(als.items())},
        "drafted_fraction": round(drafted, 6),
        "prompt_tokens": table.prompt_tokens,
        "output_tokens": output_tokens if prefill else None,
        "profile_k": k_measured,
        "price_per_hour": price_per_hour,
        "predicts": (f"output tok/s of requests of {output_tokens} tokens after a {table.prompt_tokens}-token prompt, "
                     "prefill included, as a serving benchmark measures" if prefill else "the decode rate b * AL / step_s"),
        "sources": {"accept_length": f"speculation profile ({profile.accept_length_model or 'unknown model'}, "
                                     f"temperature {(profile.measurement_conditions or {}).get('temperature')})",
                    "step_cost": table.source, **(sources or {})},
    }


def _pred_json(p: Prediction, price: float | None) -> dict[str, Any]:
    cost = cost_per_million(p.output_tok_s, price)
    return {"k": p.k, "output_tok_s": round(p.output_tok_s, 3), "tpot_ms": round(p.tpot_ms, 3),
            "cost_per_1m_output_tokens": None if cost is None else round(cost, 4),
            "model": {"accept_length": p.accept_length, "step_s": p.step_s, "prefill_s": p.prefill_s,
                      "output_tokens": p.output_tokens}}


def _release(version: str) -> tuple[int, int]:
    from ..vllm_bridge.releases import release_line

    return release_line(version)


def predicted_at(plan: dict[str, Any], batch_size: int) -> dict[str, Any] | None:
    """The plan's chosen prediction for ``batch_size``: that of the largest measured batch size at
    or below it (the K the schedule runs there), None below the first."""
    measured = sorted(int(b) for b in plan.get("chosen", {}))
    below = [b for b in measured if b <= batch_size]
    return plan["chosen"][str(below[-1])] if below else None


def plan_check(plan: dict[str, Any], configs: dict[str, Any], k_sweep: dict[str, Any] | None,
               tolerance: float = 0.97) -> dict[str, Any]:
    """Predicted against measured: per concurrency level ``c`` (decoding batch ~ ``c``), the plan's
    predicted output tok/s, the ``plan`` configuration's measured one and its error, the best
    measured of the baseline and every fixed K (the trained draft's K sweep and its own K), and
    whether the plan reached ``tolerance`` x that best and x the baseline.

    ``configs``: serve-bench's ``results.json`` ``configs``; ``k_sweep``: its ``k_sweep`` (or None)."""
    def tok_s(cfg: dict[str, Any] | None, c: int) -> float | None:
        return _level(cfg, c).get("output_tok_s")

    plan_cfg, base_cfg = configs.get("plan"), configs.get("baseline")
    rows, errors, traffic_errors = {}, [], []
    levels = sorted({int(c) for c in ((plan_cfg or base_cfg or {}).get("levels") or {})})
    for c in levels:
        predicted = predicted_at(plan, c)
        measured = tok_s(plan_cfg, c) if plan_cfg else tok_s(base_cfg, c)  # no speculative config: the baseline
        fixed = {"baseline": tok_s(base_cfg, c)}
        for name, cfg in configs.items():
            if name not in ("plan", "baseline") and cfg.get("k"):
                fixed[f"{name} K={cfg['k']}"] = tok_s(cfg, c)
        for k, sweep in ((k_sweep or {}).get("k") or {}).items():
            fixed[f"{(k_sweep or {}).get('method')} K={k}"] = tok_s(sweep, c)
        fixed = {n: v for n, v in fixed.items() if v}
        best = max(fixed.items(), key=lambda kv: kv[1]) if fixed else (None, None)
        err = None if not (predicted and measured) else abs(predicted["output_tok_s"] - measured) / measured
        if err is not None:
            errors.append(err)
        # the same prediction at the level's own mean prompt and output lengths (its prompts are its own)
        level = _level(plan_cfg or base_cfg, c)
        done = level.get("completed") or 0
        traffic = None if not (predicted and done) else predict_for_traffic(
            predicted, c, (level.get("input_tokens") or 0) / done, (level.get("output_tokens") or 0) / done,
            plan.get("prompt_tokens"))
        traffic_err = None if not (traffic and measured) else abs(traffic - measured) / measured
        if traffic_err is not None:
            traffic_errors.append(traffic_err)
        rows[str(c)] = {"k": predicted["k"] if predicted else None,
                        "predicted_tok_s": predicted["output_tok_s"] if predicted else None,
                        "measured_tok_s": measured, "abs_error": err,
                        "predicted_for_traffic_tok_s": traffic, "abs_error_for_traffic": traffic_err,
                        "best_fixed": best[0], "best_fixed_tok_s": best[1],
                        "vs_best": measured / best[1] if measured and best[1] else None,
                        "vs_baseline": measured / fixed["baseline"] if measured and fixed.get("baseline") else None}
    ok = [r for r in rows.values() if r["vs_best"] is not None]
    return {"levels": rows, "tolerance": tolerance,
            "median_abs_error": _median(errors), "median_abs_error_for_traffic": _median(traffic_errors),
            "within_tolerance_of_best": all(r["vs_best"] >= tolerance for r in ok) if ok else None,
            "never_below_baseline": all((r["vs_baseline"] or 1.0) >= tolerance for r in ok) if ok else None}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _level(cfg: dict[str, Any] | None, c: int) -> dict[str, Any]:
    levels = (cfg or {}).get("levels") or {}
    return levels.get(c) or levels.get(str(c)) or {}


def write_plan(plan: dict[str, Any], path: Path) -> Path:
    """Write ``plan`` atomically (a stopped write leaves the previous file)."""
    with atomic_file(Path(path)) as fh:
        fh.write((json.dumps(plan, indent=1) + "\n").encode())
    return Path(path)
