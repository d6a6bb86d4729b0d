"""train.loss: every divergence's value and gradient on a hand-made case, worked out here in
plain Python (no torch), and the recipe / training wiring."""

import math

import pytest
import torch

from draftsmith.recipe import Recipe
from draftsmith.train.losses import LOSSES, LossSpec, acceptance_probability, divergence, ttt_loss

P = [0.5, 0.3, 0.2]  # target distribution
Q = [0.2, 0.3, 0.5]  # draft distribution: draft logits log(Q) (softmax(log Q) = Q)


def softmax_grad(dl_dq: list[float], q: list[float]) -> list[float]:
    """dL/dz for q = softmax(z): sum_i dL/dq_i * q_i (delta_ij - q_j)."""
    inner = sum(g * qi for g, qi in zip(dl_dq, q))
    return [qj * (gj - inner) for gj, qj in zip(dl_dq, q)]


def expected(kind: str) -> tuple[float, list[float]]:
    """(value, d value / d draft logits) of each divergence at (P, Q), by hand."""
    fkl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    alpha = sum(min(p, q) for p, q in zip(P, Q))  # 0.2 + 0.3 + 0.2 = 0.7
    # d(1 - alpha)/dq_i = -1 where q_i < p_i (q_i is the min), 0 where q_i > p_i; ties (0.3)
    # take torch.minimum's even split of the gradient: -1/2
    dtv_dq = [-1.0 if q < p else (-0.5 if q == p else 0.0) for p, q in zip(P, Q)]
    dtv = softmax_grad(dtv_dq, Q)
    if kind == "forward_kl":
        return fkl, [q - p for p, q in zip(P, Q)]
    if kind == "reverse_kl":
        rkl = sum(q * math.log(q / p) for p, q in zip(P, Q))
        return rkl, [q * (math.log(q / p) - rkl) for p, q in zip(P, Q)]
    if kind == "jsd":
        M = [(p + q) / 2 for p, q in zip(P, Q)]
        value = 0.5 * sum(p * math.log(p / m) for p, m in zip(P, M)) + 0.5 * sum(q * math.log(q / m) for q, m in zip(Q, M))
        return value, softmax_grad([0.5 * math.log(q / m) for q, m in zip(Q, M)], Q)
    if kind == "tv":
        return 1 - alpha, dtv
    if kind == "lk_alpha":
        return -math.log(alpha), [g / alpha for g in dtv]
    if kind == "lk_lambda":
        w = 2.0 * math.exp(-3.0 * alpha)  # lk_kl_scale 2, lk_kl_decay 3; alpha is not differentiated in w
        return w * fkl + 1 - alpha, [w * (q - p) + g for p, q, g in zip(P, Q, dtv)]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", LOSSES)
def test_divergence_value_and_gradient_by_hand(kind):
    target = torch.tensor([P]).log()
    draft = torch.tensor([Q]).log().requires_grad_(True)
    value = divergence(kind, target, draft, lk_kl_scale=2.0, lk_kl_decay=3.0)
    value.sum().backward()
    want, want_grad = expected(kind)
    assert value.shape == (1,)
    assert value.item() == pytest.approx(want, abs=1e-6)
    assert draft.grad[0].tolist() == pytest.approx(want_grad, abs=1e-6)


@pytest.mark.parametrize("kind", LOSSES)
def test_divergence_is_zero_where_the_draft_is_the_target_and_positive_elsewhere(kind):
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    assert divergence(kind, target, target + 3.0).abs().max() < 1e-5  # softmax is shift invariant
    assert (divergence(kind, target, draft) > 1e-4).all()


def test_lk_alpha_is_cross_entropy_at_a_one_hot_target_and_finite_at_zero_overlap():
    draft = torch.tensor([[0.1, 2.0, -1.0]])
    one_hot = torch.tensor([[0.0, -1e4, -1e4]])
    ce = torch.nn.functional.cross_entropy(draft, torch.tensor([0]))
    assert divergence("lk_alpha", one_hot, draft).item() == pytest.approx(ce.item(), abs=1e-5)
    disjoint = divergence("lk_alpha", torch.tensor([[0.0, -1e4]]), torch.tensor([[-1e4, 0.0]]))
    assert torch.isfinite(disjoint).all() and disjoint.item() > 10


def test_acceptance_probability_is_one_minus_total_variation():
    log_p, log_q = torch.tensor(P).log(), torch.tensor(Q).log()
    assert acceptance_probability(log_p, log_q).item() == pytest.approx(0.7)
    tv = 0.5 * sum(abs(p - q) for p, q in zip(P, Q))
    assert acceptance_probability(log_p, log_q).item() == pytest.approx(1 - tv)


def test_unknown_loss_names_the_choices():
    with pytest.raises(ValueError, match="forward_kl, reverse_kl"):
        divergence("kl", torch.zeros(1, 2), torch.zeros(1, 2))


def test_ttt_loss_uses_the_recipe_divergence():
    """The step loss of ttt_loss is the chosen divergence's mean over the step's positions."""
    g = torch.Generator().manual_seed(1)
    B, T, V = 1, 6, 7
    target_logits = torch.randn(B, T, V, generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    # step 0 at position t predicts x_{t+2}: positions 0..3 (loss_mask at t+2)
    draft = torch.randn(4, V, generator=g)
    for kind in ("forward_kl", "tv", "lk_alpha"):
        total, m = ttt_loss([draft], target_logits, loss_mask, loss=LossSpec(kind))
        want = divergence(kind, target_logits[0, 1:5], draft).mean()
        assert total.item() == pytest.approx(want.item(), rel=1e-6)
        assert m.tokens == [4]


def test_recipe_takes_the_losses_and_refuses_them_for_hard_label_heads():
    r = Recipe.model_validate({"train": {"loss": "lk_lambda", "lk_kl_scale": 0.5}})
    assert LossSpec.from_recipe(r.train) == LossSpec("lk_lambda", 0.5, 3.0)
    with pytest.raises(ValueError, match="train.loss"):
        Recipe.model_validate({"train": {"loss": "l2"}})
    with pytest.raises(ValueError, match="hard labels"):
        Recipe.model_validate({"draft": {"method": "medusa"}, "train": {"loss": "jsd"}})
