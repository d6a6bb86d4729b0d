"""Typed results: what the producers write keeps today's JSON keys and reads back typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.eval.acceptance import summarise
from draftsmith.eval.report import write_report
from draftsmith.eval.results import AcceptanceResult, ServeResults, read_acceptance, write_acceptance
from draftsmith.eval.serving import metrics
from draftsmith.eval.serving import run as runner

BENCH = {"num_prompts": 2, "completed": 2, "failed": 0, "duration": 2.0, "total_output_tokens": 200,
         "output_throughput": 100.0, "total_token_throughput": 150.0, "request_throughput": 1.0,
         "generated_texts": ["a", "b"], "spec_decode_acceptance_length": 1.5,
         **{f"{s}_{m}_ms": v for m, v in (("ttft", 20.0), ("tpot", 9.0), ("itl", 9.0), ("e2el", 900.0))
            for s in ("mean", "p50", "p95", "p99")}}


def _fake_serve(study, cfg, levels, temperatures=(), temperature_level=None):
    """serve_configuration without a server: every level measured from BENCH and fixed counters."""
    counters = {"drafts": 100, "draft_tokens": 100 * cfg.k, "accepted_tokens": 50, "per_pos": [30, 20] + [0] * (cfg.k - 2)}
    speedup = 1.0 + cfg.k / 10 if cfg.spec else 1.0

    def level(c, t):
        lv = metrics.level_metrics(dict(BENCH, output_throughput=100.0 * speedup), counters if cfg.spec else None, cfg.k)
        lv.update(concurrency=c, temperature=t, raw=f"raw/{cfg.name}/c{c}.json", _texts=["a", "b"])
        return lv

    return {"name": cfg.name, "speculative_config": cfg.spec, "k": cfg.k, "status": "ok", "server_log": "logs/x.log",
            "startup_s": 1.0, "pgid": 1, "command": "vllm serve T", "levels": {c: level(c, 0.0) for c in levels},
            "temperatures": {t: level(temperature_level, t) for t in temperatures}}


def _study(tmp_path: Path) -> runner.Study:
    eagle = runner.ServeConfiguration("eagle3", {"method": "eagle3", "model": "D", "num_speculative_tokens": 3}, 3)
    return runner.Study(target=tmp_path, out_dir=tmp_path, prompt_sets={1: ["p", "q"], 2: ["r", "s"]},
                        configs=[runner.ServeConfiguration("baseline", None), eagle], k_sweep=[2, 3],
                        temperatures=[0.0, 0.7], price_per_hour=36.0, meta={"target_name": "T", "command": "c"})


def test_run_study_writes_results_that_read_back_typed_with_the_same_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "serve_configuration", _fake_serve)
    returned = runner.run_study(_study(tmp_path))
    raw = json.loads((tmp_path / "results.json").read_text())
    typed = ServeResults.read(tmp_path / "results.json")
    assert typed.to_json() == raw == returned.to_json()
    assert set(raw) == {"meta", "configs", "k_sweep", "temperature_sweep"}
    lv = raw["configs"]["eagle3"]["levels"]["1"]
    assert "_texts" not in lv and lv["outputs_equal_baseline"] == 1.0
    assert lv["ttft_ms"] == {"mean": 20.0, "p50": 20.0, "p95": 20.0, "p99": 20.0}
    assert lv["acceptance"]["mean_acceptance_length"] == 1.5 and lv["acceptance"]["per_pos_counts"] == [30, 20, 0]
    summary = typed.configs["eagle3"].summary
    assert summary.geomean_output_tok_s == pytest.approx(130.0) and summary.speedup_per_level == pytest.approx({1: 1.3, 2: 1.3})
    assert summary.cost_per_1m_output_tokens == pytest.approx(metrics.cost_per_million_tokens(130.0, 36.0))
    assert typed.k_sweep.recommendation.k == 3 and set(typed.k_sweep.k) == {2, 3}
    assert set(typed.temperature_sweep.temperatures) == {0.0, 0.7}
    assert (write_report(tmp_path)).read_text().startswith("# Serving benchmark")


def test_acceptance_json_keeps_the_workers_keys_without_token_ids(tmp_path):
    counters = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 12, "per_pos": [7, 4, 1]}
    worker = {"method": "eagle3", "num_speculative_tokens": 3, "temperature": 0.0, "prompts": "builtin:eval",
              "num_prompts": 2, "output_tokens": 40, "generate_seconds": 2.0, "output_tokens_per_s": 20.0,
              "counters": counters, **summarise(counters, 3), "outputs": [[1, 2], [3]]}
    path = write_acceptance(tmp_path / "acc.json", {"eagle3": AcceptanceResult.model_validate(worker)})
    assert json.loads(path.read_text()) == {"eagle3": {k: v for k, v in worker.items() if k != "outputs"}}
    back = read_acceptance(path)["eagle3"]
    assert back.mean_acceptance_length == 1 + 12 / 10 and back.per_position_acceptance == [0.7, 0.4, 0.1]
    assert back.outputs is None


def test_serve_table_reads_several_runs_and_names_a_bad_one(tmp_path, monkeypatch, capsys):
    """``draftsmith serve-table``: one row per draft and level from each run's own baseline and
    draft levels, the temperature sweep below; a file that is not a results.json is named."""
    from draftsmith.cli.serve_table import main as serve_table

    monkeypatch.setattr(runner, "serve_configuration", _fake_serve)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        study = _study(tmp_path / name)
        study.out_dir = tmp_path / name
        runner.run_study(study)
    assert serve_table([f"first={tmp_path / 'a' / 'results.json'}", f"second={tmp_path / 'b' / 'results.json'}"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| first (eagle3)") or line.startswith("| second (eagle3)")]
    assert len(rows) == 4  # two drafts x levels 1, 2
    # the fake draft serves 1.3x the baseline's 100 tok/s; AL = 1 + 50 accepted / 100 drafts
    assert all("| 100.0 | 130.0 | 1.30x | 1.500 (0.300 / 0.200 / 0.000) |" in row for row in rows)
    temps = [line for line in out.splitlines() if line.startswith("| first | T=")]
    assert len(temps) == 1 and temps[0].count("|") == 3  # one cell of temperatures under a two-column header
    assert "T=0: 1.500" in temps[0] and "T=0.7: 1.500" in temps[0]
    (tmp_path / "bad.json").write_text("{}")
    assert serve_table([f"x={tmp_path / 'bad.json'}"]) == 2
    assert "bad.json: not a serve-bench results.json" in capsys.readouterr().err
