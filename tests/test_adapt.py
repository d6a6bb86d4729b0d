"""Served traffic as training data (data_prep/traffic.py) and ``draftsmith adapt`` (eval/adapt.py):
what a log keeps and skips, the stable hold-out, refusals that leave everything untouched, and an
adaptation of a tiny deployed draft end to end."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from draftsmith.data_prep.traffic import (
    TrafficError,
    holdout_split,
    read_traffic,
    traffic_log_files,
)
from draftsmith.eval import adapt as adapt_mod
from safetensors.torch import load_file

MODEL = "tiny-target"


def served(i: int, prompt: str, reply: str, *, model: str = MODEL, status: int = 200, finish: str = "stop",
           endpoint: str = "chat", temperature: float | None = 0.0, messages: list | None = None) -> dict:
    """One traffic-log line as ``draftsmith proxy`` writes it."""
    request = {"model": model, "max_tokens": 64, "temperature": temperature,
               **({"prompt": prompt} if endpoint == "completions" else
                  {"messages": messages if messages is not None else [{"role": "user", "content": prompt}]})}
    return {"version": 1, "id": f"r{i}", "time": 1.0 + i, "endpoint": endpoint, "model": model,
            "upstream": "upstream-0", "status": status, "request": request,
            "choices": [{"index": 0, "text": reply, "finish_reason": finish}] if status == 200 else [],
            "usage": None, "latency_s": 0.1}


def write_log(path: Path, rows: list, tail: str = "") -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) + tail)
    return path


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
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Join me"},
         {"role": "assistant", "content": "Parts joined."}],
    ]
    assert report.skipped == {"duplicate": 1, "cut by max_tokens": 1, "empty completion": 1, "other model": 1,
                              "failed request": 1, "raw completions endpoint": 1, "non-text content": 1,
                              "no user turn": 1, "schema version": 1, "unparseable line": 1,
                              "incomplete reply": 1}
    assert report.first_bad["unparseable line"] == f"{log}:{len(rows) + 1}"
    assert report.first_bad["duplicate"] == f"{log}:2"
    assert report.lines == len(rows) + 1 and report.kept == 2
    assert report.temperatures == {"0": 1, "0.7": 1}
    assert "2 conversations kept" in report.summary() and "unparseable line" in report.summary()


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


def test_a_prompt_cut_by_max_tokens_first_is_kept_when_served_whole_later(tmp_path):
    log = write_log(tmp_path / "t.jsonl", [served(0, "p", "half", finish="length"), served(1, "p", "whole")])
    convs, report = read_traffic(log)
    assert [c["messages"][-1]["content"] for c in convs] == ["whole"]
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


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _fake_export(folder: Path) -> Path:
    """An EAGLE-3 export folder as far as adapt's checks read it (a real config, one weight)."""
    from draftsmith.models.eagle3 import Eagle3Config
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
    before = _digest(deployed)
    log = write_log(tmp_path / "traffic.jsonl", [served(i, f"p{i}", f"r{i}") for i in range(5)]
                    + [served(9, "x", "y", finish="length")], tail="{broken")
    run = tmp_path / "adapt"
    run.mkdir()
    (run / "keep.txt").write_text("an earlier adaptation")
    code = adapt_mod.main(["--log", str(log), "--deployed", str(deployed), "--recipe", "recipes/smollm2_135m.yaml",
                           "--run-dir", str(run), "--overwrite", "--min-conversations", "64", "--holdout", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "too little traffic" in err and "5 usable training conversations" in err
    assert "1 cut by max_tokens" in err and "1 unparseable line" in err and "untouched" in err
    assert _digest(deployed) == before
    assert sorted(p.name for p in run.iterdir()) == ["keep.txt"]  # --overwrite removed nothing


def test_the_deployed_draft_is_never_the_output(tmp_path, capsys):
    deployed = _fake_export(tmp_path / "deployed")
    log = write_log(tmp_path / "traffic.jsonl", [served(i, f"p{i}", f"r{i}") for i in range(5)])
    code = adapt_mod.main(["--log", str(log), "--deployed", str(deployed), "--recipe", "recipes/smollm2_135m.yaml",
                           "--run-dir", str(tmp_path / "run"), "--out", str(deployed / "v2")])
    assert code == 1 and "never overwritten" in capsys.readouterr().err


def test_a_folder_that_is_no_export_is_named(tmp_path, capsys):
    (tmp_path / "deployed").mkdir()
    log = write_log(tmp_path / "traffic.jsonl", [served(0, "p", "r")])
    code = adapt_mod.main(["--log", str(log), "--deployed", str(tmp_path / "deployed"), "--recipe",
                           "recipes/smollm2_135m.yaml", "--run-dir", str(tmp_path / "run")])
    assert code == 1 and "config.json missing" in capsys.readouterr().err


@pytest.mark.integration
def test_adapt_continues_the_deployed_draft_on_its_traffic_with_replay(tiny_target, tmp_path):
    from draftsmith.eval.spec_decode import load_eagle3
    from draftsmith.recipe import dump_recipe
    from helpers.recipes import tiny_deployed_draft

    recipe, base, _, deployed = tiny_deployed_draft(tiny_target, tmp_path, max_steps=6)
    before = _digest(deployed)
    recipe_file = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_file)

    # "served traffic": the target's own replies (regen.jsonl) to other prompts, through the log schema
    regen = [json.loads(line) for line in (base / "data" / "regen.jsonl").read_text().splitlines()]
    rows = [served(i, "", r["messages"][-1]["content"], messages=[{"role": "user", "content": f"[{i}] " +
                                                                  r["messages"][0]["content"]}])
            for i, r in enumerate(regen)]
    rows.append(served(99, "cut", "half a", finish="length"))
    log = write_log(tmp_path / "traffic.jsonl", rows, tail='{"version": 1, "id": "trunc')
    run = tmp_path / "adapt"
    code = adapt_mod.main(["--log", str(log), "--deployed", str(deployed), "--recipe", str(recipe_file),
                           "--replay", str(base / "data" / "regen.jsonl"), "--replay-share", "0.25",
                           "--run-dir", str(run), "--holdout", "0.2", "--min-conversations", "4",
                           "--budget-minutes", "20", "--set", "train.max_steps=4"])
    assert code == 0
    result = json.loads((run / "adapt.json").read_text())
    n = result["conversations"]
    assert n["traffic_train"] + n["heldout"] == len(regen)
    assert n["replay"] == round(n["traffic_train"] * 0.25 / 0.75)
    assert result["traffic"]["skipped"] == {"cut by max_tokens": 1, "unparseable line": 1}
    held = [json.loads(line)["messages"][0]["content"] for line in (run / "traffic" / "heldout.jsonl").open()]
    trained = [json.loads(line)["messages"][0]["content"] for line in (run / "traffic" / "train.jsonl").open()]
    assert len(held) == n["heldout"] and not set(held) & set(trained)
    from draftsmith.layout import DataPaths, read_tokenized

    assert len(read_tokenized(DataPaths(run / "data"))["input_ids"]) == n["traffic_train"] + n["replay"]
    # the served replies were used as they are: no regeneration, the adapted recipe says so
    assert "enabled: false" in (run / "adapt_recipe.yaml").read_text()
    # the new draft loads, differs from the deployed one, and the deployment was not touched
    out = Path(result["out"])
    cfg = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    model = load_eagle3(out, embed_tokens=torch.zeros(cfg["vocab_size"], cfg["hidden_size"]))
    assert model.config.aux_layer_ids == json.loads((deployed / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"]
    new, old = load_file(str(out / "model.safetensors")), load_file(str(deployed / "model.safetensors"))
    assert any(not torch.equal(new[k], old[k]) for k in ("fc.weight", "layers.0.mlp.down_proj.weight"))
    assert _digest(deployed) == before
    assert result["cpu_seconds"] > 0 and result["wall_seconds"] > 0
    shutil.rmtree(run / "data")
