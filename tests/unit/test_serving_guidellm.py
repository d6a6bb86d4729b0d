"""GuideLLM as serve-bench's load generator (draftsmith.eval.serving.guidellm): finding the
executable, the scenario and command of one level, running it (a stand-in executable here; the
real one in tests/with_vllm/test_vllm_serve_bench_guidellm.py), and reading a real GuideLLM 0.8.1
report (tests/fixtures/guidellm/report_c1.json: a serve-bench run's report of the baseline at
concurrency 1, trimmed to the fields read or cross-checked) into the figures vLLM's benchmark gives."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from draftsmith.cli import serve_bench as sb
from draftsmith.eval.serving import guidellm as gl
from draftsmith.eval.serving.client import write_custom_dataset
from draftsmith.eval.serving.metrics import level_metrics

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "guidellm" / "report_c1.json"
# the level's prompts in the order serve-bench gave them (prompts/level_1_guidellm.jsonl of that run)
PROMPTS = ["Why does ice float on water?", "What is photosynthesis, in simple terms?", "How do bees make honey?",
           "What does DNA stand for, and what does it do?", "What was the Silk Road?",
           "A recipe for 4 people needs 300 grams of rice. How much rice do I need for 10 people?",
           "What is the speed of sound in air?", "Why does metal feel colder than wood at the same temperature?"]


def fake_guidellm(tmp_path: Path, run_body: str) -> Path:
    """An executable that answers ``--version`` as guidellm 0.8.1 does and runs ``run_body``
    (Python, with ``spec``: the scenario it was given) for ``run --scenario FILE``."""
    exe = tmp_path / "bin" / "guidellm"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!{sys.executable}\n" + "import json, sys\n"
                   "if sys.argv[1:] == ['--version']:\n    print('guidellm version: 0.8.1'); sys.exit(0)\n"
                   "assert sys.argv[1:3] == ['run', '--scenario'] and sys.argv[4:] == ['--disable-console-interactive']\n"
                   "spec = json.load(open(sys.argv[3]))['spec']\n" + run_body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_scenario_is_one_concurrent_level_of_our_prompts_on_the_chat_endpoint(tmp_path):
    data = write_custom_dataset(PROMPTS[:3], tmp_path / "level_2_guidellm.jsonl", None)
    assert [json.loads(x) for x in data.read_text().splitlines()] == [{"prompt": p} for p in PROMPTS[:3]]
    spec = gl.scenario(8123, "/models/t", data, 3, 2, 64, 0.0, tmp_path / "c2.json")["spec"]
    assert spec["backend"] == {"kind": "openai_http", "target": "http://127.0.0.1:8123", "model": "/models/t",
                               "request_format": "/v1/chat/completions", "max_tokens": 64,
                               "extras": {"body": {"temperature": 0.0}}}
    assert spec["profile"] == {"kind": "concurrent", "streams": [2]}
    assert spec["constraints"] == [{"kind": "max_requests", "count": 3}]
    assert spec["data"] == [{"kind": "json_file", "path": str(data)}]
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "c2.json")}]
    assert spec["tokenizer"] == {"kind": "huggingface_auto", "model": "/models/t"}
    tool = gl.GuideLLM(Path("/venv/bin/guidellm"), "0.8.1", "--guidellm")
    assert gl.command(tool, tmp_path / "s.json") == ["/venv/bin/guidellm", "run", "--scenario", str(tmp_path / "s.json"),
                                                     "--disable-console-interactive"]
    assert tool.name == "guidellm 0.8.1"


def test_a_real_report_gives_the_figures_of_vllms_benchmark():
    report = json.loads(FIXTURE.read_text())
    bench = gl.bench_result(report, PROMPTS)
    lv = level_metrics(bench, None, 0)
    theirs = {k: v["successful"] for k, v in report["benchmarks"][0]["metrics"].items() if k != "request_totals"}
    assert (lv["num_prompts"], lv["completed"], lv["failed"]) == (8, 8, 0)
    assert lv["output_tokens"] == 496 and lv["input_tokens"] == 327 == theirs["prompt_token_count"]["total_sum"]
    # GuideLLM's own throughputs are tokens over its benchmark duration: the same numbers
    assert lv["duration_s"] == pytest.approx(52.75911569595337)
    assert lv["output_tok_s"] == pytest.approx(theirs["output_tokens_per_second"]["mean"]) == pytest.approx(9.401219)
    assert lv["total_tok_s"] == pytest.approx(theirs["tokens_per_second"]["mean"])
    assert lv["request_per_s"] == pytest.approx(theirs["requests_per_second"]["mean"])
    assert lv["ttft_ms"]["mean"] == pytest.approx(theirs["time_to_first_token_ms"]["mean"])
    assert lv["e2el_ms"]["mean"] == pytest.approx(1000 * theirs["request_latency"]["mean"])
    assert lv["ttft_ms"]["p50"] == pytest.approx(316.6288137435913) and lv["ttft_ms"]["p99"] == pytest.approx(352.212958)
    # TPOT per request (vLLM's definition), mean over requests; GuideLLM's own ITL mean weighs by token
    assert lv["tpot_ms"]["mean"] == pytest.approx(102.9506174) and lv["tpot_ms"]["p50"] == pytest.approx(105.4497863)
    assert theirs["inter_token_latency_ms"]["mean"] == pytest.approx(103.1250812)
    assert lv["median_request_latency_ms"] == pytest.approx(6472.240090370178)
    assert lv["itl_ms"] == {"mean": None}  # no per-chunk timestamps in GuideLLM's report: left out, not made up
    texts = bench["generated_texts"]
    assert len(texts) == 8 and texts[0].startswith("The reason for ice's unique behavior") and all(texts)
    assert gl.bench_result(report, PROMPTS[::-1])["generated_texts"] == texts[::-1]
    assert gl.bench_result(report, PROMPTS[:7] + ["not sent"])["generated_texts"] is None


def test_percentiles_interpolate_as_numpy_does():
    assert gl.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert gl.percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85)
    assert gl.percentile([7.0], 99) == 7.0


def test_a_report_of_several_benchmarks_or_none_is_refused():
    report = json.loads(FIXTURE.read_text())
    with pytest.raises(ValueError, match="one benchmark, got 2"):
        gl.bench_result({"benchmarks": report["benchmarks"] * 2})
    with pytest.raises(ValueError, match="got none"):
        gl.bench_result({"metadata": {}})


def test_a_missing_executable_is_one_line_naming_the_flag_and_the_variable(tmp_path, capsys):
    with pytest.raises(gl.GuideLLMError) as err:
        gl.find_guidellm(None, env={"PATH": str(tmp_path)})
    msg = str(err.value)
    assert "\n" not in msg and "no `guidellm` on PATH" in msg and "--guidellm PATH" in msg and "$DRAFTSMITH_GUIDELLM" in msg
    with pytest.raises(gl.GuideLLMError, match=r"^guidellm not found \(\$DRAFTSMITH_GUIDELLM = /no/such is not an executable\)"):
        gl.find_guidellm(None, env={"DRAFTSMITH_GUIDELLM": "/no/such", "PATH": str(tmp_path)})
    # serve-bench stops before it resolves a target or starts a server
    rc = sb.main(["--target", "no-such-target", "--load-generator", "guidellm", "--guidellm", str(tmp_path / "nope"),
                  "--out-dir", str(tmp_path / "out")])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err_lines) == 1
    assert err_lines[0].startswith(f"error: guidellm not found (--guidellm = {tmp_path / 'nope'} is not an executable)")
    assert not (tmp_path / "out").exists()
    assert sb.main(["--target", "t", "--guidellm", "/x", "--out-dir", str(tmp_path / "o")]) == 2
    assert "add that flag" in capsys.readouterr().err


def test_the_flag_wins_over_the_variable_and_the_variable_over_path(tmp_path, monkeypatch):
    flag, var = fake_guidellm(tmp_path / "a", ""), fake_guidellm(tmp_path / "b", "")
    on_path = fake_guidellm(tmp_path / "c", "")
    env = {"PATH": str(on_path.parent), "DRAFTSMITH_GUIDELLM": str(var)}
    assert gl.find_guidellm(str(flag), env=env) == gl.GuideLLM(flag, "0.8.1", "--guidellm")
    assert gl.find_guidellm(None, env=env).executable == var
    assert gl.find_guidellm(None, env={"PATH": env["PATH"]}) == gl.GuideLLM(on_path, "0.8.1", "PATH")


def test_a_run_returns_the_report_and_a_failed_run_is_one_line_with_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    ok = fake_guidellm(tmp_path / "ok", "import os, shutil\nassert 'PYTHONPATH' not in os.environ\n"
                       f"shutil.copy({str(FIXTURE)!r}, spec['outputs'][0]['path'])")
    tool = gl.find_guidellm(str(ok), env={})
    spec = gl.scenario(1, "m", tmp_path / "d.jsonl", 8, 1, 64, 0.0, tmp_path / "raw" / "c1_guidellm.json")
    report = gl.run_guidellm(tool, spec, tmp_path / "raw" / "c1_scenario.json", tmp_path / "logs" / "c1.log", 60)
    assert report == json.loads(FIXTURE.read_text())
    assert json.loads((tmp_path / "raw" / "c1_scenario.json").read_text()) == spec
    assert (tmp_path / "logs" / "c1.log").read_text().startswith(f"$ {ok} run --scenario")

    bad = fake_guidellm(tmp_path / "bad", "print('Connecting...')\nprint('Error: backend unreachable', file=sys.stderr)\n"
                        "sys.exit(1)")
    with pytest.raises(gl.GuideLLMError) as err:
        gl.run_guidellm(gl.find_guidellm(str(bad), env={}), spec, tmp_path / "s.json", tmp_path / "logs" / "bad.log", 60)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("guidellm run failed (exit 1): Error: backend unreachable")
    assert f"log {tmp_path / 'logs' / 'bad.log'}" in msg and "--guidellm PATH, $DRAFTSMITH_GUIDELLM" in msg
    assert isinstance(err.value, RuntimeError)  # serve-bench records it as the level's error and goes on

    slow = fake_guidellm(tmp_path / "slow", "import time\ntime.sleep(60)")
    with pytest.raises(gl.GuideLLMError, match=r"\(timed out after 1 s\)"):
        gl.run_guidellm(gl.find_guidellm(str(slow), env={}), spec, tmp_path / "s.json", tmp_path / "logs" / "slow.log", 1)


def test_recipe_key_and_flag_choose_the_load_generator(tmp_path):
    from draftsmith.recipe import ServeConfig

    assert ServeConfig().load_generator == "vllm"
    assert ServeConfig(load_generator="guidellm").load_generator == "guidellm"
    with pytest.raises(ValueError):
        ServeConfig(load_generator="locust")
    args = sb.build_parser().parse_args(["--load-generator", "guidellm", "--guidellm", "/x", "--out-dir", "o"])
    assert (args.load_generator, args.guidellm) == ("guidellm", "/x")
