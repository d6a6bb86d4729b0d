"""Aux hidden-state capture (vLLM layer convention) and the shard store."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.target.capture import capture_batch
from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import ShardSpec
from draftsmith.fileio import ShardError
from draftsmith.train.data import HiddenStateDataset, collate
from draftsmith.train.validation import dataset_ids
from draftsmith.target import default_aux_layer_ids, load_target, validate_aux_layer_ids

from helpers.tiny import TINY_AUX, TINY_LAYERS, make_records


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_target(tiny_target)


def test_captured_aux_states_equal_hf_hidden_states_at_layer_ids(tiny):
    model, _ = tiny
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    att = torch.ones_like(ids)
    aux, final = capture_batch(model, ids, att, TINY_AUX)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    H = model.config.hidden_size
    for i, L in enumerate(TINY_AUX):
        torch.testing.assert_close(aux[..., i * H : (i + 1) * H], ref.hidden_states[L])
    # HF's last entry is after the final norm: that is the "final" state the loss uses.
    torch.testing.assert_close(final, ref.hidden_states[TINY_LAYERS])
    torch.testing.assert_close(final @ model.lm_head.weight.T, ref.logits)


def test_layer_id_convention_and_validation():
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layer_ids(36) == [2, 18, 33]  # gpt-oss-120b
    with pytest.raises(ValueError, match="out of range"):
        validate_aux_layer_ids([2, 15, 30], 30)
    with pytest.raises(ValueError, match="exactly 3"):
        validate_aux_layer_ids([2, 15], 30)
    assert validate_aux_layer_ids([27, 2, 15], 30) == [2, 15, 27]


def test_shards_round_trip_per_sequence(tiny, tmp_path):
    model, _ = tiny
    records = make_records(7, model.config.vocab_size)
    spec = ShardSpec(model.config.hidden_size, TINY_AUX, "float32")
    manifest = generate_hidden_states(model, records, tmp_path, spec, sequences_per_shard=3, batch_tokens=40,
                                      progress=False)
    assert len(manifest["shards"]) == 3
    assert manifest["num_tokens"] == sum(len(r["input_ids"]) for r in records)
    ds = HiddenStateDataset(tmp_path)
    assert len(ds) == 7
    stored = dataset_ids(ds)  # within a shard, in the order the engine yielded them (by length here)
    assert [sorted(s["ids"]) for s in manifest["shards"]] == [[r["id"] for r in records[i:i + 3]] for i in (0, 3, 6)]
    for i in (0, 4, 6):
        item = ds[stored.index(records[i]["id"])]
        ids = torch.tensor([records[i]["input_ids"]])
        aux, final = capture_batch(model, ids, torch.ones_like(ids), TINY_AUX)
        assert item["input_ids"].tolist() == records[i]["input_ids"]
        assert item["loss_mask"].tolist() == records[i]["loss_mask"]
        torch.testing.assert_close(item["aux_hidden_states"], aux[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(item["final_hidden_states"], final[0], rtol=1e-4, atol=1e-4)
    batch = collate([ds[0], ds[1]])
    assert batch["attention_mask"].sum().item() == sum(ds.lengths()[:2])


def test_rerun_computes_only_missing_shards(tiny, tmp_path):
    model, _ = tiny
    records = make_records(6, model.config.vocab_size, seed=1)
    spec = ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16")
    generate_hidden_states(model, records, tmp_path, spec, sequences_per_shard=2, progress=False)
    kept = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard-*")}
    (tmp_path / "shard-00001.safetensors").unlink()
    m = generate_hidden_states(model, records, tmp_path, spec, sequences_per_shard=2, progress=False)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == kept["shard-00000.safetensors"]
    assert (tmp_path / "shard-00002.safetensors").stat().st_mtime_ns == kept["shard-00002.safetensors"]
    assert m["num_tokens"] == sum(len(r["input_ids"]) for r in records)
    assert sorted(x for s in m["shards"] for x in s["ids"]) == [r["id"] for r in records]  # no gap, no duplicate


def test_corrupt_shard_and_mismatched_spec_are_refused(tiny, tmp_path):
    model, _ = tiny
    records = make_records(4, model.config.vocab_size, seed=2)
    spec = ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16")
    generate_hidden_states(model, records, tmp_path, spec, sequences_per_shard=2, progress=False)
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    HiddenStateDataset(tmp_path)  # a flipped byte in tensor data: only the full hash sees it
    with pytest.raises(ShardError, match="checksum mismatch"):
        HiddenStateDataset(tmp_path, verify="full")
    with pytest.raises(ShardError, match="aux_layer_ids"):
        generate_hidden_states(model, records, tmp_path, ShardSpec(model.config.hidden_size, [0, 1, 2], "bfloat16"),
                               sequences_per_shard=2, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="did not finish"):
        HiddenStateDataset(tmp_path, verify=False)
