"""The headline command as a new user runs it: ``train/eagle3.py RECIPE.yaml`` with no other flag
prepares what data is missing into ``runs/<recipe name>`` and trains; a rerun refuses to mix
into an earlier run; trackers log into the run directory; retention keeps the new checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.recipe import dump_recipe
from draftsmith.train.checkpoint import find_checkpoints

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

REPO = Path(__file__).resolve().parents[2]


def write_recipe(tiny_target: Path, where: Path, name: str = "tiny", **train) -> Path:
    prompts = write_jsonl(where / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=2, **train)
    recipe.name = name
    path = where / f"{name}.yaml"
    dump_recipe(recipe, path)
    return path


def train(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train" / "eagle3.py"), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.integration
def test_recipe_alone_prepares_into_runs_recipe_name_then_trains(tiny_target, tmp_path):
    recipe = write_recipe(tiny_target, tmp_path)
    done = train(tmp_path, recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    for f in ("target.json", "tokenized/state.json", "vocab.safetensors", "hidden_states/manifest.json"):
        assert (run / "data" / f).is_file(), f
    assert json.loads(done.stdout[done.stdout.index("{"):])["run_dir"] == "runs/tiny"
    assert [c.name for c in find_checkpoints(run / "checkpoints")] == ["step-2"]

    # a second run into the same directory would mix two runs: refused, nothing touched
    before = (run / "metrics.jsonl").read_text()
    again = train(tmp_path, recipe)
    assert again.returncode == 2
    assert "already holds a training run" in again.stderr and "--resume" in again.stderr and "--overwrite" in again.stderr
    assert (run / "metrics.jsonl").read_text() == before

    # --overwrite starts over and keeps the prepared data
    manifest = (run / "data" / "hidden_states" / "manifest.json").stat().st_mtime_ns
    over = train(tmp_path, recipe, "--overwrite", "--set", "train.max_steps=1")
    assert over.returncode == 0, over.stderr[-3000:]
    assert [c.name for c in find_checkpoints(run / "checkpoints")] == ["step-1"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run / "data" / "hidden_states" / "manifest.json").stat().st_mtime_ns == manifest


@pytest.mark.integration
def test_no_prepare_names_the_prepare_command_in_one_line(tiny_target, tmp_path):
    recipe = write_recipe(tiny_target, tmp_path)
    done = train(tmp_path, recipe, "--no-prepare")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert f"run: draftsmith prepare {recipe} --run-dir runs/tiny" in line
    assert "stages missing: target, regenerate, tokenize, vocab, hidden-states" in line
    assert not (tmp_path / "runs" / "tiny" / "data" / "target.json").exists()


@pytest.mark.integration
def test_wandb_offline_and_tensorboard_write_their_runs_into_the_run_dir(tiny_target, tmp_path):
    pytest.importorskip("wandb")  # in the test install (pyproject extras); the error path is tested below
    pytest.importorskip("tensorboard")
    recipe = write_recipe(tiny_target, tmp_path, report_to="[wandb, tensorboard]", run_name="probe")
    done = train(tmp_path, recipe, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    logs = tmp_path / "runs" / "tiny" / "logs"
    runs = list((logs / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(logs.rglob("*"))
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())
    assert list((logs / "draftsmith").glob("events.out.tfevents.*")), list(logs.rglob("*"))


@pytest.mark.integration
def test_two_processes_on_a_fresh_run_dir_prepare_once_and_capture_by_rank(tiny_target, tmp_path):
    # rank 0 regenerates / tokenises / builds the vocab while rank 1 waits; both capture shards
    recipe = write_recipe(tiny_target, tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29810",
           str(REPO / "train" / "eagle3.py"), str(recipe), "--set", "train.batch_size=2"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    data = tmp_path / "runs" / "tiny" / "data"
    parts = sorted(p.name for p in (data / "hidden_states").glob("manifest.rank-*.json"))
    assert parts == ["manifest.rank-00000-of-00002.json", "manifest.rank-00001-of-00002.json"]
    shards = json.loads((data / "hidden_states" / "manifest.json").read_text())["shards"]
    assert sorted(s["index"] for s in shards) == list(range(len(shards))) and len(shards) >= 2
    assert len((data / "regen.jsonl").read_text().splitlines()) == len(PROMPTS)  # one writer
    assert [c.name for c in find_checkpoints(tmp_path / "runs" / "tiny" / "checkpoints")] == ["step-2"]
