"""Data selection on a prepared tiny run (``data.select``, docs/data.md "Data selection"):
``draftsmith prepare`` writes the scores at capture, ``train --dry-run --run-dir`` counts what the
selection keeps, and a run trains on the kept sequences only, with the same validation set."""

from __future__ import annotations

import math
import shutil

import pytest

from draftsmith.data_prep.scores import SCORES, read_scores, select_top, vocab_key
from draftsmith.layout import RunLayout, read_vocab
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train import trainer as trainer_module
from draftsmith.train.data import HiddenStateDataset
from draftsmith.train.trainer import fit
from draftsmith.train.validation import dataset_ids, split_by_conversation

pytestmark = pytest.mark.integration  # prepares and trains the tiny target's draft


def test_prepare_writes_the_scores_at_capture(prepared):
    _, run, _ = prepared
    paths = RunLayout(run).data
    scores = read_scores(paths.hidden_states, vocab_key(read_vocab(paths)[0]))
    assert scores is not None, "the hidden-states stage wrote no scores"
    n = len(HiddenStateDataset(paths.hidden_states))
    assert all(len(scores[name]) == n for name in SCORES)
    assert all(v is None or 0 <= v <= math.log(128) + 1e-4 for v in scores["entropy"])  # Vd = 128
    assert all(v is None or 0 < v <= 1 + 1e-6 for v in scores["flatness"])


def test_a_run_with_data_select_trains_on_the_kept_sequences(prepared, tmp_path, monkeypatch, capsys):
    from draftsmith.cli.train import main as train_main

    recipe, run, _ = prepared
    root = tmp_path / "run"
    shutil.copytree(run / "data", root / "data")
    recipe = recipe.model_copy(deep=True)
    recipe.data.validation_fraction = 0.25
    recipe.data.select = {"score": "entropy", "keep_fraction": 0.5}
    recipe.train.max_steps = 2
    paths = RunLayout(root).data
    reader = HiddenStateDataset(paths.hidden_states)
    train_idx, val_idx = split_by_conversation(dataset_ids(reader), 0.25, recipe.seed)
    entropy = read_scores(paths.hidden_states, vocab_key(read_vocab(paths)[0]))["entropy"]
    want = select_top(train_idx, entropy, 0.5)

    seen: dict[str, list[int]] = {}
    build = trainer_module.Trainer._build_data

    def spy(self):
        build(self)
        seen["train"] = list(self.loader.dataset.indices)
        seen["val"] = list(self.val_set.indices)

    monkeypatch.setattr(trainer_module.Trainer, "_build_data", spy)
    fit(recipe, Eagle3Method(recipe, root), root, progress=False)
    assert seen == {"train": want, "val": val_idx}

    from draftsmith.recipe import dump_recipe

    dump_recipe(recipe, tmp_path / "recipe.yaml")
    assert train_main([str(tmp_path / "recipe.yaml"), "--dry-run", "--run-dir", str(root)]) == 0
    assert f"data.select: keeps {len(want)} of {len(train_idx)} training sequences" in capsys.readouterr().out
