"""``RUN_DIR/data/target.json`` as :class:`draftsmith.target.TargetInfo`: the bytes the target
stage writes, and the files of older or other draftsmiths it still reads."""

from __future__ import annotations

import json

import pytest

from draftsmith.target import TargetInfo, TargetInfoError

WRITTEN = {"name_or_path": "embedded:SmolLM2-135M-Instruct", "verifier": "HuggingFaceTB/SmolLM2-135M-Instruct",
           "path": "/cache/targets/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"],
           "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152, "aux_layer_ids": [2, 15, 27]}


def test_the_target_stage_writes_the_same_bytes_as_a_plain_json_dump(tmp_path):
    info = TargetInfo(**WRITTEN)
    assert info.to_json() == json.dumps(WRITTEN, indent=1)
    path = info.write(tmp_path / "target.json")
    assert path.read_text() == json.dumps(WRITTEN, indent=1)
    back = TargetInfo.read(path)
    assert back == info and back.to_dict() == WRITTEN and list(back.to_dict()) == list(WRITTEN)


def test_an_older_file_reads_with_its_own_keys_only(tmp_path):
    old = {"name_or_path": "x", "path": "/t", "hidden_size": 128, "vocab_size": 512, "aux_layer_ids": [1, 3, 4],
           "written_by": "another draftsmith"}
    (tmp_path / "target.json").write_text(json.dumps(old))
    info = TargetInfo.read(tmp_path / "target.json")
    assert info.verifier is None and info.num_hidden_layers is None and info.architectures is None
    assert info.to_dict() == old  # no keys added, other keys kept
    info.aux_layer_ids = [2, 3, 4]  # what training does with the shards' layers
    assert info.to_dict() == {**old, "aux_layer_ids": [2, 3, 4]}


def test_a_missing_or_mistyped_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError):
        TargetInfo.read(tmp_path / "target.json")
    (tmp_path / "target.json").write_text(json.dumps({"hidden_size": "wide"}))
    with pytest.raises(TargetInfoError, match=r"target\.json: invalid target\.json \(hidden_size: "):
        TargetInfo.read(tmp_path / "target.json")
    (tmp_path / "target.json").write_text("[]")
    with pytest.raises(TargetInfoError, match=r"invalid target\.json"):
        TargetInfo.read(tmp_path / "target.json")
