"""Rank-safe data preparation: ``torchrun --nproc-per-node 2 -m draftsmith.cli.prepare``
runs target / tokenize / vocab once (rank 0; the other rank waits) and captures the shards on
both ranks; the data equals a one-process run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.data_prep.shards import load_manifest
from draftsmith.layout import RunLayout, read_tokenized
from draftsmith.recipe import dump_recipe

from helpers.recipes import small_recipe

pytestmark = pytest.mark.integration  # torchrun launch of two prepare processes

REPO = Path(__file__).resolve().parents[2]

# draftsmith prepare's main with each early stage function counting its calls (one line per call and rank)
COUNTING_PREPARE = '''
import os, sys
from draftsmith.cli.prepare import main
from draftsmith.data_prep import prepare

counter = os.environ["STAGE_COUNTER"]
for name in ("stage_target", "stage_regenerate", "stage_tokenize", "stage_vocab"):
    def wrap(fn, name=name):
        def counted(*a, **k):
            with open(counter, "a") as fh:
                fh.write(f"{name} {os.environ.get('RANK', '0')}\\n")
            return fn(*a, **k)
        return counted
    setattr(prepare, name, wrap(getattr(prepare, name)))
sys.exit(main(sys.argv[1:]))
'''


def test_two_ranks_prepare_the_same_data_as_one_and_run_early_stages_once(tiny_target, tmp_path):
    recipe = small_recipe(tiny_target, tmp_path)
    recipe_path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    prepare(recipe, tmp_path / "one")

    script = tmp_path / "counting_prepare.py"
    script.write_text(COUNTING_PREPARE)
    counter = tmp_path / "calls.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGE_COUNTER": str(counter),
           "PYTHONPATH": os.pathsep.join([str(REPO.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29611",
           str(script), str(recipe_path), "--run-dir", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    calls = counter.read_text().split()
    pairs = sorted(zip(calls[::2], calls[1::2]))
    assert pairs == [("stage_regenerate", "0"), ("stage_target", "0"), ("stage_tokenize", "0"),
                     ("stage_vocab", "0")], pairs

    one, two = tmp_path / "one" / "data", tmp_path / "two" / "data"
    t1, t2 = (read_tokenized(RunLayout(r).data, None) for r in (tmp_path / "one", tmp_path / "two"))
    assert [dict(r) for r in t1] == [dict(r) for r in t2]
    for a, b in ((one / "vocab.safetensors", two / "vocab.safetensors"),):
        va, vb = load_file(str(a)), load_file(str(b))
        assert all(torch.equal(va[k], vb[k]) for k in va)
    m1, m2 = load_manifest(one / "hidden_states"), load_manifest(two / "hidden_states")
    assert (two / "hidden_states" / "manifest.json").is_file()
    assert [s["ids"] for s in m1["shards"]] == [s["ids"] for s in m2["shards"]]
    assert len(m2["shards"]) == 3
    for s in m1["shards"]:
        t1 = load_file(str(one / "hidden_states" / s["file"]))
        t2 = load_file(str(two / "hidden_states" / s["file"]))
        assert t1.keys() == t2.keys()
        for k in t1:
            torch.testing.assert_close(t1[k], t2[k], rtol=1e-5, atol=1e-5)
    assert json.loads((two / "summary.json").read_text())["hidden_states"]["tokens"] == m1["num_tokens"]

    # each rank's engine was built bound to its own device: torchrun sets no CUDA_VISIBLE_DEVICES,
    # prepare sets it per local rank before any engine (or vLLM) exists, and the engine's processes
    # inherit it
    records = [json.loads(f.read_text()) for f in sorted((two / "procs").glob("rank-*.json"))]
    assert sorted((r["rank"], r["CUDA_VISIBLE_DEVICES"]) for r in records) == [(0, "0"), (1, "1")]
    capture = sorted((r["rank"], e["CUDA_VISIBLE_DEVICES"]) for r in records for e in r["engines"]
                     if e["stage"] == "capture")
    assert capture == [(0, "0"), (1, "1")]
