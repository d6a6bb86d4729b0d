"""Sequence packing: the document-aware TTT mask, packed == unpacked loss and gradients,
first-fit packing covers every sequence once, and the trainer trains on packed rows."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.train.data import collate
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.common import ttt_prediction_mask
from draftsmith.models.eagle3.model import ttt_attention, ttt_attention_mask
from helpers.reference_losses import ttt_loss
from draftsmith.train.packing import PackedDataset, collate_packed, first_fit_packs
from draftsmith.train.sampler import LengthGroupedBatches

from helpers.tiny import eagle3_tiny_config as tiny_config


def test_packed_ttt_mask_equals_hand_written_reference():
    # T = 5, two documents [0 0 0 | 1 1], step 2: step-0 keys causal *within the document*,
    # step-1 and step-2 keys only on the diagonal (a position's own document by construction).
    expected = torch.tensor(
        [
            # step 0          step 1          step 2
            [1, 0, 0, 0, 0,  1, 0, 0, 0, 0,  1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0,  0, 1, 0, 0, 0,  0, 1, 0, 0, 0],
            [1, 1, 1, 0, 0,  0, 0, 1, 0, 0,  0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0,  0, 0, 0, 1, 0,  0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1,  0, 0, 0, 0, 1,  0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    docs = torch.tensor([0, 0, 0, 1, 1])
    assert torch.equal(ttt_attention_mask(5, 2, document_ids=docs), expected)
    assert torch.equal(ttt_attention_mask(5, 0, document_ids=docs), expected[:, :5])
    # batched document ids give one mask per row
    batched = ttt_attention_mask(5, 2, document_ids=torch.stack([docs, torch.zeros(5, dtype=torch.long)]))
    assert torch.equal(batched[0], expected) and torch.equal(batched[1], ttt_attention_mask(5, 2))


@pytest.mark.parametrize("step", [0, 2])
def test_ttt_attention_with_documents_equals_dense_masked_attention(step):
    torch.manual_seed(0)
    B, nh, T, hd = 2, 3, 7, 4
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, -1, -1]])
    q = torch.randn(B, nh, T, hd)
    keys = [torch.randn(B, nh, T, hd) for _ in range(step + 1)]
    values = [torch.randn(B, nh, T, hd) for _ in range(step + 1)]
    got = ttt_attention(q, keys, values, 0.5, docs)
    scores = (q @ torch.cat(keys, dim=2).transpose(-1, -2)) * 0.5  # (B, nh, T, (step+1)T)
    scores = scores.masked_fill(~ttt_attention_mask(T, step, document_ids=docs).unsqueeze(1), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ torch.cat(values, dim=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_prediction_mask_never_crosses_a_document_boundary():
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    # step 0 at t predicts x_{t+2}: t=0,1 (doc 0 tokens 2,3) and t=4 (doc 1 token 6)
    assert ttt_prediction_mask(mask, 0, docs).tolist() == [[True, True, False, False, True, False, False, False]]
    assert ttt_prediction_mask(mask, 1, docs).tolist() == [[True, False, False, False, False, False, False, False]]


def _sequence(cfg, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    mask = torch.ones(n, dtype=torch.long)
    mask[: n // 3] = 0  # a prompt
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=gen),
        "loss_mask": mask,
        "aux_hidden_states": torch.randn(n, 3 * cfg.hidden_size, generator=gen),
        "target_logits": torch.randn(n, cfg.draft_vocab_size, generator=gen) * 3,
    }


def _loss(model, batch, K, denominators=None):
    docs = batch.get("document_ids")
    logits = model(batch["input_ids"], batch["aux_hidden_states"], K, batch["loss_mask"], batch.get("position_ids"), docs)
    return ttt_loss(logits, batch["target_logits"], batch["loss_mask"], 0.8, denominators, docs)


def test_packed_loss_and_gradients_equal_the_unpacked_sequences():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    gen = torch.Generator().manual_seed(1)
    a, b, c = (_sequence(cfg, n, gen) for n in (9, 7, 11))
    K = 3

    packed = collate_packed([[a, b], [c]])  # row 0 holds two documents, row 1 one (+ padding)
    assert packed["position_ids"][0].tolist() == list(range(9)) + list(range(7))
    assert packed["document_ids"][0].tolist() == [0] * 9 + [1] * 7
    assert packed["document_ids"][1].tolist() == [0] * 11 + [-1] * 5
    loss_p, m_p = _loss(model, packed, K)
    grads_p = torch.autograd.grad(loss_p, list(model.parameters()))

    # unpacked, each sequence alone, normalised by the same per-step counts, summed
    singles = [collate([x]) for x in (a, b, c)]
    counts = [sum(int(ttt_prediction_mask(s["loss_mask"], k).sum()) for s in singles) for k in range(K)]
    assert counts == m_p.tokens
    loss_u = sum(_loss(model, s, K, counts)[0] for s in singles)
    grads_u = torch.autograd.grad(loss_u, list(model.parameters()))
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-6)
    for gp, gu in zip(grads_p, grads_u):
        torch.testing.assert_close(gp, gu, rtol=1e-5, atol=1e-6)
    # and equal to the ordinary padded batch of the three sequences
    loss_b, _ = _loss(model, collate([a, b, c]), K)
    torch.testing.assert_close(loss_p, loss_b, rtol=1e-5, atol=1e-6)


def test_packing_without_document_ids_would_differ():
    """The equivalence above is not vacuous: dropping the document ids changes the loss."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    gen = torch.Generator().manual_seed(1)
    packed = collate_packed([[_sequence(cfg, 9, gen), _sequence(cfg, 7, gen)]])
    with_docs, _ = _loss(model, packed, 3)
    without, _ = _loss(model, {k: v for k, v in packed.items() if k != "document_ids"}, 3)
    assert not torch.allclose(with_docs, without, rtol=1e-4)


