"""fp8 hidden-state shards from launched processes: the convert command line re-encodes bf16 shards
to fp8, and two ranks write disjoint shards whose union equals one process's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import ShardSpec, convert_shards
from draftsmith.train.data import HiddenStateDataset
from draftsmith.target import load_target

from helpers.tiny import TINY_AUX
from helpers.tiny import make_records


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_target(tiny_target)


@pytest.mark.integration
def test_convert_cli_reencodes_bf16_to_fp8_keeping_tokens_and_boundaries(tiny, tmp_path):
    model, _ = tiny
    records = make_records(5, model.config.vocab_size, seed=5)
    src, dst = tmp_path / "bf16", tmp_path / "fp8"
    generate_hidden_states(model, records, src, ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16"),
                           sequences_per_shard=2, progress=False)
    out = subprocess.run([sys.executable, "-m", "draftsmith.cli.hidden_states", "convert", str(src), str(dst)],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["dtype"] == "float8_e4m3fn"
    a, b = HiddenStateDataset(src), HiddenStateDataset(dst)
    assert [s["ids"] for s in a.manifest["shards"]] == [s["ids"] for s in b.manifest["shards"]]
    for i in range(len(records)):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
        rel = (b[i]["aux_hidden_states"] - a[i]["aux_hidden_states"].float()).norm(-1) / a[i]["aux_hidden_states"].float().norm(-1)
        assert rel.max() < 2 ** -4
    first = (dst / "shard-00000.safetensors").stat().st_mtime_ns
    convert_shards(src, dst, "float8_e4m3fn", progress=False)  # resumes: nothing rewritten
    assert (dst / "shard-00000.safetensors").stat().st_mtime_ns == first


@pytest.mark.integration
def test_two_ranks_write_disjoint_shards_whose_union_equals_one_process(tiny, tmp_path):
    model, _ = tiny
    records = make_records(11, model.config.vocab_size, seed=6)
    spec = ShardSpec(model.config.hidden_size, TINY_AUX, "bfloat16")
    single, split = tmp_path / "single", tmp_path / "split"
    generate_hidden_states(model, records, single, spec, sequences_per_shard=2, progress=False)
    m0 = generate_hidden_states(model, records, split, spec, sequences_per_shard=2, progress=False,
                                rank=0, world_size=2)
    rank0 = {p.name for p in split.glob("shard-*")}
    assert rank0 == {f"shard-{i:05d}.safetensors" for i in (0, 2, 4)}
    assert not (split / "manifest.json").exists()  # incomplete: rank 1 has not run
    with pytest.raises(Exception, match="did not finish"):
        HiddenStateDataset(split)
    assert len(m0["shards"]) == 3
    generate_hidden_states(model, records, split, spec, sequences_per_shard=2, progress=False,
                           rank=1, world_size=2)
    rank1 = {p.name for p in split.glob("shard-*")} - rank0
    assert rank1 == {f"shard-{i:05d}.safetensors" for i in (1, 3, 5)}
    for p in single.glob("shard-*"):
        assert (split / p.name).read_bytes() == p.read_bytes()
    merged = json.loads((split / "manifest.json").read_text())
    assert merged["shards"] == json.loads((single / "manifest.json").read_text())["shards"]
    a, b = HiddenStateDataset(single), HiddenStateDataset(split)
    assert len(a) == len(b) == 11
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(11))
