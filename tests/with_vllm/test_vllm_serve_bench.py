"""``draftsmith serve-bench`` end to end against real vLLM servers: baseline, EAGLE-3 and ngram
(its command building and process handling are tests/unit/test_serve_bench.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from draftsmith.cli import serve_bench as sb
from draftsmith.eval.report import PLOTS

from helpers.procs import group_alive


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_serve_bench_end_to_end_baseline_eagle3_ngram(tiny_target, tmp_path):
    """Whole run on the tiny target: 3 servers, 2 levels, 2 prompts each; nothing left running."""
    from helpers.recipes import tiny_deployed_draft

    _, _, prompts, draft = tiny_deployed_draft(tiny_target, tmp_path)

    out = tmp_path / "serve"
    rc = sb.main(["--target", str(tiny_target), "--draft", str(draft), "--prompts", str(prompts), "--concurrency", "1,2",
                  "--num-prompts-per-level", "2", "--max-new-tokens", "16", "--k", "2", "--k-sweep", "2",
                  "--temperatures", "0", "--price-per-hour", "41.62", "--out-dir", str(out), "--dtype", "float32",
                  "--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-model-len", "512",
                  "--max-num-seqs", "32"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["configs"]) == ["baseline", "eagle3", "ngram"]
    for name, cfg in results["configs"].items():
        assert cfg["status"] == "ok", cfg.get("log_tail")
        assert set(cfg["levels"]) == {"1", "2"}
        assert all(lv["completed"] == 2 and lv["output_tok_s"] > 0 for lv in cfg["levels"].values()), name
        assert not group_alive(cfg["pgid"]), f"{name} server group still alive"
    acc = results["configs"]["eagle3"]["summary"]["acceptance"]
    assert acc["num_drafts"] > 0 and acc["num_draft_tokens"] == 2 * acc["num_drafts"]
    assert 1.0 <= acc["mean_acceptance_length"] <= 3.0 and len(acc["per_position_acceptance"]) == 2
    for lv in results["configs"]["eagle3"]["levels"].values():  # vLLM's own counter diff is kept beside ours
        assert 1.0 <= lv["acceptance"]["bench_reported_acceptance_length"] <= 3.0
    assert results["k_sweep"]["recommendation"]["k"] == 2
    report = (out / "report.md").read_text()
    assert "| eagle3 | 1 |" in report and (out / PLOTS["throughput"]).is_file()
    import psutil

    stray = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
             if str(tiny_target) in " ".join(p.info["cmdline"] or [])]
    assert not stray
