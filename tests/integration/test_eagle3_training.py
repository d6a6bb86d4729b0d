"""An EAGLE-3 draft's TTT loss goes down on a fixed batch."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models.eagle3.model import Eagle3DraftModel

from helpers.reference_losses import ttt_loss
from helpers.tiny import eagle3_tiny_config as tiny_config


@pytest.mark.integration
def test_loss_goes_down_on_a_fixed_batch():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    B, T = 4, 12
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    aux = torch.randn(B, T, 3 * cfg.hidden_size)
    target = torch.randn(B, T, cfg.draft_vocab_size) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = ttt_loss(model(ids, aux, 3, mask), target, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
