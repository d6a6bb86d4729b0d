"""draftsmith plan: the per-batch-size K schedule from a speculation profile and a cost table
(eval/serving_plan.py), on synthetic tables whose right answer is known by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.cli import plan as plan_cli
from draftsmith.eval import serving_plan as sp
from draftsmith.eval.profile import ProfileCounts, SpeculationProfile
from draftsmith.eval.serving_costs import repeats_settled, steps_of


def profile(marginal, method="eagle3", temperature=0.0, target="embedded:SmolLM2-135M-Instruct", by_k=None):
    k = len(marginal)
    al = 1 + sum(marginal)
    return SpeculationProfile.model_validate({
        "schema_version": "1.0", "measured": True, "method": method, "num_speculative_tokens": k,
        "target_model": {"name_or_path": target},
        "conditional_accept_rates": [min(1.0, m / (marginal[i - 1] if i else 1)) for i, m in enumerate(marginal)],
        "marginal_accept_rates": marginal, "mean_accept_length": al,
        "accept_length_model": "chain_analytic" if method != "dflash" else "measured_per_k",
        "accept_length_by_k": by_k or {str(k): al}, "acceptance_length_histogram": {1: 1},
        "measurement_conditions": {"temperature": temperature}})


def table(step):
    """``step(b, k) -> seconds`` over b in 1, 2, 4, 8, 16 and k in 0..3."""
    return sp.CostTable(source="synthetic", machine={}, target="t", draft="d", method="eagle3", engine_version=None,
                        costs=[sp.StepCost(batch_size=b, k=k, step_s=step(b, k)) for b in (1, 2, 4, 8, 16)
                               for k in range(4)])


def memory_then_compute(b, k):
    """A target that is memory-bound at small batches (verifying K + 1 positions costs little more than
    one) and compute-bound at large ones (every position is paid), plus a draft step of 10% of a
    batch-1 step per K."""
    weights, per_position, draft = 10e-3, 0.5e-3, 1e-3
    return max(weights, per_position * b * (k + 1)) + k * draft


def test_acceptance_lengths_of_a_chain_drafter_give_every_smaller_k():
    als = sp.accept_lengths(profile([0.6, 0.4, 0.2]), 3)
    assert als == pytest.approx({0: 1.0, 1: 1.6, 2: 2.0, 3: 2.2})
    # a block drafter gives only the K it was measured at
    block = sp.accept_lengths(profile([0.6, 0.4, 0.2], method="dflash", by_k={"3": 2.2}), 3)
    assert block == pytest.approx({0: 1.0, 3: 2.2})


def test_speculation_pays_at_small_batches_and_is_switched_off_when_compute_bound():
    prof = profile([0.6, 0.4, 0.2])
    plan = sp.make_plan(prof, table(memory_then_compute), {"method": "eagle3", "model": "d"}, max_batch_size=64)
    # by hand: b=1: K=3 gives 2.2 / 13 ms = 169 tok/s against 1 / 10 ms = 100; b=16 compute-bound: K=0
    # 16 / 10 ms = 1600 against K=1 16 * 1.6 / 17 ms = 1506
    assert plan["chosen"]["1"]["k"] == 3
    assert plan["chosen"]["16"]["k"] == 0
    ranges = plan["schedule"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 64 and ranges[-1][2] == 0
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, as vLLM requires
    assert all(a[2] != b[2] for a, b in zip(ranges, ranges[1:]))  # equal neighbours merged
    spec = plan["vllm"]["speculative_config"]
    assert spec["num_speculative_tokens"] == 3 and spec["num_speculative_tokens_per_batch_size"] == ranges
    assert plan["chosen"]["1"]["output_tok_s"] == pytest.approx(1 * 2.2 / 0.013, rel=1e-3)
    # every chosen K is the best within the hysteresis at its batch size
    for b, row in plan["predictions"].items():
        best = max(v["output_tok_s"] for v in row.values())
        assert plan["chosen"][b]["output_tok_s"] >= best / (1 + plan["hysteresis"]) - 1e-9


def test_hysteresis_keeps_k_when_the_gain_is_within_it():
    prof = profile([0.6, 0.4, 0.2])

    def nearly_flat(b, k):  # at b >= 4, K=2 beats K=3 by about 1%
        base = memory_then_compute(1, k)
        return base * (1.0 if b < 4 or k != 3 else 2.2 / 2.0 * 1.01 * memory_then_compute(1, 2) / base)

    rows = sp.best_ks(table(nearly_flat), sp.accept_lengths(prof, 3), hysteresis=0.03)
    assert [k for _, k, _ in rows] == [3, 3, 3, 3, 3]
    rows = sp.best_ks(table(nearly_flat), sp.accept_lengths(prof, 3), hysteresis=0.0)
    assert [k for _, k, _ in rows] == [3, 3, 2, 2, 2]


def test_an_old_vllm_gets_the_best_fixed_k_and_says_why():
    plan = sp.make_plan(profile([0.6, 0.4, 0.2]), table(memory_then_compute), {"method": "eagle3"},
                        max_batch_size=16, vllm_version="0.31.2")
    assert plan["kind"] == "fixed_k" and "0.32.0" in plan["why_fixed_k"]
    assert "num_speculative_tokens_per_batch_size" not in plan["vllm"]["speculative_config"]
    assert plan["vllm"]["speculative_config"]["num_speculative_tokens"] >= 1


def test_a_draft_that_never_pays_plans_no_speculation():
    plan = sp.make_plan(profile([0.05, 0.01, 0.0]), table(lambda b, k: 10e-3 * (1 + k)), {"method": "eagle3"},
                        max_batch_size=16)
    assert plan["schedule"] == [[1, 16, 0]] and plan["vllm"]["speculative_config"] is None


def test_a_profile_drafted_another_way_at_t_above_0_is_refused_naming_the_field():
    t1 = profile([0.3, 0.1, 0.05], temperature=1.0)  # records no draft_sampling: measured greedy
    with pytest.raises(sp.PlanError, match=r"^p: measurement_conditions\.draft_sampling is greedy, the plan serves "
                                           r"draft_sampling probabilistic at temperature 1\.0"):
        sp.check_binding(t1, {"temperature": 1.0, "draft_sampling": "probabilistic"}, "p")
    sp.check_binding(t1, {"temperature": 1.0, "draft_sampling": "greedy"}, "p")
    # at T=0 greedy requests never read the draft's probabilities: either profile serves
    sp.check_binding(profile([0.6]), {"temperature": 0.0, "draft_sampling": "probabilistic"}, "p")


def test_cost_per_million_tokens():
    assert sp.cost_per_million(1000.0, 3.6) == pytest.approx(1.0)
    assert sp.cost_per_million(1000.0, None) is None


@pytest.mark.parametrize("field, served, match", [
    ("temperature", {"temperature": 1.0}, r"measurement_conditions\.temperature is 0\.0, the plan serves temperature 1\.0"),
    ("target", {"target": "Qwen/Qwen3-8B"}, r"target_model\.name_or_path is embedded:SmolLM2-135M-Instruct"),
    ("method", {"method": "dflash"}, r"method is eagle3, the plan serves dflash"),
])
def test_a_profile_of_another_temperature_target_or_method_is_refused_naming_the_field(field, served, match):
    with pytest.raises(sp.PlanError, match=r"^prof\.json: " + match):
        sp.check_binding(profile([0.6, 0.4, 0.2]), served, "prof.json")
    # the same model named another way is not refused
    sp.check_binding(profile([0.6]), {"temperature": 0.0, "target": "/models/SmolLM2-135M-Instruct"}, "p")


def test_steps_from_vllm_draft_counter():
    assert steps_of(0, 4, 64, 0) == 63
    assert steps_of(3, 4, 64, 100) == 25
    with pytest.raises(ValueError, match="counted no drafts"):
        steps_of(3, 4, 64, 0)


def test_the_command_writes_the_plan_from_a_profile_and_a_cost_table(tmp_path, capsys):
    prof = profile([0.6, 0.4, 0.2], method="ngram")
    (tmp_path / "profile.json").write_text(prof.model_dump_json())
    (tmp_path / "costs.json").write_text(table(memory_then_compute).model_dump_json())
    out = tmp_path / "plan.json"
    rc = plan_cli.main(["--method", "ngram", "--profile", str(tmp_path / "profile.json"), "--costs",
                        str(tmp_path / "costs.json"), "--out", str(out), "--price-per-hour", "3.6",
                        "--max-batch-size", "32", "--vllm", "0.32.0"])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["vllm"]["speculative_config"]["method"] == "ngram"
    assert plan["schedule"][-1][1] == 32 and plan["chosen"]["1"]["cost_per_1m_output_tokens"] > 0
    assert "schedule (batch-size ranges, K)" in capsys.readouterr().out
    # a profile at another temperature: one line, exit 1, nothing written
    out.unlink()
    rc = plan_cli.main(["--method", "ngram", "--profile", str(tmp_path / "profile.json"), "--costs",
                        str(tmp_path / "costs.json"), "--out", str(out), "--temperature", "0.7"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and not out.exists() and len(err.splitlines()) == 1 and "temperature" in err


def test_plan_check_compares_predicted_with_measured_and_with_every_fixed_k():
    plan = sp.make_plan(profile([0.6, 0.4, 0.2]), table(memory_then_compute), {"method": "eagle3"}, max_batch_size=16)
    pred = {c: sp.predicted_at(plan, c)["output_tok_s"] for c in (1, 2, 4, 8, 16)}
    level = lambda v: {"output_tok_s": v}  # noqa: E731
    configs = {
        "baseline": {"k": 0, "levels": {c: level(100.0 * c) for c in pred}},
        "eagle3": {"k": 3, "levels": {c: level(pred[c] * 1.02) for c in pred}},
        "plan": {"k": 3, "levels": {c: level(pred[c] * 1.10) for c in pred}},
    }
    check = sp.plan_check(plan, configs, {"method": "eagle3", "k": {"1": {"levels": {1: level(150.0)}}}})
    row = check["levels"]["1"]
    assert row["predicted_tok_s"] == pytest.approx(pred[1]) and row["measured_tok_s"] == pytest.approx(pred[1] * 1.1)
    assert row["abs_error"] == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert check["median_abs_error"] == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert row["best_fixed"] in ("eagle3 K=3", "baseline", "eagle3 K=1")
    assert check["within_tolerance_of_best"] is True
    # a plan that measures 10% under the best fixed K misses the 0.97 bar
    configs["plan"]["levels"][4] = level(configs["eagle3"]["levels"][4]["output_tok_s"] * 0.9)
    assert sp.plan_check(plan, configs, None)["within_tolerance_of_best"] is False


def test_an_ngram_plan_without_a_draft_is_checked_against_every_fixed_k_of_ngram(tmp_path):
    """serve-bench --plan with no trained draft: the K sweep serves ngram, the plan's own method,
    so that plan_check has every fixed K to compare with; without a plan nothing is swept."""
    from draftsmith.eval.serving import run as runner

    configs = runner.configurations(None, 3, ngram=True)
    plan = {"vllm": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}}
    study = runner.Study(target=tmp_path, out_dir=tmp_path, prompt_sets={1: ["hi"]}, configs=configs, plan=plan)
    assert runner.swept_configuration(study).name == "ngram"
    study.plan = None
    assert runner.swept_configuration(study) is None
    study.plan = {"vllm": {"speculative_config": None}}  # a plan of nothing speculative sweeps nothing
    assert runner.swept_configuration(study) is None
    # a plan that chose to serve without speculation still weighed ngram's fixed Ks: they are swept
    study.plan = {"vllm": {"speculative_config": None, "fixed_k_alternative": {"method": "ngram", "num_speculative_tokens": 1}}}
    assert runner.swept_configuration(study).name == "ngram"


def test_predictions_with_prefill_are_what_a_serving_benchmark_of_n_token_requests_measures():
    # 4 sequences, AL 1.5, 0.1 s per step, 0.6 s to prefill the 4 prompts, 64 tokens each:
    # 4 * 64 / (0.6 + 63 * 0.1 / 1.5) = 256 / 4.8
    p = sp.predict(4, 2, 1.5, 0.1, prefill_s=0.6, output_tokens=64)
    assert p.output_tok_s == pytest.approx(256 / 4.8) and p.tpot_ms == pytest.approx(100 / 1.5)
    assert sp.predict(4, 2, 1.5, 0.1).output_tok_s == pytest.approx(60.0)  # the decode rate without them
    t = table(memory_then_compute)
    for c in t.costs:
        c.prefill_s = 0.01 * c.batch_size
    with_prefill = sp.make_plan(profile([0.6, 0.4, 0.2]), t, {"method": "eagle3"}, max_batch_size=16, output_tokens=32)
    decode_only = sp.make_plan(profile([0.6, 0.4, 0.2]), t, {"method": "eagle3"}, max_batch_size=16)
    assert with_prefill["predicts"].startswith("output tok/s of requests of 32 tokens")
    assert decode_only["predicts"].startswith("the decode rate")
    assert with_prefill["chosen"]["1"]["output_tok_s"] < decode_only["chosen"]["1"]["output_tok_s"]


def test_prefill_and_decode_split_a_pass_by_the_engines_request_timestamps():
    from types import SimpleNamespace as S

    from draftsmith.eval.serving_costs import prefill_and_decode

    stats = [S(scheduled_ts=10.0, first_token_ts=10.4, last_token_ts=13.0),
             S(scheduled_ts=10.0, first_token_ts=10.5, last_token_ts=13.5)]
    assert prefill_and_decode(stats) == pytest.approx((0.5, 3.0))
    assert prefill_and_decode([None]) is None and prefill_and_decode([]) is None  # stats logging off


def test_steps_without_a_draft_lower_what_ngram_is_predicted_to_gain():
    """ngram drafts only where its lookup matched: 80 prompts decoded 80 * 63 = 5040 tokens, 1000
    drafted steps of AL 2.0 account for 2000, so 3040 steps decoded one token without a draft:
    1000 of 4040 steps drafted. A trained draft's profile (every step drafted) gives 1.0."""
    prof = profile([0.6, 0.4], method="ngram")
    prof.mean_accept_length = 2.0
    prof.counts = ProfileCounts(
        num_drafts=1000, num_accepted_tokens=1000, accepted_per_position=[600, 400], reached_per_position=[1000, 600])
    prof.measurement_conditions = {"temperature": 0.0, "output_tokens": 80 * 64, "prompts": {"count": 80}}
    assert sp.drafted_fraction(prof) == pytest.approx(1000 / 4040)
    prof.measurement_conditions["output_tokens"] = 80 + 1000 * 2  # every decoded token came from a drafted step
    assert sp.drafted_fraction(prof) == 1.0
    assert sp.drafted_fraction(profile([0.6, 0.4])) == 1.0  # no output tokens recorded: every step drafted
    # a quarter of the steps drafted: K=2's AL and step time are mixed with K=0's
    t = table(memory_then_compute)
    full = sp.best_ks(t, {0: 1.0, 2: 2.0}, 0.0)
    quarter = sp.best_ks(t, {0: 1.0, 2: 2.0}, 0.0, drafted=0.25)
    step0, step2 = t.step_s(1, 0), t.step_s(1, 2)
    assert next(p for p in quarter[0][2] if p.k == 2).output_tok_s == pytest.approx(
        (0.25 * 2.0 + 0.75) / (0.25 * step2 + 0.75 * step0))
    assert next(p for p in full[0][2] if p.k == 2).output_tok_s == pytest.approx(2.0 / step2)


