"""The trainer trains on packed rows (several documents a row) of the tiny target's data."""

from __future__ import annotations

import json
import math

import pytest
from draftsmith.data_prep.prepare import prepare
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.packing import PackedDataset
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe


@pytest.mark.integration
def test_trainer_trains_on_packed_rows(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=3, packing=True, pack_tokens=192, batch_size=2)
    run = tmp_path / "run"
    prepare(recipe, run)
    method = Eagle3Method(recipe, run)
    rows = PackedDataset(method.dataset(), 192, recipe.seed)
    assert len(rows) < len(PROMPTS)  # sequences of <= 96 tokens share rows of 192
    result = fit(recipe, method, run, progress=False)
    assert result.steps == 3 and result.tokens > 0
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
