"""Served traffic as training data (data_prep/traffic.py) and ``draftsmith adapt`` (serve/adapt.py):
what a log keeps and skips, the stable hold-out, refusals that leave everything untouched, and an
adaptation of a tiny deployed draft end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.data_prep.traffic import (
    TrafficError,
    holdout_split,
    read_traffic,
    traffic_log_files,
)
from draftsmith.cli import adapt as adapt_cli

from helpers import folder_digest
from helpers.fake_inputs import MODEL, served, write_log


def test_the_log_keeps_served_chat_replies_and_counts_every_skip(tmp_path):
    rows = [
        served(0, "What is 2+2?", "4."),
        served(1, "What is 2+2?", "Four."),                                   # the same prompt again
        served(2, "Sort a list", "Use sorted()", finish="length"),            # cut by max_tokens
        served(3, "Hi", "", ),                                                 # empty
        served(10, "Tell me", "Once upon", finish=None),                      # the client left mid-stream
        served(4, "Other", "x", model="another-model"),
        served(5, "Broken", "", status=500),
        served(6, "raw text", "completion", endpoint="completions"),
        served(7, "img", "a cat", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        served(8, "", "ok", messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
        {"version": 2, "id": "future"},
        served(9, "", "Parts joined.", temperature=0.7,
               messages=[{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Join "}, {"type": "text", "text": "me"}]}]),
    ]
    log = write_log(tmp_path / "traffic.jsonl", rows, tail='{"version": 1, "id": "cut mid-wri')
    convs, report = read_traffic(log)
    assert report.model == MODEL  # the model most served requests name
    assert [c["messages"] for c in convs] == [
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
        [{"role": "user", "content": "Sort a list"}, {"role": "assistant", "content": "Use sorted()"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Join me"},
         {"role": "assistant", "content": "Parts joined."}],
    ]
    assert [c["cut"] for c in convs] == [False, True, False]  # the target's own tokens: kept, marked
    assert report.skipped == {"duplicate": 1, "empty completion": 1, "other model": 1,
                              "failed request": 1, "raw completions endpoint": 1, "non-text content": 1,
                              "no user turn": 1, "schema version": 1, "unparseable line": 1,
                              "incomplete reply": 1}
    assert report.first_bad["unparseable line"] == f"{log}:{len(rows) + 1}"
    assert report.first_bad["duplicate"] == f"{log}:2"
    assert report.lines == len(rows) + 1 and report.kept == 3 and report.cut == 1
    assert report.temperatures == {"0": 2, "0.7": 1}
    assert "3 conversations kept (1 cut by max_tokens" in report.summary() and "unparseable line" in report.summary()
    dropped, dropped_report = read_traffic(log, keep_cut=False)
    assert [c["messages"] for c in dropped] == [convs[0]["messages"], convs[2]["messages"]]
    assert dropped_report.skipped["cut by max_tokens"] == 1 and dropped_report.cut == 0


def test_rotated_files_are_read_oldest_first(tmp_path):
    base = tmp_path / "traffic.jsonl"
    write_log(tmp_path / "traffic.jsonl.2", [served(0, "p", "oldest")])
    write_log(tmp_path / "traffic.jsonl.1", [served(1, "p", "middle"), served(2, "q", "b")])
    write_log(base, [served(3, "r", "c")])
    (tmp_path / "traffic.jsonl.bak").write_text("not a rotation\n")
    assert [f.name for f in traffic_log_files(base)] == ["traffic.jsonl.2", "traffic.jsonl.1", "traffic.jsonl"]
    convs, report = read_traffic(base)
    assert [c["messages"][-1]["content"] for c in convs] == ["oldest", "b", "c"]
    assert report.skipped == {"duplicate": 1}
    with pytest.raises(TrafficError, match="no traffic log"):
        traffic_log_files(tmp_path / "missing.jsonl")


def test_a_prompt_served_cut_then_whole_is_one_example_either_way(tmp_path):
    log = write_log(tmp_path / "t.jsonl", [served(0, "p", "half", finish="length"), served(1, "p", "whole")])
    convs, report = read_traffic(log)
    assert [(c["messages"][-1]["content"], c["cut"]) for c in convs] == [("half", True)]
    assert report.skipped == {"duplicate": 1}
    convs, report = read_traffic(log, keep_cut=False)
    assert [(c["messages"][-1]["content"], c["cut"]) for c in convs] == [("whole", False)]
    assert report.skipped == {"cut by max_tokens": 1}


def test_the_holdout_is_by_prompt_and_stable_as_the_log_grows(tmp_path):
    log = write_log(tmp_path / "t.jsonl", [served(i, f"prompt {i}", f"reply {i}") for i in range(400)])
    convs, _ = read_traffic(log)
    train, held = holdout_split(convs, 0.2, seed=3)
    assert 40 < len(held) < 120 and len(train) + len(held) == 400
    assert not {c["prompt_key"] for c in train} & {c["prompt_key"] for c in held}
    _, held2 = holdout_split(convs[:250], 0.2, seed=3)  # an earlier, shorter log
    assert {c["id"] for c in held2} == {c["id"] for c in held if int(c["id"].removeprefix("traffic-r")) < 250}
    assert holdout_split(convs, 0.2, seed=4)[1] != held
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        holdout_split(convs, 1.0)


def _fake_export(folder: Path) -> Path:
    """An EAGLE-3 export folder as far as adapt's checks read it (a real config, one weight)."""
    from draftsmith.models.eagle3.config import Eagle3Config
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    cfg = Eagle3Config(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       vocab_size=32, draft_vocab_size=16, aux_layer_ids=[0, 1, 2])
    config = cfg.to_speculators({"name_or_path": MODEL, "architectures": ["LlamaForCausalLM"]}, 3, "float32", "0", {})
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(8, 24)}, str(folder / "model.safetensors"))
    return folder