@pytest.mark.parametrize("one_process, off, commands", [
    (True, False, [["0", "1", "2"]]), (False, False, [["0"], ["1"], ["2"]]),
    (True, True, [["0", "1", "2", "off"]]), (False, True, [["0"], ["1"], ["2"], ["off"]])])
def test_the_cost_engines_run_in_one_worker_process_or_one_per_k(tmp_path, monkeypatch, one_process, off, commands):
    """On CPU every K's engine runs in turn in one worker (one Python and vLLM import); on a GPU
    each in its own, so that its memory is returned before the next starts. Where vLLM reads a
    per-batch-size K, K = 0 is also measured inside the draft's engine (``off``)."""
    import subprocess

    from draftsmith.eval import serving_costs

    seen, real_run = [], subprocess.run

    def fake_run(cmd, **kw):
        if "--worker" not in cmd:  # anything else the measurement runs (the vLLM version lookup)
            return real_run(cmd, **kw)
        assert cmd[1:3] == ["-m", "draftsmith.procs"]  # the worker (and its engines) die with this process
        ks = cmd[cmd.index("--worker-ks") + 1].split(",")
        seen.append(ks)
        rows = [{"batch_size": b, "k": 0 if k == "off" else int(k), "step_s": 0.01 * (1 + (k == "off") + int(k != "off" and k)),
                 "steps": 7, "prefill_s": 0.1, **({"scheduled_off": True} if k == "off" else {})} for k in ks for b in (1, 2)]
        Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps(rows))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(serving_costs.subprocess, "run", fake_run)
    table = serving_costs.measure_costs(tmp_path, {"method": "ngram"}, [2, 0, 1], [1, 2], one_process=one_process,
                                        scheduled_off=off)
    assert seen == commands
    assert len(table.costs) == 6 + 2 * off and table.step_s(2, 2) == pytest.approx(0.03) and table.cost(1, 0).prefill_s == 0.1
    assert table.step_s(1, 0) == pytest.approx(0.01)
    assert (table.cost(1, 0, scheduled_off=True) is not None) == off


