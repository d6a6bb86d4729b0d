"""Bad input the other test files do not cover: each fails loudly with a message naming the
file / row / key, or is skipped and counted (over-long rows, a too-large draft vocab)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.data_prep import conversations as conv
from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import ShardSpec
from draftsmith.fileio import ShardError
from draftsmith.train.data import HiddenStateDataset
from draftsmith.data_prep.prepare import stage_tokenize, stage_vocab
from draftsmith.layout import DataPaths, DraftCheckpointConfig
from draftsmith.eval.acceptance import DraftMismatchError, check_draft_matches_target
from draftsmith.eval.export import export
from draftsmith.layout import ExportError
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetInfo, load_target
from draftsmith.train.checkpoint import check_checkpoint_shapes

from helpers.tiny import TINY_AUX


def target_info(tiny_target: Path) -> TargetInfo:
    return TargetInfo(path=str(tiny_target), vocab_size=512, hidden_size=128, aux_layer_ids=TINY_AUX,
                      name_or_path=str(tiny_target))


def conversation(i: int, words: int) -> dict:
    return {"id": f"r{i}", "messages": [{"role": "user", "content": "Name a quick brown animal."},
                                        {"role": "assistant", "content": " ".join(["fox"] * words)}]}


def test_overlong_rows_are_dropped_and_counted(tiny_target, tmp_path):
    recipe = load_recipe(None, ["data.max_length=64", "data.overlong=drop"])
    rows = stage_tokenize(recipe, DataPaths(tmp_path), target_info(tiny_target),
                          [conversation(0, 2), conversation(1, 80), conversation(2, 3)], [])
    assert [r["id"] for r in rows] == ["r0", "r2"]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["skipped"]["overlong_dropped"] == 1 and stats["truncated"] == 0


def test_zero_trainable_tokens_is_an_error_naming_the_cause(tiny_target, tmp_path):
    recipe = load_recipe(None, ["data.max_length=64", "data.overlong=drop"])
    with pytest.raises(conv.DataError, match="zero trainable assistant tokens.*overlong_dropped': 1"):
        stage_tokenize(recipe, DataPaths(tmp_path), target_info(tiny_target), [conversation(1, 80)], [])


def test_draft_vocab_larger_than_target_vocab_is_capped_with_a_warning(tmp_path, caplog):
    recipe = load_recipe(None, ["data.draft_vocab_size=100000"])
    records = [{"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}]
    with caplog.at_level(logging.WARNING):
        out = stage_vocab(recipe, DataPaths(tmp_path), TargetInfo(vocab_size=512), records)
    assert out["draft_vocab_size"] == 512
    assert "draft_vocab_size 100000 > target vocab 512: capped at 512" in caplog.text


@pytest.fixture(scope="module")
def shard_dir(tiny_target, tmp_path_factory):
    model, _ = load_target(tiny_target)
    g = torch.Generator().manual_seed(0)
    records = [{"id": f"s{i}", "input_ids": torch.randint(0, 512, (12,), generator=g).tolist(),
                "loss_mask": [0] * 4 + [1] * 8} for i in range(4)]
    out = tmp_path_factory.mktemp("shards")
    generate_hidden_states(model, records, out, ShardSpec(128, TINY_AUX, "bfloat16"), sequences_per_shard=2,
                           progress=False)
    return out


def edited_copy(src: Path, dst: Path, **shard0) -> Path:
    import shutil

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest.update({k: v for k, v in shard0.items() if k == "dtype"})
    manifest["shards"][0].update({k: v for k, v in shard0.items() if k != "dtype"})
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_shard_whose_shape_disagrees_with_the_manifest_is_refused(shard_dir, tmp_path):
    d = edited_copy(shard_dir, tmp_path / "d", num_tokens=25)
    with pytest.raises(ShardError, match=r"shard-00000.safetensors: aux_hidden_states shape \[24, 384\], manifest says \[25, 384\]"):
        HiddenStateDataset(d)


def test_shard_whose_dtype_disagrees_with_the_manifest_is_refused(shard_dir, tmp_path):
    d = edited_copy(shard_dir, tmp_path / "d", dtype="float16")
    with pytest.raises(ShardError, match="shard-00000.safetensors: dtype BF16, manifest says float16"):
        HiddenStateDataset(d)


def test_truncated_shard_is_refused_with_and_without_checksums(shard_dir, tmp_path):
    d = edited_copy(shard_dir, tmp_path / "d")
    shard = d / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    # the size check (default) and the full hash both catch it
    with pytest.raises(ShardError, match=r"shard-00001.safetensors: size \d+ bytes, manifest says \d+"):
        HiddenStateDataset(d)
    with pytest.raises(ShardError, match=r"shard-00001.safetensors: size \d+ bytes"):
        HiddenStateDataset(d, verify="full")
    # a manifest written before sizes were recorded: the header check still refuses it
    manifest = json.loads((d / "manifest.json").read_text())
    for s in manifest["shards"]:
        del s["bytes"]
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="shard-00001.safetensors: unreadable shard"):
        HiddenStateDataset(d, verify=False)


def draft_config(**kw) -> Eagle3Config:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=50, draft_vocab_size=20, aux_layer_ids=[0, 1, 2], rope_theta=10000.0)
    return Eagle3Config(**{**base, **kw})


def fake_checkpoint(directory: Path, weights_cfg: Eagle3Config, declared_cfg: Eagle3Config) -> Path:
    """A checkpoint whose weights were trained with ``weights_cfg`` but whose draft_config.json
    says ``declared_cfg`` (e.g. copied in from a run on another target)."""
    directory.mkdir(parents=True)
    model = Eagle3DraftModel(weights_cfg)
    model.set_vocab_mapping(torch.zeros(weights_cfg.draft_vocab_size, dtype=torch.long),
                            torch.ones(weights_cfg.vocab_size, dtype=torch.bool))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    DraftCheckpointConfig(method="eagle3", config=declared_cfg.to_dict(), target={"name_or_path": "t"}).write(directory)
    return directory


def test_resume_from_a_checkpoint_of_another_target_is_refused(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "step-5", draft_config(hidden_size=32), draft_config(hidden_size=32))
    with pytest.raises(ValueError, match=r"fc.weight has shape \[32, 96\] but this run's model has \[48, 144\].*another target"):
        check_checkpoint_shapes(ckpt, Eagle3DraftModel(draft_config(hidden_size=48)))
    check_checkpoint_shapes(ckpt, Eagle3DraftModel(draft_config(hidden_size=32)))  # the matching one passes


def test_export_of_a_checkpoint_inconsistent_with_its_target_is_refused(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "step-5", draft_config(vocab_size=50), draft_config(vocab_size=64))
    with pytest.raises(ExportError, match=r"model.safetensors: .*mis-shaped \[.t2d \(50,\) != \(64,\).\]"):
        export(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def good_draft(tmp_path):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "speculators_config": {"verifier": {"name_or_path": "t", "architectures": ["LlamaForCausalLM"]}},
        "draft_vocab_size": 128, "target_hidden_size": 128, "eagle_aux_hidden_state_layer_ids": TINY_AUX,
        "transformer_layer_config": {"hidden_size": 128, "vocab_size": 512}}))
    save_file({"t2d": torch.ones(512, dtype=torch.bool)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("edit, match", [
    ({"speculators_config": {"verifier": {"name_or_path": "q", "architectures": ["Qwen3ForCausalLM"]}}},
     r"verifier 'q' is \['Qwen3ForCausalLM'\], target is \['LlamaForCausalLM'\]"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}, r"aux layer ids \[1, 3, 9\] out of range for 6 target layers"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3]}, r"needs exactly 3"),
    ({"draft_vocab_size": 1024}, r"draft_vocab_size 1024 > target vocab 512"),
    ({"target_hidden_size": 576}, r"target_hidden_size 576 != target 128"),
])
def test_draft_that_does_not_fit_the_target_is_refused(good_draft, tiny_target, edit, match):
    check_draft_matches_target(good_draft, tiny_target)  # the unedited draft fits
    cfg = json.loads((good_draft / "config.json").read_text())
    (good_draft / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(DraftMismatchError, match=match):
        check_draft_matches_target(good_draft, tiny_target)


def test_draft_whose_t2d_covers_another_vocab_is_refused(good_draft, tiny_target):
    save_file({"t2d": torch.ones(640, dtype=torch.bool)}, str(good_draft / "model.safetensors"))
    with pytest.raises(DraftMismatchError, match="t2d covers 640 target ids, target vocab is 512"):
        check_draft_matches_target(good_draft, tiny_target)

