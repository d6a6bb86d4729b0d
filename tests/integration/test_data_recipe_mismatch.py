"""Training on data prepared for another recipe: a draft vocab of another size is refused before
anything trains, naming the vocab file and both sizes (DFlash2 needs the full target vocab, so a
folder prepared for EAGLE-3 is the usual way to meet this)."""

from __future__ import annotations

import pytest

from draftsmith.data_prep.conversations import DataError
from draftsmith.layout import RunLayout, read_vocab
from draftsmith.train.method_eagle3 import Eagle3Method


def test_a_draft_vocab_of_another_size_than_the_recipes_is_refused_naming_the_file(prepared):
    recipe, run, _ = prepared
    d2t, _ = read_vocab(RunLayout(run).data)
    Eagle3Method(recipe, run)  # the folder's own recipe trains
    other = recipe.model_copy(deep=True)
    other.data.draft_vocab_size = int(d2t.shape[0]) - 1
    with pytest.raises(DataError, match=rf"vocab.safetensors: a draft vocab of {d2t.shape[0]} tokens, but the "
                                        rf"recipe's data.draft_vocab_size is {d2t.shape[0] - 1}"):
        Eagle3Method(other, run)