def test_plan_check_also_predicts_at_each_levels_own_prompt_and_reply_lengths():
    """Each concurrency level is served its own prompts: a level whose prompts are twice the
    table's length pays twice the prefill. The check re-evaluates the plan's model there."""
    t = table(memory_then_compute)
    for c in t.costs:
        c.prefill_s = 0.05 * c.batch_size
    t.prompt_tokens = 100
    plan = sp.make_plan(profile([0.6, 0.4, 0.2]), t, {"method": "eagle3"}, max_batch_size=16, output_tokens=64)
    chosen = plan["chosen"]["4"]
    m = chosen["model"]
    assert chosen["output_tok_s"] == pytest.approx(4 * 64 / (m["prefill_s"] + 63 * m["step_s"] / m["accept_length"]), rel=1e-4)
    long = sp.predict_for_traffic(chosen, 4, 200, 32, plan["prompt_tokens"])
    assert long == pytest.approx(4 * 32 / (2 * m["prefill_s"] + 31 * m["step_s"] / m["accept_length"]))
    level = {"output_tok_s": long, "completed": 8, "input_tokens": 8 * 200, "output_tokens": 8 * 32}
    check = sp.plan_check(plan, {"baseline": {"k": 0, "levels": {4: level}}, "plan": {"k": 3, "levels": {4: level}}}, None)
    row = check["levels"]["4"]
    assert row["abs_error_for_traffic"] == pytest.approx(0.0, abs=1e-9) and row["abs_error"] > 0.1
    assert check["median_abs_error_for_traffic"] == pytest.approx(0.0, abs=1e-9)
    # a decode-rate plan (no prefill times) has no traffic prediction
    assert sp.predict_for_traffic({"model": {"prefill_s": None}}, 4, 200, 32, 100) is None


