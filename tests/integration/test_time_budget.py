"""train.max_time_minutes: training stops at the first step past the wall-time budget, with
warmup + cosine completed within it."""

from __future__ import annotations

import json
import shutil

import pytest

from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit


@pytest.mark.integration
def test_a_time_budget_stops_training_and_finishes_the_schedule(prepared, tmp_path):
    recipe, run, _ = prepared
    recipe = recipe.model_copy(deep=True)
    recipe.train.max_steps = 100_000
    recipe.train.max_time_minutes = 0.1  # 6 s
    recipe.train.warmup_ratio = 0.1
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(run / "data", root / "data")
    result = fit(recipe, Eagle3Method(recipe, root), root, progress=False)
    state = json.loads((find_checkpoints(root / "checkpoints")[-1] / "train_state.json").read_text())
    assert 1 < result.steps < 100_000 and state["step"] == result.steps and state["finished"]
    assert 6.0 <= state["train_seconds"] < 60.0
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == result.steps  # the last step is logged as the last
    assert lines[-1]["lr"] < 0.05 * recipe.train.lr  # the cosine has (nearly) reached its floor
    assert max(x["lr"] for x in lines) > 0.5 * recipe.train.lr
