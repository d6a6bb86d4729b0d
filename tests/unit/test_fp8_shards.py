"""Row-scaled fp8 shard encoding: error bound, disk size, old shards, conversion; and shards
split across ranks without overlap."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import ShardReader, ShardSpec, shard_bytes_per_token
from draftsmith.data_prep.state_codec import decode_fp8, decode_states, encode_fp8
from draftsmith.train.data import HiddenStateDataset
from draftsmith.train.validation import dataset_ids
from draftsmith.target import load_target

from helpers.tiny import TINY_AUX
from helpers.tiny import make_records
from helpers.tiny import write_fp8_shards


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_target(tiny_target)


def test_fp8_round_trip_error_is_bounded_per_slice_even_with_massive_activations():
    torch.manual_seed(0)
    x = torch.randn(64, 3 * 32)
    x[:, 40] = 2.0e4  # one massive activation in the second aux layer (plain fp8 tops out at 448)
    x[:, :32] *= 1e-3  # a small-norm first layer must keep its own precision
    q, scale = encode_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3)
    y = decode_fp8(q, scale)
    for g in range(3):
        sl = slice(32 * g, 32 * (g + 1))
        rel = (y[:, sl] - x[:, sl]).norm(dim=-1) / x[:, sl].norm(dim=-1)
        assert rel.max() < 2 ** -4  # e4m3: 3 mantissa bits
    assert torch.equal(decode_fp8(*encode_fp8(torch.zeros(2, 6), 3)), torch.zeros(2, 6))


def test_fp8_shards_decode_close_to_fp32_capture_at_half_the_bf16_size(tiny, tmp_path):
    model, _ = tiny
    records = make_records(9, model.config.vocab_size, seed=3)
    H = model.config.hidden_size
    dirs = {}
    for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
        dirs[dtype] = tmp_path / dtype
        m = generate_hidden_states(model, records, dirs[dtype], ShardSpec(H, TINY_AUX, dtype),
                                   sequences_per_shard=4, progress=False)
    assert m["encoding"]["name"] == "fp8_e4m3_row_scaled"
    ref, fp8 = HiddenStateDataset(dirs["float32"]), HiddenStateDataset(dirs["float8_e4m3fn"])
    for i in range(len(records)):
        a, b = ref[i], fp8[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux_hidden_states", "final_hidden_states"):
            assert b[key].dtype == torch.float32
            rel = (b[key] - a[key]).norm(dim=-1) / a[key].norm(dim=-1)
            assert rel.max() < 2 ** -4, (i, key, rel.max())
    # per token: 4H fp8 bytes + 4 fp32 scales vs 4H bf16 values, plus shared ids/masks/headers
    ratio = shard_bytes_per_token(dirs["float8_e4m3fn"]) / shard_bytes_per_token(dirs["bfloat16"])
    assert 0.45 < ratio < 0.56, ratio


def test_bf16_shards_without_encoding_still_read_in_their_dtype(tiny, tmp_path):
    model, _ = tiny
    records = make_records(3, model.config.vocab_size, seed=4)
    generate_hidden_states(model, records, tmp_path, ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16"),
                           sequences_per_shard=2, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "encoding" not in manifest  # the layout written before fp8 existed
    ds = HiddenStateDataset(tmp_path)
    item = ds[dataset_ids(ds).index(records[1]["id"])]  # shards keep the engine's order
    assert item["aux_hidden_states"].dtype == torch.bfloat16
    assert item["aux_hidden_states"].shape == (len(records[1]["input_ids"]), 3 * model.config.hidden_size)


def test_rank_and_world_size_come_from_the_launcher_environment(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    records = make_records(4, model.config.vocab_size, seed=7)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    generate_hidden_states(model, records, tmp_path, ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16"),
                           sequences_per_shard=1, progress=False)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00001.safetensors", "shard-00003.safetensors"]
    assert (tmp_path / "manifest.rank-00001-of-00002.json").is_file()


# ------------------------------------------------------------------------------------------
# fp8 decoded on the device: the reader hands out the payload and scales, decode_states runs
# after the host-to-device copy and must give exactly what the CPU decode gives today.

@pytest.fixture(scope="module")
def fp8_shards(tiny, tmp_path_factory):
    return write_fp8_shards(tiny[0], tmp_path_factory.mktemp("fp8_device"))


def test_undecoded_items_carry_the_stored_fp8_payload_and_its_scales(fp8_shards):
    d, n, H = fp8_shards
    raw, decoded = ShardReader(d, decode_dtype=None), ShardReader(d)
    for i in range(n):
        r, ref = raw[i], decoded[i]
        T = ref["input_ids"].shape[0]
        assert set(r) == set(ref) | {"aux_hidden_states_scale", "final_hidden_states_scale"}
        assert r["aux_hidden_states"].dtype == r["final_hidden_states"].dtype == torch.float8_e4m3fn
        assert r["aux_hidden_states"].shape == (T, 3 * H) and r["aux_hidden_states_scale"].shape == (T, 3)
        assert r["final_hidden_states_scale"].shape == (T, 1) and r["final_hidden_states_scale"].dtype == torch.float32
        # one item decoded by hand is today's decode, bit for bit
        assert torch.equal(decode_states(dict(r))["aux_hidden_states"], ref["aux_hidden_states"])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_decoding_a_collated_batch_after_the_copy_equals_todays_cpu_decode_exactly(fp8_shards, packed):
    from draftsmith.train.data import collate
    from draftsmith.train.packing import collate_packed

    d, n, _ = fp8_shards
    raw, f32, bf16 = ShardReader(d, decode_dtype=None), ShardReader(d), ShardReader(d, decode_dtype=torch.bfloat16)
    if packed:  # two rows of documents (different total lengths: the second row is padded)
        rows = [[0, 1, 2], [3, 4]]
        make = lambda ds: collate_packed([[ds[i] for i in row] for row in rows])  # noqa: E731
    else:
        make = lambda ds: collate([ds[i] for i in range(n)])  # noqa: E731
    today, today_bf16 = make(f32), make(bf16)
    batch = make(raw)  # what the DataLoader would hand to the host-to-device copy
    assert batch["aux_hidden_states"].dtype == torch.float8_e4m3fn
    stored = sum(batch[k].numel() * batch[k].element_size() for k in batch if "hidden_states" in k)
    assert stored < 0.3 * sum(today[k].numel() * 4 for k in ("aux_hidden_states", "final_hidden_states"))
    out = decode_states(dict(batch), torch.float32)
    assert set(out) == set(today)
    for key in ("aux_hidden_states", "final_hidden_states"):
        assert out[key].dtype == torch.float32 and torch.equal(out[key], today[key]), key
        # padding decodes to the zeros collate pads the decoded states with
        pad = today["attention_mask"] == 0
        assert pad.any() and not out[key][pad].any()
        # decoding straight to bf16 = the fp32 decode rounded once = a bf16 reader's items
        b = decode_states(dict(batch), torch.bfloat16)[key]
        assert b.dtype == torch.bfloat16 and torch.equal(b, today[key].to(torch.bfloat16))
        assert torch.equal(b, today_bf16[key])
    for key in today:  # ids, masks, positions pass through untouched
        if "hidden_states" not in key:
            assert torch.equal(out[key], today[key]), key


def test_decode_states_leaves_plain_and_decoded_batches_alone(tiny, tmp_path):
    model, _ = tiny
    records = make_records(3, model.config.vocab_size, seed=9)
    generate_hidden_states(model, records, tmp_path, ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16"),
                           sequences_per_shard=2, progress=False)
    item = ShardReader(tmp_path, decode_dtype=None)[1]  # plain shards: no scales, storage dtype
    assert "aux_hidden_states_scale" not in item and item["aux_hidden_states"].dtype == torch.bfloat16
    before = {k: v.clone() for k, v in item.items()}
    out = decode_states(item)
    assert out is item and all(torch.equal(out[k], before[k]) for k in before)
    assert out["aux_hidden_states"].dtype == torch.bfloat16
    # a second call on an already decoded fp8 batch is a no-op too
    x = torch.randn(2, 5, 12)
    q, s = encode_fp8(x.reshape(10, 12), 3)
    once = decode_states({"aux_hidden_states": q.reshape(2, 5, 12), "aux_hidden_states_scale": s.reshape(2, 5, 3)})
    again = decode_states(dict(once))
    assert torch.equal(again["aux_hidden_states"], once["aux_hidden_states"]) and "aux_hidden_states_scale" not in again


def test_batched_decode_equals_per_sequence_decode_and_never_writes_its_input():
    torch.manual_seed(1)
    x = torch.randn(3, 7, 4 * 16) * torch.logspace(-3, 4, 4).repeat_interleave(16)
    q, s = encode_fp8(x.reshape(21, 64), 4)
    q_copy = q.clone()
    batched = decode_fp8(q.reshape(3, 7, 64), s.reshape(3, 7, 4))
    assert batched.shape == (3, 7, 64)
    assert torch.equal(batched.reshape(21, 64), decode_fp8(q, s))
    assert torch.equal(q.view(torch.uint8), q_copy.view(torch.uint8))
    # the reference formula the CPU decode has always used
    ref = (q.float().reshape(21, 4, 16) * s.float().unsqueeze(-1)).reshape(21, 64)
    assert torch.equal(decode_fp8(q, s), ref)