def test_too_little_traffic_is_refused_with_counts_and_nothing_is_touched(tmp_path, capsys):
    deployed = _fake_export(tmp_path / "deployed")
    before = folder_digest(deployed)
    log = write_log(tmp_path / "traffic.jsonl", [served(i, f"p{i}", f"r{i}") for i in range(5)]
                    + [served(9, "x", "y", finish="length")], tail="{broken")
    run = tmp_path / "adapt"
    run.mkdir()
    (run / "keep.txt").write_text("an earlier adaptation")
    code = adapt_cli.main(["--log", str(log), "--deployed", str(deployed), "--recipe", "recipes/smollm2_135m.yaml",
                           "--run-dir", str(run), "--overwrite", "--min-conversations", "64", "--holdout", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "too little traffic" in err and "6 usable training conversations" in err
    assert "1 cut by max_tokens" in err and "1 unparseable line" in err and "untouched" in err
    assert folder_digest(deployed) == before
    assert sorted(p.name for p in run.iterdir()) == ["keep.txt"]  # --overwrite removed nothing


def test_the_deployed_draft_is_never_the_output(tmp_path, capsys):
    deployed = _fake_export(tmp_path / "deployed")
    log = write_log(tmp_path / "traffic.jsonl", [served(i, f"p{i}", f"r{i}") for i in range(5)])
    code = adapt_cli.main(["--log", str(log), "--deployed", str(deployed), "--recipe", "recipes/smollm2_135m.yaml",
                           "--run-dir", str(tmp_path / "run"), "--out", str(deployed / "v2")])
    assert code == 1 and "never overwritten" in capsys.readouterr().err


def test_a_folder_that_is_no_export_is_named(tmp_path, capsys):
    (tmp_path / "deployed").mkdir()
    log = write_log(tmp_path / "traffic.jsonl", [served(0, "p", "r")])
    code = adapt_cli.main(["--log", str(log), "--deployed", str(tmp_path / "deployed"), "--recipe",
                           "recipes/smollm2_135m.yaml", "--run-dir", str(tmp_path / "run")])
    assert code == 1 and "config.json missing" in capsys.readouterr().err
