"""The streaming shard writer: shards cut by bytes, sequences stored as the engine yields them,
bounded host memory, writer-thread errors, and a full disk (shards, manifest, checkpoints)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import fileio
from draftsmith.data_prep import shards as shards_mod
from draftsmith.target.capture import LazyCapture
from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import (ShardReader, ShardSpec, bytes_per_token, load_manifest, read_safetensors_header,
                                         shard_bounds, verify_shards)
from draftsmith.data_prep.state_codec import encode_states
from draftsmith.fileio import DiskFullError, ShardError, atomic_write_bytes
from draftsmith.train.checkpoint import CheckpointError, CheckpointManager, TrainState, find_checkpoints

H = 16


class Engine:
    """Deterministic states per record id, yielded in reverse order (engines may reorder);
    counts records and ``close()`` calls."""

    name = "fake"

    def __init__(self):
        self.records, self.closed = 0, 0

    def capture(self, records):
        for j in reversed(range(len(records))):
            self.records += 1
            g = torch.Generator().manual_seed(int(records[j]["id"]))
            n = len(records[j]["input_ids"])
            yield j, torch.randn(n, 3 * H, generator=g), torch.randn(n, H, generator=g)

    def close(self):
        self.closed += 1


def records(lengths):
    return [{"id": str(i), "input_ids": list(range(i, i + n)), "loss_mask": [i % 2] * n} for i, n in enumerate(lengths)]


LENGTHS = [5, 9, 3, 7, 8, 2, 6, 4]
BPT = bytes_per_token(H, "bfloat16")  # 4 * 16 * 2 + 4 + 1


def test_shard_bounds_fill_greedily_by_bytes_and_count():
    assert BPT == 133 and bytes_per_token(H, "float8_e4m3fn") == 4 * H + 16 + 5
    # 12 tokens a shard at most: 5 | 9,3 | 7 | 8,2 | 6,4
    assert shard_bounds(LENGTHS, 100, 12 * BPT, BPT) == [0, 1, 3, 4, 6, 8]
    assert shard_bounds(LENGTHS, 1, 12 * BPT, BPT) == list(range(9))  # the count caps too
    assert shard_bounds(LENGTHS, 3) == [0, 3, 6, 8]  # no shard_bytes: the count alone
    with pytest.raises(ValueError, match=rf"data.shard_bytes=100 .*longest record \(9 tokens .* = {9 * BPT} bytes"):
        shard_bounds(LENGTHS, 100, 100, BPT)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_shards_hold_the_engines_order_and_read_back_like_encode_states(dtype, tmp_path):
    engine = Engine()
    recs = records(LENGTHS)
    spec = ShardSpec(H, [0, 1, 2], dtype)
    m = generate_hidden_states(engine, recs, tmp_path, spec, sequences_per_shard=100,
                               shard_bytes=12 * bytes_per_token(H, dtype), progress=False)
    assert engine.closed == 1
    assert m["num_shards"] == len(m["shards"]) == 5 and m["shard_bytes"] == 12 * bytes_per_token(H, dtype)
    assert [s["ids"] for s in m["shards"]] == [["0"], ["2", "1"], ["3"], ["5", "4"], ["7", "6"]]  # engine order
    for s in m["shards"]:
        path = tmp_path / s["file"]
        tensors, _ = read_safetensors_header(path)
        assert min(tensors.items(), key=lambda kv: kv[1]["data_offsets"][0])[0] == "aux_hidden_states"
        with safe_open(str(path), framework="pt") as fh:
            got = {k: fh.get_tensor(k) for k in fh.keys()}
        parts = [recs[int(i)] for i in s["ids"]]
        aux, final = zip(*[next((a, f) for j, a, f in Engine().capture([r])) for r in parts])
        want = encode_states(torch.cat(aux), torch.cat(final), dtype)
        want["input_ids"] = torch.tensor([t for r in parts for t in r["input_ids"]], dtype=torch.int32)
        want["loss_mask"] = torch.tensor([t for r in parts for t in r["loss_mask"]], dtype=torch.uint8)
        want["offsets"] = torch.tensor([0] + [len(r["input_ids"]) for r in parts]).cumsum(0)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    ds = ShardReader(tmp_path, verify="full")
    ids = [i for s in m["shards"] for i in s["ids"]]
    assert [ds[k]["input_ids"].tolist() for k in range(len(ds))] == [recs[int(i)]["input_ids"] for i in ids]
    assert verify_shards(tmp_path, progress=False)["bad"] == []


def test_ranks_cut_the_same_shards_and_another_shard_size_is_refused(tmp_path):
    spec = ShardSpec(H, [0, 1, 2], "bfloat16")
    kw = dict(sequences_per_shard=100, shard_bytes=12 * BPT, progress=False)
    for rank in (1, 0):
        m = generate_hidden_states(Engine(), records(LENGTHS), tmp_path / "two", spec, rank=rank, world_size=2, **kw)
    one = generate_hidden_states(Engine(), records(LENGTHS), tmp_path / "one", spec, **kw)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in one["shards"]]
    assert len(ShardReader(tmp_path / "two")) == len(LENGTHS)
    engine = Engine()
    with pytest.raises(ShardError, match="shard_bytes=1596, this run wants 2660"):
        generate_hidden_states(engine, records(LENGTHS), tmp_path / "one", spec, sequences_per_shard=100,
                               shard_bytes=20 * BPT, progress=False)
    with pytest.raises(ValueError, match="data.shard_bytes"):
        generate_hidden_states(engine, records(LENGTHS), tmp_path / "three", spec, sequences_per_shard=100,
                               shard_bytes=8 * BPT, progress=False)
    assert engine.records == 0 and not (tmp_path / "three").exists()  # refused before any capture


def test_a_writer_thread_error_surfaces_removes_the_temp_file_and_closes_the_engine(tmp_path, monkeypatch):
    add = shards_mod.ShardWriter.add
    calls = []

    def fail_on_the_third(self, *a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected writer failure")
        add(self, *a)

    monkeypatch.setattr(shards_mod.ShardWriter, "add", fail_on_the_third)
    built = []
    lazy = LazyCapture("fake", lambda: built.append(Engine()) or built[-1])
    with pytest.raises(RuntimeError, match="injected writer failure"):
        generate_hidden_states(lazy, records(LENGTHS), tmp_path, ShardSpec(H, [0, 1, 2], "bfloat16"),
                               sequences_per_shard=2, progress=False)
    assert built[0].closed == 1 and built[0].records < len(LENGTHS)  # stopped early, closed once
    lazy.close()  # idempotent
    assert built[0].closed == 1
    assert [s["index"] for s in load_manifest(tmp_path)["shards"]] == [0]
    assert not list(tmp_path.glob(".*tmp*"))


def full_disk_after(monkeypatch, directory: Path, first_failing: str):
    """``os.write`` raises ENOSPC for temp files in ``directory`` named ``first_failing`` or later."""
    write = os.write

    def write_or_enospc(fd, data):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == str(directory) and name >= first_failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(os, "write", write_or_enospc)


def test_full_disk_mid_capture_keeps_finished_shards_and_a_rerun_completes_identically(tmp_path, monkeypatch):
    spec = ShardSpec(H, [0, 1, 2], "bfloat16")
    kw = dict(sequences_per_shard=2, progress=False)
    ref = generate_hidden_states(Engine(), records(LENGTHS), tmp_path / "ref", spec, **kw)
    run = tmp_path / "run"
    with monkeypatch.context() as mp:
        full_disk_after(mp, run, ".shard-00001")
        with pytest.raises(DiskFullError) as info:
            generate_hidden_states(Engine(), records(LENGTHS), run, spec, **kw)
    msg = str(info.value)
    assert "\n" not in msg and str(run / "shard-00001.safetensors") in msg
    assert f"needs {ref['shards'][1]['bytes']} bytes" in msg
    assert not list(run.glob(".*tmp*"))  # the partial shard is gone
    m = load_manifest(run)
    assert [s["index"] for s in m["shards"]] == [0] and m["shards"][0]["sha256"] == ref["shards"][0]["sha256"]
    assert shards_mod.file_sha256(run / "shard-00000.safetensors") == ref["shards"][0]["sha256"]
    rerun = generate_hidden_states(Engine(), records(LENGTHS), run, spec, **kw)
    assert [s["sha256"] for s in rerun["shards"]] == [s["sha256"] for s in ref["shards"]]
    for s in ref["shards"]:
        assert (run / s["file"]).read_bytes() == (tmp_path / "ref" / s["file"]).read_bytes()


def test_full_disk_on_the_manifest_leaves_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    atomic_write_bytes(path, b"old")
    full_disk_after(monkeypatch, tmp_path, ".manifest")
    with pytest.raises(DiskFullError, match=rf"^{path}: disk full: the file needs 9 bytes"):
        atomic_write_bytes(path, b"new bytes")
    assert path.read_bytes() == b"old" and not list(tmp_path.glob(".*tmp*"))


def test_too_little_free_space_is_refused_before_the_shard_is_captured(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda p: type("U", (), {"free": 100})())
    engine = Engine()
    with pytest.raises(DiskFullError, match=r"shard 0 \(2 sequences\) needs \d+ bytes but the disk has 100 free"):
        generate_hidden_states(engine, records(LENGTHS), tmp_path, ShardSpec(H, [0, 1, 2], "bfloat16"),
                               sequences_per_shard=2, progress=False)
    assert engine.records == 0 and engine.closed == 1


def test_full_disk_during_a_checkpoint_save_removes_it_and_keeps_the_previous(tmp_path, monkeypatch):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = tmp_path / "checkpoints"
    manager = CheckpointManager(acc, ckpt, keep=2, extras=lambda d: None)
    first = manager.save(model, TrainState(step=1))
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as mp:
        mp.setattr(torch, "save", no_space)
        with pytest.raises(CheckpointError) as info:
            manager.save(model, TrainState(step=2))
    msg = str(info.value)
    size = sum(len(b) for b in before.values())
    assert "\n" not in msg and msg.startswith(f"{ckpt / 'step-2'}: disk full") and f"about {size} bytes" in msg
    assert not (ckpt / ".tmp-step-2").exists() and find_checkpoints(ckpt) == [first]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert manager.save(model, TrainState(step=2)) in find_checkpoints(ckpt)


@pytest.mark.parametrize("depth", [0, 2])
def test_write_behind_runs_in_order_and_hands_the_first_error_to_the_submitter(depth):
    """depth 0 (CPU: inline) and depth 2 (accelerator: a writer thread) behave alike."""
    from draftsmith.data_prep.hidden_states import _WriteBehind

    done: list[int] = []

    def job(i: int) -> None:
        if i == 3:
            raise OSError("boom")
        done.append(i)

    behind = _WriteBehind(depth)
    with pytest.raises(OSError, match="boom"):
        for i in range(50):
            behind.submit(job, i)
        behind.close()
    behind.close(raise_error=False)
    assert done == [0, 1, 2]  # in order, and nothing after the failing call