def test_first_fit_decreasing_hand_example():
    # longest first: 6->p0, 5->p1, 4->p2, 3->p1 (first with room), 2->p0, 1->p2
    assert first_fit_packs([5, 4, 3, 2, 1, 6], 8, seed=0) == [[5, 3], [0, 2], [1, 4]]


def test_packing_covers_every_sequence_exactly_once():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 97, (500,), generator=gen).tolist()
    packs = first_fit_packs(lengths, 128, seed=3)
    assert sorted(i for p in packs for i in p) == list(range(500))
    assert all(sum(lengths[i] for i in p) <= 128 for p in packs)
    assert len(packs) <= math.ceil(sum(lengths) / 128) * 1.25  # first-fit decreasing packs tightly
    assert first_fit_packs(lengths, 128, seed=3) == packs  # deterministic given the seed
    with pytest.raises(ValueError, match="pack_tokens=50"):
        first_fit_packs([10, 60], 50, seed=0)


class _Lengths(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self._lengths = lengths

    def __len__(self):
        return len(self._lengths)

    def lengths(self):
        return self._lengths

    def __getitem__(self, i):
        return {"input_ids": torch.full((self._lengths[i],), i), "loss_mask": torch.ones(self._lengths[i], dtype=torch.long)}


@pytest.mark.parametrize("replicas", [1, 2])
def test_packed_loader_yields_every_sequence_once_per_epoch(replicas):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (64,), generator=gen).tolist()
    packed = PackedDataset(_Lengths(lengths), 64, seed=0)
    if replicas > 1:  # data parallel drops a ragged tail of rows: make the rows divide evenly
        keep = len(packed.packs) - len(packed.packs) % (2 * replicas)
        packed.packs = packed.packs[:keep]
    expected = sorted(i for p in packed.packs for i in p)
    seen = []
    for rank in range(replicas):
        sampler = LengthGroupedBatches(packed.lengths(), 2, seed=0, num_replicas=replicas, rank=rank)
        loader = torch.utils.data.DataLoader(packed, batch_sampler=sampler, collate_fn=collate_packed)
        for batch in loader:
            ids, docs = batch["input_ids"], batch["document_ids"]
            for row in range(ids.shape[0]):
                for d in docs[row].unique().tolist():
                    if d >= 0:
                        seen.append(int(ids[row][docs[row] == d][0]))
    assert sorted(seen) == expected
    if replicas == 1:
        assert expected == list(range(64))


def test_length_buckets_hand_values():
    from draftsmith.train.packing import length_bucket

    # unpacked: the smallest of 4 buckets (max_length * i / 4, rounded up to 128) that holds the row
    assert [length_bucket(n, 4096, False) for n in (1, 1024, 1025, 2049, 3073, 4096)] == \
        [1024, 1024, 2048, 3072, 4096, 4096]
    assert [length_bucket(n, 1000, False) for n in (1, 250, 256, 257, 1000)] == [256, 256, 256, 512, 1024]
    # packed: one bucket, the pack size
    assert {length_bucket(n, 4096, True) for n in (1, 4000, 4096)} == {4096}
    with pytest.raises(ValueError, match="exceeds the longest row length 4096"):
        length_bucket(4097, 4096, False)


def test_padding_to_a_length_bucket_keeps_loss_and_gradients():
    """The flex backend's bucket padding (collate_packed's pad_to, in a BatchCollator) adds masked
    positions only: the packed batch's loss and every gradient are unchanged."""
    import functools
    import pickle

    from draftsmith.train.data import BatchCollator
    from draftsmith.train.packing import length_bucket

    torch.manual_seed(0)
    cfg = tiny_config()
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    gen = torch.Generator().manual_seed(1)
    rows = [[_sequence(cfg, 9, gen), _sequence(cfg, 7, gen)], [_sequence(cfg, 11, gen)]]
    pad_to = functools.partial(length_bucket, max_length=40, packing=True)
    collator = pickle.loads(pickle.dumps(BatchCollator(functools.partial(collate_packed, pad_to=pad_to))))  # workers
    padded, plain = collator(rows), collate_packed(rows)
    assert padded["input_ids"].shape == (2, 128) and plain["input_ids"].shape == (2, 16)
    assert padded["document_ids"][:, 16:].eq(-1).all() and padded["attention_mask"][:, 16:].eq(0).all()
    assert padded["num_tokens"] == int(plain["attention_mask"].sum())
    loss_pad, m_pad = _loss(model, padded, 3)
    grads_pad = torch.autograd.grad(loss_pad, list(model.parameters()))
    loss, m = _loss(model, plain, 3)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert m_pad.tokens == m.tokens
    torch.testing.assert_close(loss_pad, loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_pad, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_attention_backend_is_flex_on_cuda_and_sdpa_elsewhere():
    from draftsmith.models.common import resolve_attention_backend
    from draftsmith.recipe import TrainConfig

    assert TrainConfig().attention_backend == "auto"
    assert resolve_attention_backend("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention_backend("auto", torch.device("cpu")) == "sdpa"
    assert [resolve_attention_backend(b, torch.device("cpu")) for b in ("sdpa", "flex")] == ["sdpa", "flex"]
    with pytest.raises(ValueError, match="unknown attention backend 'xformers': one of auto, sdpa, flex"):
        resolve_attention_backend("xformers", torch.device("cpu"))
