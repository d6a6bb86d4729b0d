"""EAGLE-3 draft: TTT attention mask, attention equivalence, causality, loss."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.common import shift_left
from draftsmith.models.common import ttt_prediction_mask
from draftsmith.models.eagle3.model import ttt_attention, ttt_attention_mask
from draftsmith.train.losses import TargetDraftHead

from helpers.reference_losses import ttt_loss
from helpers.tiny import eagle3_tiny_config as tiny_config


def test_ttt_mask_equals_hand_written_reference():
    # T = 3, step 2: step-0 keys causal, step-1 and step-2 keys only on the diagonal.
    expected = torch.tensor(
        [
            # step 0     step 1     step 2
            [1, 0, 0,   1, 0, 0,   1, 0, 0],
            [1, 1, 0,   0, 1, 0,   0, 1, 0],
            [1, 1, 1,   0, 0, 1,   0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ttt_attention_mask(3, 2), expected)
    assert torch.equal(ttt_attention_mask(3, 0), expected[:, :3])


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_equals_dense_masked_attention(step):
    torch.manual_seed(0)
    B, nh, T, hd = 2, 3, 5, 4
    q = torch.randn(B, nh, T, hd)
    keys = [torch.randn(B, nh, T, hd) for _ in range(step + 1)]
    values = [torch.randn(B, nh, T, hd) for _ in range(step + 1)]
    scale = 1 / math.sqrt(hd)
    got = ttt_attention(q, keys, values, scale)

    k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, nh, (step+1)T, hd)
    scores = (q @ k_all.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~ttt_attention_mask(T, step), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ v_all
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_draft_logits_at_t_do_not_depend_on_later_positions():
    """Every TTT step at position t may only read tokens/states at positions <= t + k + 1
    (its own inputs): perturbing a later position must leave it unchanged."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg).eval()
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    T, K = 10, 3
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    aux = torch.randn(1, T, 3 * cfg.hidden_size)
    base = model(ids, aux, K)
    cut = 6
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[:, cut:] = (ids2[:, cut:] + 7) % cfg.vocab_size
    aux2[:, cut:] += 1.0
    pert = model(ids2, aux2, K)
    for k in range(K):
        # step k at position t reads aux[<= t] and tokens x[<= t + k + 1]
        safe = cut - k - 1
        torch.testing.assert_close(pert[k][:, :safe], base[k][:, :safe])
        assert not torch.allclose(pert[k][:, safe:], base[k][:, safe:])


def test_step_k_feeds_previous_step_hidden_and_shifted_tokens():
    """Step 1 equals a manual run: hidden from step 0 and tokens shifted by 2, RoPE + 1."""
    torch.manual_seed(1)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg).eval()
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    T = 6
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    aux = torch.randn(2, T, 3 * cfg.hidden_size)
    logits = model(ids, aux, 2)
    pos = torch.arange(T).expand(2, T)
    cache = []
    h0 = model.step(shift_left(ids, 1), model.fc(aux), pos, cache)
    h1 = model.step(shift_left(ids, 2), h0, pos + 1, cache)
    torch.testing.assert_close(logits[0], model.compute_logits(h0))
    torch.testing.assert_close(logits[1], model.compute_logits(h1))
    # with a loss mask, logits are computed only where step k's prediction is trained
    mask = torch.zeros(2, T, dtype=torch.long)
    mask[:, 4:] = 1
    packed = model(ids, aux, 2, mask)
    torch.testing.assert_close(packed[0], logits[0][:, 2:4].reshape(-1, cfg.draft_vocab_size))
    torch.testing.assert_close(packed[1], logits[1][:, 1:3].reshape(-1, cfg.draft_vocab_size))


def test_ttt_loss_is_zero_when_draft_equals_target_and_counts_assistant_predictions():
    torch.manual_seed(0)
    B, T, Vd = 2, 8, 11
    target = torch.randn(B, T, Vd)
    mask = torch.ones(B, T, dtype=torch.long)
    # step k at position t must match the target at t + k + 1
    steps = [shift_left(target, k + 1)[ttt_prediction_mask(mask, k)] for k in range(3)]
    loss, m = ttt_loss(steps, target, mask, gamma=0.8)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # KL(p || p)
    for k in range(3):
        assert m.acc[k] == 1.0
        assert m.tokens[k] == B * (T - k - 2)
    mask[:, :5] = 0  # only tokens 5..7 are assistant tokens
    steps = [shift_left(target, k + 1)[ttt_prediction_mask(mask, k)] for k in range(3)]
    _, m2 = ttt_loss(steps, target, mask)
    assert m2.tokens == [B * 3, B * 3, B * 3]  # step k: positions 3-k..5-k predict tokens 5..7
    wrong = [torch.zeros_like(s) for s in steps]
    loss_wrong, _ = ttt_loss(wrong, target, mask)
    assert loss_wrong.item() > 0.1


def test_target_draft_head_gathers_t2d_rows():
    lm_head = torch.randn(10, 4)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 7]] = True
    head = TargetDraftHead.from_full(lm_head, t2d)
    h = torch.randn(3, 4)
    torch.testing.assert_close(head(h), (h @ lm_head.T)[:, [1, 4, 7]])


def test_config_rejects_bad_aux_layers_and_vocab():
    with pytest.raises(ValueError, match="exactly 3"):
        tiny_config(aux_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="ascending"):
        tiny_config(aux_layer_ids=[3, 1, 2])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny_config(draft_vocab_size=51)


def test_embedding_is_frozen_and_not_in_state_dict():
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg)
    sd = model.state_dict()
    assert "embed_tokens" not in sd and "d2t" in sd and "t2d" in sd
    assert all(p.requires_grad for p in model.parameters())
    assert "embed_tokens" not in dict(model.named_parameters())
