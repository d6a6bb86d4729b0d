"""EAGLE-3 TTT attention: one attention call per step over the concatenated step keys (memory
linear in T) equals the dense reference (the ``(B, nh, T, T + k)`` score matrix the draft used
before), in outputs and gradients, and a training step never builds a ``B * nh * T^2`` tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel, TTTMask, same_document, ttt_attention
from draftsmith.models.eagle3.training import ttt_plan
from draftsmith.train.labels import ttt_prediction_masks
from draftsmith.train.losses import LossSpec, TargetDraftHead, chunked_distill


def dense_ttt_attention(q, keys, values, scale, document_ids=None):
    """The reference: explicit ``(B, nh, T, T)`` step-0 scores plus one diagonal score per later
    step, one softmax over both (the draft's attention before the rewrite). keys / values
    ``(B, nkv, T, hd)`` per step (GQA repeated here)."""
    groups = q.shape[1] // keys[0].shape[1]
    keys = [k.repeat_interleave(groups, dim=1) for k in keys]
    values = [v.repeat_interleave(groups, dim=1) for v in values]
    T = q.shape[-2]
    scores = torch.matmul(q, keys[0].transpose(-1, -2)) * scale
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if document_ids is not None:
        allowed = (allowed & same_document(document_ids)).unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :T], values[0])
    for j, v in enumerate(values[1:]):
        out = out + probs[..., T + j: T + j + 1] * v
    return out


DOCS = torch.tensor([[0] * 7 + [1] * 6 + [2] * 3, [0] * 12 + [-1] * 4])


@pytest.mark.parametrize("steps", [1, 2, 4, 7])
@pytest.mark.parametrize("nkv", [4, 2, 1])
@pytest.mark.parametrize("packed", [False, True])
def test_concatenated_attention_equals_dense_reference_with_gradients(steps, nkv, packed):
    torch.manual_seed(steps * 10 + nkv)
    B, nh, T, hd = 2, 4, 16, 8
    docs = DOCS if packed else None
    q = torch.randn(B, nh, T, hd, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(B, nkv, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    scale = 1 / math.sqrt(hd)
    got = ttt_attention(q, keys, values, scale, docs)
    want = dense_ttt_attention(q, keys, values, scale, docs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(got)
    g_got = torch.autograd.grad(got, [q, *keys, *values], upstream)
    g_want = torch.autograd.grad(want, [q, *keys, *values], upstream)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_flex_block_mask_forward_equals_sdpa():
    # flex-attention is the CUDA path (compiled there); torch 2.13 runs its forward eagerly on the
    # CPU, which is enough to check the BlockMask encodes the same rule (its backward needs CUDA)
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    B, nh, nkv, T, hd, steps = 2, 4, 2, 16, 8, 3
    q = torch.randn(B, nh, T, hd)
    keys = [torch.randn(B, nkv, T, hd) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd) for _ in range(steps)]
    for docs in (None, DOCS):
        flex = TTTMask.build(T, steps, torch.device("cpu"), docs, backend="flex")
        got = ttt_attention(q, keys, values, 0.3, mask=flex)
        torch.testing.assert_close(got, dense_ttt_attention(q, keys, values, 0.3, docs), rtol=1e-5, atol=1e-5)


def test_unknown_attention_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        TTTMask.build(8, 2, torch.device("cpu"), backend="xformers")


class LargestTensor(TorchDispatchMode):
    """Records the element count of every tensor an op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def test_a_training_step_builds_no_quadratic_per_head_tensor():
    # B * nh * T^2 is what one dense score matrix of one step holds; the TTT bool mask is
    # (1, 1, T, K * T), below it because K < B * nh here (K = 4, B * nh = 32)
    torch.manual_seed(0)
    B, T, K = 2, 64, 4
    cfg = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=4, vocab_size=120, draft_vocab_size=48, aux_layer_ids=[0, 1, 2])
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(120, 64))
    head = TargetDraftHead(torch.randn(48, 64))
    ids = torch.randint(0, 120, (B, T))
    aux, final = torch.randn(B, T, 192), torch.randn(B, T, 64)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    plan = ttt_plan(ttt_prediction_masks(loss_mask, K))
    counts = plan["ttt_counts_host"]
    index, tindex = torch.split(plan["ttt_index"], counts), torch.split(plan["ttt_teacher_index"], counts)
    limit = B * cfg.num_attention_heads * T * T
    with LargestTensor() as rec:
        teacher = head(final.flatten(0, 1).index_select(0, plan["ttt_teacher_rows"]))

        def step_head(k, hidden, logits_fn):
            weight = torch.full((counts[k],), 0.8**k / counts[k])
            return chunked_distill(hidden.flatten(0, 1).index_select(0, index[k]), logits_fn, teacher, tindex[k],
                                   weight, LossSpec(), chunk_size=32)

        outs = model(ids, aux, K, step_head=step_head)
        torch.stack([o.loss_sum for o in outs]).sum().backward()
    assert rec.largest < limit, f"{rec.op} produced {rec.largest} elements >= B*nh*T^2 = {limit}"
    # the check can fail: the dense reference builds exactly such a tensor
    q = torch.randn(B, cfg.num_attention_heads, T, 4)
    with LargestTensor() as dense:
        dense_ttt_attention(q, [torch.randn(B, 4, T, 4)] * 2, [torch.randn(B, 4, T, 4)] * 2, 0.5)
    assert dense.largest >= limit
