"""Validation while training: the split by conversation, the simulated acceptance length, the
best checkpoint, early stopping, and bad validation settings refused before any step."""

from __future__ import annotations


import pytest
import torch

from draftsmith.recipe import Recipe
from draftsmith.train.validation import (
    ValidationSpec,
    ValidationSplitError,
    conversation_key,
    split_by_conversation,
    summarise_validation,
)

from helpers.reference_losses import simulated_chain


def test_conversation_key_joins_regenerations_and_duplicates():
    assert conversation_key("seed_task_38_gen0") == conversation_key("seed_task_38_gen3") == "seed_task_38"
    assert conversation_key("0:abc#2") == "0:abc"
    assert conversation_key("q_general_7") == "q_general_7"


def test_split_is_by_conversation_seeded_and_order_free():
    ids = [f"c{i}_gen{g}" for i in range(40) for g in range(3)]
    train, val = split_by_conversation(ids, 0.25, seed=0)
    assert sorted(train + val) == list(range(len(ids)))
    val_convs = {conversation_key(ids[i]) for i in val}
    assert len(val_convs) == 10 and not val_convs & {conversation_key(ids[i]) for i in train}
    assert all(sum(conversation_key(x) == c for x in (ids[i] for i in val)) == 3 for c in val_convs)
    shuffled = list(reversed(ids))
    _, val2 = split_by_conversation(shuffled, 0.25, seed=0)
    assert {shuffled[i] for i in val2} == {ids[i] for i in val}  # the data's order does not matter
    _, val3 = split_by_conversation(ids, 0.25, seed=1)
    assert {ids[i] for i in val3} != {ids[i] for i in val}


@pytest.mark.parametrize("fraction, side", [(0.01, "no validation"), (0.99, "no training")])
def test_split_refuses_an_empty_side(fraction, side):
    with pytest.raises(ValidationSplitError, match=f"data/x.*{side}"):
        split_by_conversation([f"c{i}" for i in range(10)], fraction, seed=0, where="data/x")


def _chain_case():
    """Two chains of K=2 in one row of T=4: positions 0 and 1 (step masks include both)."""
    masks = [torch.tensor([[True, True, False, False]])] * 2
    d2t = torch.tensor([0, 0, 2])  # draft id 2 is target id 4
    return masks, d2t


def test_simulated_chain_at_t0_is_the_argmax_chain_over_the_full_vocab():
    masks, d2t = _chain_case()
    # draft argmaxes: step 0 -> [0, 2 (target 4)], step 1 -> [1, 1]
    draft = [torch.tensor([[5.0, 0, 0], [0, 0, 5.0]]), torch.tensor([[0, 5.0, 0], [0, 5.0, 0]])]
    # target argmaxes (V=5): step 0 -> [0, 4], step 1 -> [1, 3]
    target = {0: torch.tensor([[9.0, 0, 0, 0, 0], [0, 0, 0, 0, 9.0]]),
              1: torch.tensor([[0, 9.0, 0, 0, 0], [0, 0, 0, 9.0, 0]])}
    out = simulated_chain(draft, masks, target.__getitem__, d2t, [0.0])
    assert out["chains"].item() == 2
    # chain 0 accepts both, chain 1 accepts the first only
    assert out["accepted_0"].tolist() == [2.0, 1.0]
    metrics = summarise_validation({"chains": 2.0, "accepted_0_0": 2.0, "accepted_0_1": 1.0},
                                   ValidationSpec(2, (0.0,)))
    assert metrics["val_sim_al"] == pytest.approx(1 + 1.0 + 0.5)
    assert metrics["val_sim_rate_1"] == pytest.approx(0.5)


def test_simulated_chain_at_t_above_0_multiplies_expected_acceptances():
    masks, d2t = _chain_case()
    draft = [torch.tensor([[2.0, 0, 0], [0, 0, 2.0]]), torch.tensor([[0, 2.0, 0], [0, 2.0, 0]])]
    p0 = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    p1 = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25, 0.0]])
    target = {0: p0.log(), 1: p1.log()}
    greedy = simulated_chain(draft, masks, target.__getitem__, d2t, [1.0], "greedy")
    # greedy drafts: alpha = p(draft token); chain 0: 0.6 then 0.6*0.5, chain 1: 0.2 then 0.2*0.25
    assert greedy["accepted_1"].tolist() == pytest.approx([0.6 + 0.2, 0.3 + 0.05])
    sampled = simulated_chain(draft, masks, target.__getitem__, d2t, [1.0], "sample")
    q0 = torch.softmax(draft[0], -1)
    a00 = sum(min(p0[0, t].item(), q0[0, d].item()) for d, t in enumerate([0, 1, 4]))
    assert sampled["accepted_1"][0].item() == pytest.approx(a00 + torch.minimum(
        p0[1, [0, 1, 4]], q0[1]).sum().item(), rel=1e-5)


def test_a_draft_that_is_the_target_simulates_k_plus_one():
    masks = [torch.ones(2, 6, dtype=torch.bool)] * 3
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(12, 8, generator=g) for _ in range(3)]
    out = simulated_chain(logits, masks, lambda k: logits[k], torch.zeros(8, dtype=torch.long), [0.0])
    assert out["accepted_0"].tolist() == [12.0, 12.0, 12.0]


def test_recipe_refuses_eval_every_without_a_validation_fraction():
    with pytest.raises(ValueError, match="validation_fraction"):
        Recipe.model_validate({"train": {"eval_every": 10}})
