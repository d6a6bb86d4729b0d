"""Faults during training: non-finite losses are skipped then stop the run; SIGTERM saves a
checkpoint that --resume continues from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipe import dump_recipe
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.components.nonfinite import NonFiniteLossError
from draftsmith.train.trainer import fit

pytestmark = pytest.mark.integration  # trains the tiny target end to end

REPO = Path(__file__).resolve().parents[2]


class NaNAt(Eagle3Method):
    """Eagle3 whose loss is NaN on the listed micro-batch calls (0-based)."""

    def __init__(self, recipe, run, bad_calls):
        super().__init__(recipe, run)
        self.bad_calls, self.calls = set(bad_calls), 0

    def compute_loss(self, model, batch):
        loss, metrics = super().compute_loss(model, batch)
        if self.calls in self.bad_calls:
            loss = loss * float("nan")
        self.calls += 1
        return loss, metrics


def copy_run(prepared, tmp_path):
    import shutil

    recipe, run, _ = prepared
    shutil.copytree(run / "data", tmp_path / "data")
    return recipe.model_copy(deep=True), tmp_path


def test_nonfinite_step_is_skipped_and_counted(prepared, tmp_path):
    recipe, run = copy_run(prepared, tmp_path)
    recipe.train.max_steps = 4
    fit(recipe, NaNAt(recipe, run, bad_calls=[1]), run, progress=False)
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["nonfinite_skipped"] == 1 and state["step"] == 4
    weights = load_file(str(ckpt / "model.safetensors"))
    bad = [k for k, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, f"non-finite values in {bad}: the skipped step leaked into the weights"


def test_run_stops_after_too_many_nonfinite_steps_in_a_row(prepared, tmp_path):
    recipe, run = copy_run(prepared, tmp_path)
    recipe.train.max_steps = 10
    recipe.train.max_nonfinite_steps = 3
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row"):
        fit(recipe, NaNAt(recipe, run, bad_calls=range(2, 100)), run, progress=False)


def test_a_failed_run_gives_the_signal_handlers_back(prepared, tmp_path):
    def mine(signum, frame):
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        recipe, run = copy_run(prepared, tmp_path)
        recipe.train.max_steps = 10
        recipe.train.max_nonfinite_steps = 2
        with pytest.raises(NonFiniteLossError):
            fit(recipe, NaNAt(recipe, run, bad_calls=range(0, 100)), run, progress=False)
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_sigterm_saves_a_checkpoint_and_resume_finishes(prepared, tmp_path):
    recipe, run = copy_run(prepared, tmp_path)
    recipe.train.max_steps = 400
    recipe_path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    cmd = [sys.executable, str(REPO / "train" / "eagle3.py"), str(recipe_path), "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    state = json.loads((ckpt / "train_state.json").read_text())
    assert 3 <= state["step"] < 400 and not state["finished"]

    recipe.train.max_steps = state["step"] + 2
    dump_recipe(recipe, recipe_path)
    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    final = json.loads((find_checkpoints(run / "checkpoints")[-1] / "train_state.json").read_text())
    assert final["step"] == state["step"] + 2 and final["finished"]
