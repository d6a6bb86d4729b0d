"""DFlash block attention as ONE ``scaled_dot_product_attention`` call per layer over
``[context (T) | all block tokens (A*Bk)]`` with a head-free bool mask: outputs and gradients
equal the dense per-block reference (kept here) in fp32, for unpacked and packed rows, GQA,
several block sizes and invalid (padding) anchors; the optional ``flex_attention`` path equals
it in forward (CPU eager); and a whole DFlash training step creates no tensor as large as
``B*nh*T^2`` elements."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import draftsmith.models.dflash.model as dflash
import draftsmith.models.attention as attention
from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash.model import DFlashDraftModel, block_attention, block_attention_mask
from draftsmith.models.dflash.training import sample_anchors, dflash_loss, slot_weights
from draftsmith.train.losses import LossSpec, TargetDraftHead

from helpers.tiny import dflash_tiny_config, random_dflash_model

# ------------------------------------------------------------------------------------------
# The dense reference: the previous implementation, every anchor block against every context
# row, scores (B, nh, A, Bk, T + Bk) in fp32.


def block_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, ctx_allow, block_valid, scale):
    """``q / k_blk / v_blk (B, nh, A, Bk, hd)``, ``k_ctx / v_ctx (B, nh, T, hd)``, ``ctx_allow
    (B, A, T)``, ``block_valid (B, A)`` -> ``(B, nh, A, Bk, hd)``; invalid blocks give 0."""
    s_ctx = torch.einsum("bhaqd,bhtd->bhaqt", q, k_ctx).float() * scale  # (B, nh, A, Bk, T)
    s_blk = torch.einsum("bhaqd,bhakd->bhaqk", q, k_blk).float() * scale  # (B, nh, A, Bk, Bk)
    neg = torch.finfo(torch.float32).min
    s_ctx = s_ctx.masked_fill(~(ctx_allow & block_valid[..., None])[:, None, :, None, :], neg)
    s_blk = s_blk.masked_fill(~block_valid[:, None, :, None, None], neg)
    probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(q.dtype)
    probs = probs * block_valid[:, None, :, None, None].to(q.dtype)
    T = k_ctx.shape[2]
    out = torch.einsum("bhaqt,bhtd->bhaqd", probs[..., :T], v_ctx)
    return out + torch.einsum("bhaqk,bhakd->bhaqd", probs[..., T:], v_blk)


def reference_from_new_signature(q, k_ctx, v_ctx, k_blk, v_blk, mask, scale):
    """The reference behind :func:`block_attention`'s signature (to swap it into the model):
    context visibility and validity are read back from the sdpa mask."""
    B, nh, L, hd = q.shape
    Bk, T = mask.block_size, mask.context_len
    A, g = L // Bk, nh // k_ctx.shape[1]
    ctx_allow = mask.allow[:, 0, ::Bk, :T]  # (B, A, T), already & valid
    valid = mask.keep[:, 0, ::Bk, 0].bool()  # (B, A)
    rep = lambda t: t.repeat_interleave(g, dim=1)  # noqa: E731
    five = lambda t: t.reshape(B, nh, A, Bk, hd)  # noqa: E731
    out = block_attention_reference(five(q), rep(k_ctx), rep(v_ctx), five(rep(k_blk)), five(rep(v_blk)),
                                    ctx_allow, valid, scale)
    return out.reshape(B, nh, L, hd)


def random_case(B, nh, nkv, A, Bk, T, hd, packed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, A * Bk, hd, generator=gen)
    k_ctx, v_ctx = (torch.randn(B, nkv, T, hd, generator=gen) for _ in range(2))
    k_blk, v_blk = (torch.randn(B, nkv, A * Bk, hd, generator=gen) for _ in range(2))
    anchors = torch.randint(0, T - 1, (B, A), generator=gen)
    anchors[:, 0] = 0  # an anchor with no context at all: it sees only its block
    valid = torch.rand(B, A, generator=gen) > 0.3
    valid[0, 0], valid[-1, -1] = True, False
    allow = torch.arange(T)[None, None] < anchors[..., None]
    if packed:  # three documents per row: a block sees only its anchor's
        docs = (torch.arange(T)[None] >= torch.tensor([[T // 3], [T // 2]])[:B]).long() + \
            (torch.arange(T)[None] >= 2 * T // 3).long()
        allow = allow & (docs[:, None, :] == docs.gather(1, anchors)[..., None])
    leaves = [t.requires_grad_() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    return leaves, allow, valid


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nh,nkv,native_gqa", [(4, 4, True), (4, 2, True), (6, 1, True), (4, 2, False),
                                                (6, 1, False)])
@pytest.mark.parametrize("Bk", [2, 4, 5])
def test_one_sdpa_call_equals_the_dense_reference_in_outputs_and_gradients(packed, nh, nkv, native_gqa, Bk,
                                                                           monkeypatch):
    if not native_gqa:  # the CUDA path: keys / values repeated per query head
        monkeypatch.setattr(attention, "sdpa_supports_gqa_with_mask", lambda device: False)
    B, A, T, hd = 2, 5, 17, 8
    (q, kc, vc, kb, vb), allow, valid = random_case(B, nh, nkv, A, Bk, T, hd, packed)
    scale = hd ** -0.5
    mask = block_attention_mask(allow, valid, Bk)
    assert mask.allow.shape == (B, 1, A * Bk, T + A * Bk)  # no head dim
    got = block_attention(q, kc, vc, kb, vb, mask, scale)
    want = reference_from_new_signature(q, kc, vc, kb, vb, mask, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    invalid = ~valid.repeat_interleave(Bk, dim=1)  # (B, A*Bk) queries of padding blocks
    assert got.permute(0, 2, 1, 3)[invalid].abs().max() == 0  # exactly zero

    upstream = torch.randn_like(got)
    g_new = torch.autograd.grad(got, (q, kc, vc, kb, vb), upstream)
    g_ref = torch.autograd.grad(want, (q, kc, vc, kb, vb), upstream)
    for name, a, b in zip(["q", "k_ctx", "v_ctx", "k_blk", "v_blk"], g_new, g_ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_a_block_sees_its_own_block_bidirectionally_and_no_other_block():
    B, nh, A, Bk, T, hd = 1, 2, 3, 4, 9, 8
    (q, kc, vc, kb, vb), _, _ = random_case(B, nh, nh, A, Bk, T, hd, packed=False, seed=4)
    allow = torch.arange(T)[None, None] < torch.tensor([[1, 4, 7]])[..., None]
    mask = block_attention_mask(allow, torch.ones(B, A, dtype=torch.bool), Bk)
    with torch.no_grad():
        base = block_attention(q, kc, vc, kb, vb, mask, hd ** -0.5)
        kb2 = kb.clone()
        kb2[:, :, 2 * Bk - 1] += 1.0  # the last slot of block 1
        kb2[:, :, :Bk] += 1.0  # all of block 0
        moved = block_attention(q, kc, vc, kb2, vb, mask, hd ** -0.5)
    assert (moved[:, :, Bk] - base[:, :, Bk]).abs().max() > 1e-4  # slot 0 of block 1 reads its last slot
    torch.testing.assert_close(moved[:, :, 2 * Bk:], base[:, :, 2 * Bk:])  # block 2 reads neither


# ------------------------------------------------------------------------------------------
# The whole model: the SDPA path against the model with the reference swapped in


tiny_config = dflash_tiny_config


def random_model(cfg, seed: int = 0, **model_kw):
    return random_dflash_model(cfg, seed, **model_kw).train()


def model_inputs(cfg, B, T, packed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, cfg.vocab_size, (B, T), generator=gen)
    g = torch.randn(B, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, : T // 4] = 0  # prompt
    mask[-1, : T - 4] = 0  # the last row has 3 valid anchors: the others are padding anchors
    docs = pos = None
    if packed:
        docs = (torch.arange(T)[None] >= T // 2).long().expand(B, T).contiguous()
        pos = torch.where(docs == 0, torch.arange(T), torch.arange(T) - T // 2)
    anchors, valid = sample_anchors(mask, 6, torch.Generator().manual_seed(seed), docs)
    return ids, g, mask, anchors, valid, pos, docs


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nkv,Bk", [(4, 4), (2, 3), (1, 5)])
def test_model_forward_and_gradients_equal_the_dense_reference_model(packed, nkv, Bk, monkeypatch):
    cfg = tiny_config(num_key_value_heads=nkv, block_size=Bk)
    ids, g, mask, anchors, valid, pos, docs = model_inputs(cfg, 2, 16, packed)
    assert not valid.all()  # padding anchors are part of the case
    results = []
    for attention in (block_attention, reference_from_new_signature):
        monkeypatch.setattr(dflash, "block_attention", attention)
        model = random_model(cfg)
        logits = model(ids, g, anchors, valid, position_ids=pos, document_ids=docs)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        assert torch.isfinite(got_grads[name]).all(), name
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------
# flex_attention (CUDA backend), forward parity in eager mode on CPU


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2)])
def test_flex_attention_block_mask_equals_sdpa(packed, nh, nkv):
    pytest.importorskip("torch.nn.attention.flex_attention")
    B, A, Bk, T, hd = 2, 5, 4, 17, 8
    leaves, allow, valid = random_case(B, nh, nkv, A, Bk, T, hd, packed, seed=1)
    q, kc, vc, kb, vb = (t.detach() for t in leaves)  # forward only: flex has no CPU backward
    with torch.no_grad():
        want = block_attention(q, kc, vc, kb, vb, block_attention_mask(allow, valid, Bk), hd ** -0.5)
        flex = block_attention_mask(allow, valid, Bk, backend="flex")
        assert flex.allow is None and flex.flex is not None
        got = block_attention(q, kc, vc, kb, vb, flex, hd ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_backend_model_forward_equals_sdpa_and_unknown_backend_is_refused():
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = tiny_config()
    ids, g, mask, anchors, valid, pos, docs = model_inputs(cfg, 2, 16, packed=True)
    with torch.no_grad():
        want = random_model(cfg)(ids, g, anchors, valid, position_ids=pos, document_ids=docs)
        got = random_model(cfg, attention_backend="flex")(ids, g, anchors, valid, position_ids=pos,
                                                           document_ids=docs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend 'dense'"):
        DFlashDraftModel(cfg, attention_backend="dense")


# ------------------------------------------------------------------------------------------
# A whole training step: no (B, nh, T, T)-sized tensor anywhere


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any op produces, with the op's name."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), (str(func), tuple(t.shape))
        return out


def training_step(model, cfg, B, T, A):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, cfg.vocab_size, (B, T), generator=gen)
    aux = torch.randn(B, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=gen)
    final = torch.randn(B, T, cfg.target_hidden_size, generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :4] = 0
    head = TargetDraftHead(torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=gen))
    anchors, valid = sample_anchors(mask, A, torch.Generator().manual_seed(1))
    loss, metrics = dflash_loss(model, ids, aux, final, mask, anchors, valid, head,
                                slot_weights(cfg.block_size, 4.0), LossSpec())
    loss.backward()
    return loss, metrics


def test_a_training_step_creates_no_tensor_of_b_nh_t_squared_elements(monkeypatch):
    # nh = 16 heads against A*Bk = T block queries: the previous dense scores (B, nh, A, Bk, T+Bk)
    # exceed B*nh*T^2 elements, while every mask here is head-free, (B, 1, A*Bk, T + A*Bk) =
    # B*T*2T elements, far below it (so are the (B*A*(Bk-1), Vd) loss chunks with Vd = 96).
    B, T, A, Bk, nh = 2, 64, 16, 4, 16
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=nh,
                       num_key_value_heads=4, head_dim=4, vocab_size=128, draft_vocab_size=96,
                       aux_layer_ids=[1, 2], block_size=Bk, mask_token_id=3, target_hidden_size=64,
                       num_target_layers=4)
    limit = B * nh * T * T
    model = random_model(cfg)
    mode = LargestTensor()
    with mode:
        loss, metrics = training_step(model, cfg, B, T, A)
    assert torch.isfinite(loss) and loss > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert mode.numel < limit, mode.op
    assert mode.numel <= B * A * Bk * (T + A * Bk), mode.op  # nothing beyond the head-free mask

    # the check has teeth: the same step through the dense reference crosses the limit
    monkeypatch.setattr(dflash, "block_attention", reference_from_new_signature)
    dense = LargestTensor()
    with dense:
        training_step(random_model(cfg), cfg, B, T, A)
    assert dense.numel >= limit, dense.op
