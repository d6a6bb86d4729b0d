"""The run layout and draft_config.json (draftsmith.layout): one typed owner for the paths and
the checkpoint metadata every stage passes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith import __version__
from draftsmith.layout import DataPaths, DraftCheckpointConfig, DraftConfigError, RunLayout

TARGET = {"name_or_path": "tiny", "verifier": "org/tiny", "path": "/m/tiny", "architectures": ["LlamaForCausalLM"],
          "hidden_size": 32, "vocab_size": 64, "aux_layer_ids": [0, 1, 2]}


def test_run_layout_names_every_stage_path():
    run = RunLayout(Path("runs/x"))
    assert run.data == DataPaths(Path("runs/x/data"))
    assert run.data.target_info == Path("runs/x/data/target.json")
    assert run.data.regen == Path("runs/x/data/regen.jsonl")
    assert run.data.tokenized == Path("runs/x/data/tokenized")
    assert run.data.vocab == Path("runs/x/data/vocab.safetensors")
    assert run.data.hidden_states == Path("runs/x/data/hidden_states")
    assert (run.checkpoints, run.export, run.eval, run.logs) == tuple(
        Path("runs/x") / d for d in ("checkpoints", "export", "eval", "logs"))
    assert (run.metrics, run.recipe) == (Path("runs/x/metrics.jsonl"), Path("runs/x/recipe.yaml"))


def test_eagle3_draft_config_writes_its_keys_and_the_version(tmp_path):
    config = {"hidden_size": 32, "rope_scaling": None}
    DraftCheckpointConfig(method="eagle3", config=config, target=TARGET, ttt_steps=7).write(tmp_path)
    assert json.loads((tmp_path / "draft_config.json").read_text()) == {
        "method": "eagle3", "config": config, "target": TARGET, "ttt_steps": 7, "version": __version__}


def test_head_draft_config_writes_its_keys_and_the_version(tmp_path):
    DraftCheckpointConfig(method="medusa", config={"num_heads": 2}, target=TARGET, head_decay=0.8).write(tmp_path)
    assert json.loads((tmp_path / "draft_config.json").read_text()) == {
        "method": "medusa", "config": {"num_heads": 2}, "target": TARGET, "head_decay": 0.8, "version": __version__}


def test_draft_config_reads_back_what_it_wrote(tmp_path):
    meta = DraftCheckpointConfig(method="eagle3", config={"hidden_size": 32}, target=TARGET, ttt_steps=3)
    meta.write(tmp_path)
    assert DraftCheckpointConfig.read(tmp_path) == meta
    assert meta.verifier == "org/tiny"


def test_draft_config_without_optional_keys_loads(tmp_path):
    (tmp_path / "draft_config.json").write_text(json.dumps({"method": "medusa", "config": {}, "target": {"name_or_path": "t"},
                                                            "version": "0.2.0"}))
    meta = DraftCheckpointConfig.read(tmp_path)
    assert (meta.ttt_steps, meta.head_decay, meta.verifier) == (None, None, "t")


def test_missing_draft_config_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(DraftConfigError, match=r"draft_config\.json missing"):
        DraftCheckpointConfig.read(tmp_path)


@pytest.mark.parametrize("version", [None, "0.1.0"])
def test_a_checkpoint_of_draftsmith_before_0_2_0_is_refused_in_one_line(tmp_path, version):
    old = {"method": "eagle3", "config": {}, "target": {}, **({"version": version} if version else {})}
    (tmp_path / "draft_config.json").write_text(json.dumps(old))
    with pytest.raises(DraftConfigError) as err:
        DraftCheckpointConfig.read(tmp_path)
    assert str(err.value) == (f"{tmp_path}: written by {f'draftsmith {version}' if version else 'a draftsmith before 0.2.0'}, "
                              f"which this draftsmith ({__version__}) no longer reads: re-export it with the draftsmith "
                              "that wrote it, or train again with this one")


@pytest.mark.parametrize("content, key", [
    ({"config": {}, "target": {}}, "method"),
    ({"method": "eagle3", "config": {}, "target": {}, "ttt_step": 3}, "ttt_step"),
    ({"method": "eagle3", "config": [], "target": {}}, "config"),
])
def test_invalid_draft_config_is_an_error_naming_the_file_and_key(tmp_path, content, key):
    (tmp_path / "draft_config.json").write_text(json.dumps({**content, "version": __version__}))
    with pytest.raises(DraftConfigError, match=rf"draft_config\.json: invalid draft config \({key}"):
        DraftCheckpointConfig.read(tmp_path)


def test_draft_config_that_is_not_json_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "draft_config.json").write_text("{not json")
    with pytest.raises(DraftConfigError, match=r"draft_config\.json: invalid draft config"):
        DraftCheckpointConfig.read(tmp_path)
