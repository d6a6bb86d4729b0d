"""Validation during training on the tiny target: the best checkpoint is kept and exported, early
stopping follows the best metric, and a validation fraction without conversations fails first."""

from __future__ import annotations

import json
import shutil

import pytest

from draftsmith.eval.export import export
from draftsmith.recipe import Recipe
from draftsmith.train import trainer as trainer_module
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit
from draftsmith.train.validation import ValidationSplitError


def _val_recipe(recipe: Recipe, **train) -> Recipe:
    r = recipe.model_copy(deep=True)
    r.data.validation_fraction = 0.25
    for k, v in train.items():
        setattr(r.train, k, v)
    return r


def _copy_run(run, tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(run / "data", root / "data")
    return root


@pytest.mark.integration
def test_training_validates_keeps_the_best_and_exports_it(prepared, tmp_path):
    recipe, run, _ = prepared
    recipe = _val_recipe(recipe, max_steps=12, eval_every=4)
    root = _copy_run(run, tmp_path)
    fit(recipe, Eagle3Method(recipe, root), root, progress=False)
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if "val_loss" in x]
    assert [x["step"] for x in val] == [4, 8, 12]
    for x in val:
        assert 1.0 <= x["val_sim_al"] <= 1.0 + recipe.eval.num_speculative_tokens
        assert x["val_chains"] > 0 and 0 <= x["val_acc_0"] <= 1 and x["val_loss"] > 0
        rates = [x[f"val_sim_rate_{k}"] for k in range(recipe.eval.num_speculative_tokens)]
        assert rates == sorted(rates, reverse=True)  # a chain can only stop
    best = json.loads((root / "checkpoints" / "best" / "best.json").read_text())
    assert best["best_value"] == max(x["val_sim_al"] for x in val)
    assert best["step"] == next(x["step"] for x in val if x["val_sim_al"] == best["best_value"])
    out = export(root / "checkpoints" / "best", tmp_path / "export")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    state = json.loads((find_checkpoints(root / "checkpoints")[-1] / "train_state.json").read_text())
    assert state["best_step"] == best["step"]


@pytest.mark.integration
def test_early_stopping_follows_the_best_metric(prepared, tmp_path, monkeypatch):
    recipe, run, _ = prepared
    recipe = _val_recipe(recipe, max_steps=40, eval_every=2, early_stopping_patience=2)
    scores = iter([1.10, 1.30, 1.20, 1.25, 1.40, 1.50])

    def scripted(method, model, batches, accelerator):
        list(batches)
        return {"val_loss": 1.0, "val_sim_al": next(scores)}

    monkeypatch.setattr(trainer_module, "run_validation", scripted)
    root = _copy_run(run, tmp_path)
    result = fit(recipe, Eagle3Method(recipe, root), root, progress=False)
    assert result.steps == 8  # best 1.30 at step 4, then 1.20 and 1.25: two without a better one
    best = json.loads((root / "checkpoints" / "best" / "best.json").read_text())
    assert (best["step"], best["best_value"]) == (4, 1.30)


@pytest.mark.integration
def test_a_fraction_without_validation_conversations_fails_before_training(prepared, tmp_path):
    recipe, run, _ = prepared
    recipe = _val_recipe(recipe, max_steps=5)
    recipe.data.validation_fraction = 0.01  # of 16 sequences
    root = _copy_run(run, tmp_path)
    with pytest.raises(ValidationSplitError, match="no validation"):
        fit(recipe, Eagle3Method(recipe, root), root, progress=False)
    assert not find_checkpoints(root / "checkpoints")