def test_a_schedule_whose_off_ranges_cost_more_than_the_target_alone_is_weighed_against_serving_without_one():
    """A K = 0 range is served by the draft's engine, where an EAGLE drafter still runs: with
    that cost measured (``scheduled_off``), the plan compares the schedule with no speculation and
    every fixed K over the batch sizes, and serves the best of them."""
    prof = profile([0.6, 0.4, 0.2])
    cheap = table(memory_then_compute)  # speculation pays at b <= 8 (2.2x at b=1), not at 16
    for b in (1, 2, 4, 8, 16):
        cheap.costs.append(sp.StepCost(batch_size=b, k=0, step_s=1.05 * memory_then_compute(b, 0), scheduled_off=True))
    plan = sp.make_plan(prof, cheap, {"method": "eagle3"}, max_batch_size=16)
    assert plan["choice"] == "schedule" and plan["vllm"]["speculative_config"]["num_speculative_tokens_per_batch_size"]
    # at 16, compute-bound, serving without a draft is best: the schedule pays there for its draft
    assert plan["options"]["schedule"]["output_tok_s"]["16"] < plan["options"]["none"]["output_tok_s"]["16"]
    assert plan["options"]["none"]["output_tok_s"]["16"] == pytest.approx(16 / memory_then_compute(16, 0), rel=1e-4)

    def small_gain(b, k):  # speculation pays 10% at batch 1 only; the off ranges cost 30% more
        return memory_then_compute(b, k) * (1.0 if k == 0 else (2.2 / 1.1 if b == 1 else 3.0))

    costly = table(small_gain)
    for b in (1, 2, 4, 8, 16):
        costly.costs.append(sp.StepCost(batch_size=b, k=0, step_s=1.3 * small_gain(b, 0), scheduled_off=True))
    plan = sp.make_plan(prof, costly, {"method": "eagle3"}, max_batch_size=16)
    assert plan["choice"] == "none" and plan["vllm"]["speculative_config"] is None
    assert plan["options"]["none"]["score"] > plan["options"]["schedule"]["score"]
    assert all(row["k"] == 0 for row in plan["chosen"].values())


def test_two_passes_that_agree_settle_a_cost_entry_and_a_noisy_one_takes_another():
    assert not repeats_settled([])
    assert not repeats_settled([0.050])  # one pass never settles
    assert repeats_settled([0.0500, 0.0505])  # within 2%
    assert not repeats_settled([0.050, 0.060])  # 20% apart: the third pass may be the fast one
    assert repeats_settled([0.060, 0.050, 0.0509])  # the two fastest decide
