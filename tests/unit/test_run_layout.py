"""The run layout and draft_config.json (draftsmith.layout): one typed owner for the paths and
the checkpoint metadata every stage passes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.layout import DataPaths, DraftCheckpointConfig, DraftConfigError, RunLayout

TARGET = {"name_or_path": "tiny", "verifier": "org/tiny", "path": "/m/tiny", "architectures": ["LlamaForCausalLM"],
          "hidden_size": 32, "vocab_size": 64, "aux_layer_ids": [0, 1, 2]}


def test_run_layout_names_every_stage_path():
    run = RunLayout(Path("runs/x"))
    assert run.data == DataPaths(Path("runs/x/data"))
    assert run.data.target_info == Path("runs/x/data/target.json")
    assert run.data.regen == Path("runs/x/data/regen.jsonl")
    assert run.data.tokenized == Path("runs/x/data/tokenized")
    assert run.data.tokenized_jsonl == Path("runs/x/data/tokenized.jsonl")  # legacy, converted on read
    assert run.data.vocab == Path("runs/x/data/vocab.safetensors")
    assert run.data.hidden_states == Path("runs/x/data/hidden_states")
    assert (run.checkpoints, run.export, run.eval, run.logs) == tuple(
        Path("runs/x") / d for d in ("checkpoints", "export", "eval", "logs"))
    assert (run.metrics, run.recipe) == (Path("runs/x/metrics.jsonl"), Path("runs/x/recipe.yaml"))


def test_eagle3_draft_config_writes_the_bytes_training_wrote_before(tmp_path):
    config = {"hidden_size": 32, "rope_scaling": None}
    legacy_bytes = json.dumps({"method": "eagle3", "config": config, "target": TARGET, "ttt_steps": 7}, indent=1)
    DraftCheckpointConfig(method="eagle3", config=config, target=TARGET, ttt_steps=7).write(tmp_path)
    assert (tmp_path / "draft_config.json").read_text() == legacy_bytes


def test_head_draft_config_writes_the_bytes_training_wrote_before(tmp_path):
    legacy_bytes = json.dumps({"method": "medusa", "config": {"num_heads": 2}, "target": TARGET, "head_decay": 0.8},
                              indent=1)
    DraftCheckpointConfig(method="medusa", config={"num_heads": 2}, target=TARGET, head_decay=0.8).write(tmp_path)
    assert (tmp_path / "draft_config.json").read_text() == legacy_bytes


def test_draft_config_reads_back_what_it_wrote(tmp_path):
    meta = DraftCheckpointConfig(method="eagle3", config={"hidden_size": 32}, target=TARGET, ttt_steps=3)
    meta.write(tmp_path)
    assert DraftCheckpointConfig.read(tmp_path) == meta
    assert meta.verifier == "org/tiny"


def test_draft_config_without_optional_keys_loads(tmp_path):
    (tmp_path / "draft_config.json").write_text(json.dumps({"method": "medusa", "config": {}, "target": {"name_or_path": "t"}}))
    meta = DraftCheckpointConfig.read(tmp_path)
    assert (meta.ttt_steps, meta.head_decay, meta.verifier) == (None, None, "t")


def test_missing_draft_config_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(DraftConfigError, match=r"draft_config\.json missing"):
        DraftCheckpointConfig.read(tmp_path)


@pytest.mark.parametrize("content, key", [
    ({"config": {}, "target": {}}, "method"),
    ({"method": "eagle3", "config": {}, "target": {}, "ttt_step": 3}, "ttt_step"),
    ({"method": "eagle3", "config": [], "target": {}}, "config"),
])
def test_invalid_draft_config_is_an_error_naming_the_file_and_key(tmp_path, content, key):
    (tmp_path / "draft_config.json").write_text(json.dumps(content))
    with pytest.raises(DraftConfigError, match=rf"draft_config\.json: invalid draft config \({key}"):
        DraftCheckpointConfig.read(tmp_path)


def test_draft_config_that_is_not_json_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "draft_config.json").write_text("{not json")
    with pytest.raises(DraftConfigError, match=r"draft_config\.json: invalid draft config"):
        DraftCheckpointConfig.read(tmp_path)
