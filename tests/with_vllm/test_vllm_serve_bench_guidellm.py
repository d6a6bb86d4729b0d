"""``draftsmith serve-bench --load-generator guidellm`` against a real vLLM server: GuideLLM (in its
own environment: docs/measuring.md, "GuideLLM as the load generator") drives the tiny target's
baseline at concurrency 1 and 2 (its scenario, report and parser: tests/unit/test_serving_guidellm.py).
Found as serve-bench finds it: ``$DRAFTSMITH_GUIDELLM``, else ``guidellm`` on PATH."""

from __future__ import annotations

import importlib.util
import json

import pytest

from draftsmith.cli import serve_bench as sb
from draftsmith.eval.serving.guidellm import GuideLLMError, find_guidellm

from helpers.procs import group_alive
from helpers.recipes import write_prompts


def _guidellm():
    try:
        return find_guidellm(), ""
    except GuideLLMError as exc:
        return None, str(exc)


GUIDELLM, NOT_FOUND = _guidellm()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
@pytest.mark.skipif(GUIDELLM is None, reason=f"GuideLLM not found, so it cannot be the load generator: {NOT_FOUND}")
def test_serve_bench_with_guidellm_as_the_load_generator(tiny_target, tmp_path):
    out = tmp_path / "serve"
    rc = sb.main(["--target", str(tiny_target), "--prompts", str(write_prompts(tmp_path / "prompts.jsonl")),
                  "--concurrency", "1,2", "--num-prompts-per-level", "2", "--max-new-tokens", "16", "--no-ngram",
                  "--k-sweep", "", "--load-generator", "guidellm", "--out-dir", str(out), "--dtype", "float32",
                  "--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-model-len", "512", "--max-num-seqs", "32"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["load_generator"] == GUIDELLM.name
    base = results["configs"]["baseline"]
    assert base["status"] == "ok", base.get("log_tail")
    assert set(base["levels"]) == {"1", "2"}
    for c, lv in base["levels"].items():
        assert "error" not in lv, lv.get("error")
        assert lv["load_generator"] == GUIDELLM.name and lv["raw"] == f"raw/baseline/c{c}_guidellm.json"
        assert lv["completed"] == 2 and lv["failed"] == 0 and 0 < lv["output_tokens"] <= 2 * 16
        assert lv["output_tok_s"] > 0 and lv["ttft_ms"]["p50"] > 0 and lv["e2el_ms"]["p50"] >= lv["ttft_ms"]["p50"]
        assert lv["itl_ms"]["mean"] is None  # GuideLLM keeps no per-chunk timestamps
        scenario = json.loads((out / "raw" / "baseline" / f"c{c}_guidellm_scenario.json").read_text())["spec"]
        assert scenario["profile"]["streams"] == [int(c)] and scenario["constraints"][0]["count"] == 2
    assert not group_alive(base["pgid"])
    assert f"- load generator: {GUIDELLM.name}" in (out / "report.md").read_text()
