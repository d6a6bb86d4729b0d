"""``draft.aux_noise_std`` on the tiny target's prepared EAGLE-3 run: the training loss sees the
noise, validation (and so checkpoints/best, export and evaluation, which read the clean states)
does not, and the default leaves a training run exactly as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftsmith.train.data import BatchCollator, collate
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit

pytestmark = pytest.mark.integration


def _recipe(recipe, std: float):
    r = recipe.model_copy(deep=True)
    r.draft.aux_noise_std = std
    return r


def test_noise_changes_the_training_loss_and_not_validation(prepared):
    recipe, run, _ = prepared
    clean, noisy = Eagle3Method(_recipe(recipe, 0.0), run), Eagle3Method(_recipe(recipe, 0.5), run)
    torch.manual_seed(0)
    model = clean.build_model()
    dataset = clean.dataset()
    batch = BatchCollator(collate, clean.batch_plan())([dataset[i] for i in range(4)])
    torch.manual_seed(1)
    loss_clean, _ = clean.compute_loss(model, batch)
    torch.manual_seed(1)
    assert torch.equal(clean.compute_loss(model, batch)[0], loss_clean)  # off: deterministic, no noise
    loss_noisy, _ = noisy.compute_loss(model, batch)
    assert torch.isfinite(loss_noisy) and loss_noisy.item() != loss_clean.item()
    want = clean.validation_sums(model, batch)
    got = noisy.validation_sums(model, batch)
    assert got.keys() == want.keys()
    for k in want:
        same = torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
        assert same, k


def test_zero_noise_trains_exactly_like_a_recipe_without_the_key(prepared, tmp_path):
    recipe, run, _ = prepared
    curves = []
    for name, r in (("default", recipe.model_copy(deep=True)), ("zero", _recipe(recipe, 0.0)), ("on", _recipe(recipe, 0.5))):
        r.train.max_steps = 4
        root = tmp_path / name
        root.mkdir()
        shutil.copytree(run / "data", root / "data")
        fit(r, Eagle3Method(r, root), root, progress=False)
        curves.append([json.loads(line)["loss"] for line in (root / "metrics.jsonl").read_text().splitlines()
                       if "loss" in json.loads(line)])
    default, zero, on = curves
    assert default and zero == default
    assert on != default
