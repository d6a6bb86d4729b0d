"""Activation checkpointing of the EAGLE-3 draft layer (``draft.gradient_checkpointing``, applied
from outside by :func:`~draftsmith.train.activation_checkpointing.apply_activation_checkpointing`):
same loss and gradients, fewer saved activations, the same state-dict keys."""

from __future__ import annotations

import torch

from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.train.activation_checkpointing import apply_activation_checkpointing
from helpers.reference_losses import ttt_loss

from helpers.tiny import eagle3_tiny_config as tiny_config


def _batch(cfg, B=2, T=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * cfg.hidden_size, generator=g)
    target = torch.randn(B, T, cfg.draft_vocab_size, generator=g) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :3] = 0
    cut = T // 2 + 1  # row 0 packs two documents, row 1 holds one
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[0, cut:] = 1
    pos = torch.arange(T).repeat(B, 1)
    pos[0, cut:] -= cut
    return ids, aux, target, mask, pos, docs


def _loss_and_grads(model, batch, K=4):
    ids, aux, target, mask, pos, docs = batch
    loss, _ = ttt_loss(model(ids, aux, K, mask, pos, docs), target, mask, 0.8, None, docs)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def _model():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    return cfg, model


def test_checkpointing_gives_the_same_loss_and_gradients():
    cfg, model = _model()
    batch = _batch(cfg)
    loss, grads = _loss_and_grads(model, batch)
    apply_activation_checkpointing(model)
    loss_ckpt, grads_ckpt = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    for g, gc in zip(grads, grads_ckpt):
        torch.testing.assert_close(gc, g, rtol=1e-6, atol=1e-7)


def _saved_bytes(model, batch, K=4) -> int:
    """Bytes autograd keeps for backward during one forward (what checkpointing cuts)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    ids, aux, target, mask, pos, docs = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_loss(model(ids, aux, K, mask, pos, docs), target, mask, 0.8, None, docs)
    return total


def test_checkpointing_saves_fewer_activations():
    cfg, model = _model()
    batch = _batch(cfg, B=2, T=64)
    plain = _saved_bytes(model, batch)
    apply_activation_checkpointing(model)
    ckpt = _saved_bytes(model, batch)
    assert ckpt < 0.6 * plain, (ckpt, plain)


def test_no_recompute_without_grad():
    """Under no_grad (eval) checkpointing changes nothing: outputs are identical."""
    cfg, model = _model()
    ids, aux, *_ = _batch(cfg)
    with torch.no_grad():
        plain = model(ids, aux, 3)
        apply_activation_checkpointing(model)
        ckpt = model(ids, aux, 3)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpointing_keeps_the_state_dict_keys():
    _, model = _model()
    keys = list(model.state_dict())
    apply_activation_checkpointing(model)
    assert list(model.state_dict()) == keys
    model.load_state_dict(dict(model.state_dict()))
