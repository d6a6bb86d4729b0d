"""Training on data prepared for another recipe: a draft vocab of another size is refused before
anything trains, naming the vocab file and both sizes (DFlash2 needs the full target vocab, so a
folder prepared for EAGLE-3 is the usual way to meet this). Evaluation, which reads folders in a
draft's own vocab, is not affected (tests/integration/test_warm_start.py's simulate test)."""

from __future__ import annotations

import pytest

from draftsmith.data_prep.conversations import DataError
from draftsmith.layout import RunLayout, read_vocab
from draftsmith.recipe import dump_recipe
from draftsmith.cli.train import launch
from draftsmith.train.method_base import check_draft_vocab_size
from draftsmith.models.eagle3.training import Eagle3Method


def test_a_draft_vocab_of_another_size_than_the_recipes_is_refused_naming_the_file(prepared, tmp_path, capsys):
    recipe, run, _ = prepared
    paths = RunLayout(run).data
    d2t, _ = read_vocab(paths)
    check_draft_vocab_size(recipe, paths)  # the folder's own recipe passes
    other = recipe.model_copy(deep=True)
    other.data.draft_vocab_size = int(d2t.shape[0]) - 1
    message = (rf"vocab.safetensors: a draft vocab of {d2t.shape[0]} tokens, but the recipe's "
               rf"data.draft_vocab_size is {d2t.shape[0] - 1}")
    with pytest.raises(DataError, match=message):
        check_draft_vocab_size(other, paths)
    # the training entry says it in one line (the run directory's check, data/agreement.py, comes
    # first: the key, both values, the way out) and trains nothing
    dump_recipe(other, tmp_path / "other.yaml")
    code = launch([str(tmp_path / "other.yaml"), "--run-dir", str(run), "--no-prepare", "--resume"],
                  method=Eagle3Method, script="train/eagle3.py", doc="")
    err = capsys.readouterr().err
    assert code == 1 and "train/eagle3.py: error:" in err, err
    assert (f"data.draft_vocab_size={d2t.shape[0]} ({paths.vocab}), the recipe has {d2t.shape[0] - 1}" in err
            and "--overwrite-data" in err), err
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
