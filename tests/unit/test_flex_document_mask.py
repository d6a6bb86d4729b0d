"""EAGLE-3's flex-attention document mask on packed rows, without a sliding window.

The flex ``BlockMask``'s ``mask_mod`` is evaluated densely (``create_mask``) and compared with a
block-diagonal causal reference written key by key; the flex attention of a packed row is compared
with a dense softmax reference; and a packed row of documents of different lengths, through the
whole draft on the flex backend, computes what each document computes alone. A mask that lets a
query see an earlier document (``<=`` on the document ids instead of ``==``) fails all three.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.models.eagle3.model import Eagle3DraftModel, TTTMask, ttt_attention

from helpers.tiny import eagle3_tiny_config

flex = pytest.importorskip("torch.nn.attention.flex_attention")

# row 0: four packed documents of different lengths; row 1: three documents then padding (-1)
LENGTHS = ((7, 5, 9, 3), (4, 10, 6))
T = 24


def document_ids() -> torch.Tensor:
    rows = []
    for lengths in LENGTHS:
        row = [d for d, n in enumerate(lengths) for _ in range(n)]
        rows.append(row + [-1] * (T - len(row)))
    return torch.tensor(rows)


def reference(docs: torch.Tensor, step: int) -> torch.Tensor:
    """``(B, T, (step + 1) * T)`` bool, key by key: step-0 key j is visible to query t iff
    ``j <= t`` and both are in the same document (block-diagonal causal); a step-s key (s >= 1)
    only at the query's own position."""
    B, n = docs.shape
    out = torch.zeros(B, n, (step + 1) * n, dtype=torch.bool)
    for b in range(B):
        for t in range(n):
            for s in range(step + 1):
                for j in range(n):
                    if s == 0:
                        ok = j <= t and int(docs[b, j]) == int(docs[b, t])
                    else:
                        ok = j == t
                    out[b, t, s * n + j] = ok
    return out


def test_the_reference_is_block_diagonal():
    """The reference itself: no query of a packed row sees a key of another document."""
    docs = document_ids()
    ref = reference(docs, 0)
    cross = docs[:, :, None] != docs[:, None, :]
    assert not (ref & cross).any()
    # and it is not trivially so: every document after the first has earlier keys it must not see
    assert (cross & torch.ones(T, T, dtype=torch.bool).tril()).any()


@pytest.mark.parametrize("steps", [1, 3])
def test_flex_mask_mod_equals_the_block_diagonal_causal_reference(steps):
    docs = document_ids()
    mask = TTTMask.build(T, steps, torch.device("cpu"), docs, backend="flex")
    assert mask.block_masks is not None and len(mask.block_masks) == steps
    for k, block_mask in enumerate(mask.block_masks):
        dense = flex.create_mask(block_mask.mask_mod, docs.shape[0], None, T, (k + 1) * T, device="cpu")
        want = reference(docs, k)
        assert dense.shape == (docs.shape[0], 1, T, (k + 1) * T)
        wrong = (dense[:, 0] != want).nonzero().tolist()
        assert not wrong, f"step {k}: {len(wrong)} (b, q, kv) entries differ from the reference, e.g. {wrong[:5]}"
    # the sdpa backend's dense masks agree too (both paths carry the same rule)
    sdpa = TTTMask.build(T, steps, torch.device("cpu"), docs, backend="sdpa")
    assert torch.equal(sdpa.dense[:, 0], reference(docs, steps - 1))


def dense_attention(q, keys, values, scale, docs):
    """Every score materialised, masked by :func:`reference`, one softmax."""
    groups = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
    v = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = reference(docs, len(keys) - 1).unsqueeze(1)
    return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)


def test_flex_ttt_attention_of_a_packed_row_equals_the_dense_reference():
    torch.manual_seed(3)
    docs = document_ids()
    B, nh, nkv, hd, steps = docs.shape[0], 4, 2, 8, 3
    q = torch.randn(B, nh, T, hd)
    keys = [torch.randn(B, nkv, T, hd) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd) for _ in range(steps)]
    mask = TTTMask.build(T, steps, torch.device("cpu"), docs, backend="flex")
    for k in range(steps):
        got = ttt_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), mask=mask)
        want = dense_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_packed_row_on_the_flex_backend_computes_what_its_documents_compute_alone():
    torch.manual_seed(5)
    steps, lengths = 3, (11, 6, 9)
    model = Eagle3DraftModel(eagle3_tiny_config()).eval()
    model.attention_backend = "flex"
    with torch.no_grad():
        model.embed_tokens.normal_()
        docs_ids = [torch.randint(0, 50, (1, n)) for n in lengths]
        docs_aux = [torch.randn(1, n, 96) for n in lengths]
        row = model(torch.cat(docs_ids, 1), torch.cat(docs_aux, 1), steps,
                    position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                    document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None])
        start = 0
        for d, (ids, aux, n) in enumerate(zip(docs_ids, docs_aux, lengths)):
            alone = model(ids, aux, steps)
            for k in range(steps):  # step k's inputs past the document's end differ: compare the rows before
                torch.testing.assert_close(row[k][0, start:start + n - k - 1], alone[k][0, :n - k - 1],
                                           rtol=1e-5, atol=1e-5, msg=lambda m: f"document {d}, step {k}: {m}")
            start += n
