"""Shard integrity: checksums and sizes recorded at write time (hashed in memory, no re-read);
a cheap size/header check at every open; the full hash only with ``verify="full"`` /
``--verify-shards`` / ``draftsmith verify``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith import cli
from draftsmith.data_prep import shards as shards_mod
from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import ShardSpec
from draftsmith.fileio import ShardError
from draftsmith.target import load_target
from draftsmith.train.data import HiddenStateDataset

TINY_AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def shard_dir(tiny_target, tmp_path_factory) -> Path:
    model, _ = load_target(tiny_target)
    g = torch.Generator().manual_seed(0)
    records = [{"id": f"s{i}", "input_ids": torch.randint(0, 512, (12,), generator=g).tolist(),
                "loss_mask": [0] * 4 + [1] * 8} for i in range(6)]
    out = tmp_path_factory.mktemp("run") / "data" / "hidden_states"
    generate_hidden_states(model, records, out, ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16"),
                           sequences_per_shard=2, progress=False)
    return out


def copy_run(shard_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run (``RUN/data/hidden_states``); returns RUN."""
    run = tmp_path / "run"
    shutil.copytree(shard_dir, run / "data" / "hidden_states")
    return run


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def header_len(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def test_manifest_records_sha256_and_bytes_that_match_the_files(shard_dir):
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert len(manifest["shards"]) == 3
    for s in manifest["shards"]:
        data = (shard_dir / s["file"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
    assert len(HiddenStateDataset(shard_dir, verify="full")) == 6


def test_opening_reads_no_tensor_data_by_default(shard_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(shards_mod, "file_sha256", lambda p: calls.append(p) or "x")
    monkeypatch.setattr(shards_mod.hashlib, "sha256", lambda *a: calls.append(a) or hashlib.sha256(*a))
    ds = HiddenStateDataset(shard_dir)
    assert len(ds) == 6 and calls == []
    with pytest.raises(ShardError, match="checksum mismatch"):  # the (patched) hash runs only when asked
        HiddenStateDataset(shard_dir, verify="full")
    assert calls


def test_truncated_shard_is_caught_at_default_open_naming_the_file(shard_dir, tmp_path):
    run = copy_run(shard_dir, tmp_path)
    shard = run / "data" / "hidden_states" / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ShardError, match=r"shard-00002.safetensors: size \d+ bytes, manifest says \d+"):
        HiddenStateDataset(run / "data" / "hidden_states")


@pytest.mark.parametrize("where", ["length", "json"])
def test_flipped_header_byte_is_caught_at_default_open_naming_the_file(shard_dir, tmp_path, where):
    run = copy_run(shard_dir, tmp_path)
    shard = run / "data" / "hidden_states" / "shard-00001.safetensors"
    n = header_len(shard)
    flip(shard, 1 if where == "length" else 8 + n // 2)
    with pytest.raises(ShardError, match="shard-00001.safetensors: "):
        HiddenStateDataset(run / "data" / "hidden_states")


def test_header_check_names_a_shape_that_differs(shard_dir, tmp_path):
    run = copy_run(shard_dir, tmp_path)
    d = run / "data" / "hidden_states"
    shard = d / "shard-00000.safetensors"
    data = shard.read_bytes()
    n = header_len(shard)
    header = data[8:8 + n].replace(b'"input_ids":{"dtype":"I32","shape":[24]', b'"input_ids":{"dtype":"I32","shape":[42]')
    assert header != data[8:8 + n]
    shard.write_bytes(data[:8] + header + data[8 + n:])
    with pytest.raises(ShardError, match=r"shard-00000.safetensors: .*input_ids"):
        HiddenStateDataset(d)


def test_flipped_data_byte_passes_the_header_check_but_not_the_full_hash(shard_dir, tmp_path, capsys):
    run = copy_run(shard_dir, tmp_path)
    d = run / "data" / "hidden_states"
    flip(d / "shard-00001.safetensors", -10)
    assert len(HiddenStateDataset(d)) == 6  # default: size and header only
    with pytest.raises(ShardError, match="shard-00001.safetensors: checksum mismatch"):
        HiddenStateDataset(d, verify="full")
    assert cli.main(["verify", str(run), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["shards"] == 3 and summary["bad_files"] == ["shard-00001.safetensors"]
    assert "shard-00001.safetensors: checksum mismatch" in err


def test_verify_command_passes_a_clean_run(shard_dir, tmp_path, capsys):
    run = copy_run(shard_dir, tmp_path)
    assert cli.main(["verify", str(run), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    d = run / "data" / "hidden_states"
    assert summary["ok"] and summary["shards"] == 3 and summary["bad_files"] == []
    assert summary["bytes"] == sum(p.stat().st_size for p in d.glob("shard-*.safetensors"))
    assert cli.main(["verify", str(tmp_path / "nothing"), "--no-progress"]) == 1


def test_manifest_without_bytes_falls_back_to_the_header_check(shard_dir, tmp_path):
    run = copy_run(shard_dir, tmp_path)
    d = run / "data" / "hidden_states"
    manifest = json.loads((d / "manifest.json").read_text())
    for s in manifest["shards"]:
        del s["bytes"]
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert len(HiddenStateDataset(d)) == 6
    shard = d / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ShardError, match="shard-00000.safetensors: unreadable shard"):
        HiddenStateDataset(d)


def test_training_takes_verify_shards_and_passes_full_to_the_dataset(shard_dir, monkeypatch):
    from draftsmith.cli.train import build_parser
    from draftsmith.train import method_base

    args = build_parser("train").parse_args(["recipe.yaml", "--verify-shards"])
    assert args.verify_shards
    assert not build_parser("train").parse_args(["recipe.yaml"]).verify_shards
    seen = []
    monkeypatch.setattr(method_base, "HiddenStateDataset", lambda *a, **k: seen.append(k["verify"]))
    method = method_base.TargetDataMethod.__new__(method_base.TargetDataMethod)
    method.recipe = type("R", (), {"data": type("D", (), {"hidden_states_mode": "offline", "max_length": 8})()})()
    method.paths = type("P", (), {"hidden_states": shard_dir})()
    method.dataset()
    method.verify_shards = "full"
    method.dataset()
    assert seen == ["header", "full"]
