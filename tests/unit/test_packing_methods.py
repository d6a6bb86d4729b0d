"""Sequence packing for every draft method besides EAGLE-3 (that one: ``test_packing.py``).

For DFlash, DFlash2, DSpark, P-EAGLE, Medusa and the MLP speculator (stage 1), the method's real
training path (its ``compute_loss`` on the batch the trainer's ``BatchCollator`` builds, with and
without the method's batch plan) on the packed rows ``collate_packed([[a, b], [c]])`` gives the
same loss, the same data-dependent metrics and the same gradient of every parameter as on the
padded batch ``collate([a, b, c])`` of the same three sequences (fp32, rtol 1e-5). Both batches
hold the same trained tokens, so every normaliser (token counts, slot-weight sums, COD element
counts) agrees.

What reads across positions, and must stop at a document boundary, is exercised: block
attention over the earlier context (DFlash family), block labels and teachers p_{a+k-1}
(DFlash family), the Markov context x_{a+k} (DSpark), the selector's predecessor tokens
(DFlash2), the COD attention and chains (P-EAGLE), head k's label x_{t+k+2} (Medusa, MLP
speculator) and the MLP speculator's teacher-forced look-ahead tokens x_{t+1+i}. The sequences
are built so that each of these would cross from ``a`` into ``b`` without the document ids
(``b``'s reply starts at its second token), and :func:`test_packing_without_document_ids_would_differ`
shows it for every method: the equivalence is not vacuous.

Random sampling is taken out of the comparison, never papered over:

- DFlash / DFlash2 / DSpark: ``draft.num_anchors`` (64) is above every row's number of valid
  anchors, so :func:`~draftsmith.models.dflash.training.sample_anchors` keeps *every* valid anchor (valid
  ones have keys in [0, 1), the rest -1, and ``topk`` over at least as many slots as valid
  positions takes them all), in both layouts; the test checks that the (document, position)
  anchor sets agree.
- P-EAGLE: COD budgets are per row (a packed row shares its depth budgets among its documents),
  so in general packed and padded rows draw different element sets. With
  ``down_sample_ratio = 1`` and no ``max_anchors``, depth d of a row keeps
  ``min(n - d, #eligible)`` chains (n = trained positions of the row). In a document whose first
  trained prediction is at its position 0 (``loss_mask[2] == 1``) and whose first trained run is
  at least ``num_depths - 1`` long, the eligible positions at depth d are at most ``n_doc - d``:
  ``n1 - d`` from the first run and ``n_r - d + 1 <= n_r`` from every later run. So a padded row
  (one document) keeps all of them, and a packed row, whose budget ``sum n_doc - d`` is at least
  the sum over its documents, keeps all of them too: the element sets are equal (the test checks
  it) and the RNG draws never matter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from draftsmith.train.data import BatchCollator, collate
from draftsmith.train.packing import collate_packed

from helpers.tiny import dflash_tiny_config, dspark_tiny_config, random_dflash_model, random_dspark_model

METHODS = ["dflash", "dflash2", "dspark", "peagle", "medusa", "mlp_speculator"]

# Three sequences: a prompt (1 or 2 tokens), then replies, two of them multi-turn (a gap of
# prompt tokens in the middle). b's reply starts at its token 1, so anything that reads past the
# end of a (labels x_{t+2}, block labels, attention) would find trained tokens of b.
LOSS_MASKS = {
    "a": [0, 0] + [1] * 10,
    "b": [0, 1, 1, 1, 1, 0, 1, 1, 1],
    "c": [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1],
}
RTOL, ATOL = 1e-5, 1e-6


def sequences(vocab: int, aux_width: int, final_width: int, seed: int = 1, low: int = 0) -> list[dict[str, Any]]:
    """The items a ``HiddenStateDataset`` hands out, for a, b, c: ``input_ids``, ``loss_mask``,
    ``aux_hidden_states (T, aux_width)``, ``final_hidden_states (T, final_width)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for mask in LOSS_MASKS.values():
        n = len(mask)
        out.append({"input_ids": torch.randint(low, vocab, (n,), generator=g),
                    "loss_mask": torch.tensor(mask, dtype=torch.long),
                    "aux_hidden_states": torch.randn(n, aux_width, generator=g),
                    "final_hidden_states": torch.randn(n, final_width, generator=g)})
    return out


# --------------------------------------------------------------------------------------
# The methods at tiny size, without a run directory: what compute_loss reads, set by hand


def dflash_family(kind: str) -> tuple[Any, torch.nn.Module, list[dict[str, Any]]]:
    from draftsmith.models.dflash2.config import DFlash2Config
    from draftsmith.models.dflash2.model import DFlash2DraftModel
    from draftsmith.models.dflash.training import slot_weights, DFlashMethod
    from draftsmith.models.dspark.training import DSparkLossSpec, dspark_slot_weights, DSparkMethod
    from draftsmith.train.losses import LossSpec, TargetDraftHead
    from draftsmith.models.dflash2.training import DFlash2Method

    gamma = 4.0
    if kind == "dflash":
        cfg = dflash_tiny_config()
        model, cls = random_dflash_model(cfg), DFlashMethod
    elif kind == "dspark":
        cfg = dspark_tiny_config()
        model, cls = random_dspark_model(cfg), DSparkMethod
    else:
        base = dflash_tiny_config().to_dict()
        base.update(draft_vocab_size=base["vocab_size"], conv_kernel_size=3, conv_group_size=8, selector_rank=6,
                    selector_top_k=5)
        cfg = DFlash2Config(**base)
        torch.manual_seed(0)
        model = DFlash2DraftModel(cfg)
        with torch.no_grad():  # every parameter random (the conv and selector start as no-ops otherwise)
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
            model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
            model.set_vocab_mapping(torch.zeros(cfg.vocab_size, dtype=torch.long),
                                    torch.ones(cfg.vocab_size, dtype=torch.bool))
        cls = DFlash2Method
    method = object.__new__(cls)
    method.recipe = SimpleNamespace(seed=3, train=SimpleNamespace(loss_chunk_rows=7),
                                    draft=SimpleNamespace(num_anchors=64, selector_loss_alpha=0.5))
    method.accelerator, method.step, method.micro, method.config = None, -1, 0, cfg
    method.loss = LossSpec("forward_kl")
    method.weights = slot_weights(cfg.block_size, gamma)
    g = torch.Generator().manual_seed(5)
    method.target_head = TargetDraftHead(3 * torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=g))
    if kind == "dspark":
        method.weights = dspark_slot_weights(cfg.block_size, gamma)
        method.spec = DSparkLossSpec(LossSpec("tv"), 0.1, 0.9, 1.0)
        method.t2d = model.t2d.clone()
    n_aux = len(cfg.aux_layer_ids)
    # token ids from 8 up: never the mask token (7)
    seqs = sequences(cfg.vocab_size, n_aux * cfg.target_hidden_size, cfg.target_hidden_size, low=8)
    return method, model.train(), seqs


def peagle() -> tuple[Any, torch.nn.Module, list[dict[str, Any]]]:
    from draftsmith.models.peagle.config import PEagleConfig
    from draftsmith.models.peagle.model import PEagleDraftModel
    from draftsmith.train.losses import LossSpec, TargetDraftHead
    from draftsmith.models.peagle.training import PEagleMethod

    H, V, VD = 32, 64, 48
    torch.manual_seed(0)
    cfg = PEagleConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 2], rope_theta=10000.0,
                       max_position_embeddings=256, num_layers=2, num_depths=4, mask_token_id=3)
    model = PEagleDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.init_from_target(torch.randn(V, H))
    method = object.__new__(PEagleMethod)
    # down_sample_ratio 1, no max_anchors: every eligible COD element is kept (module docstring)
    method.recipe = SimpleNamespace(seed=3, train=SimpleNamespace(),
                                    draft=SimpleNamespace(num_depths=cfg.num_depths, down_sample_ratio=1.0,
                                                          down_sample_ratio_min=0.2, max_anchors=None))
    method.accelerator, method.config = None, cfg
    method.loss = LossSpec("forward_kl")
    method.target_head = TargetDraftHead(torch.randn(VD, H, generator=torch.Generator().manual_seed(7)))
    method._step, method._micro = 0, 0
    return method, model.train(), sequences(V, 3 * H, H, low=4)  # ids from 4 up: never the mask token (3)


def head_method(kind: str) -> tuple[Any, torch.nn.Module, list[dict[str, Any]]]:
    from draftsmith.models.medusa.model import MedusaConfig, MedusaModel
    from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig
    from draftsmith.models.medusa.training import MedusaMethod
    from draftsmith.models.mlp_speculator.training import MLPSpeculatorMethod

    H, V, K = 16, 40, 3
    method = object.__new__(MedusaMethod if kind == "medusa" else MLPSpeculatorMethod)
    method.recipe = SimpleNamespace(train=SimpleNamespace(loss_chunk_rows=5),
                                    draft=SimpleNamespace(head_decay=0.7, stage2_start_step=None))
    method.accelerator, method.num_heads, method.step = None, K, 0
    torch.manual_seed(0)
    if kind == "medusa":
        method.config = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=K, num_layers=2)
        model = MedusaModel(method.config)
        with torch.no_grad():  # ResBlocks start as the identity: make them matter
            for p in model.blocks.parameters():
                p.normal_(0, 0.3)
    else:
        method.config = MLPSpeculatorConfig(emb_dim=H, inner_dim=24, vocab_size=V, n_predict=K)
        model = MLPSpeculator(method.config)
    return method, model.train(), sequences(V, 3 * H, H)


def build(kind: str) -> tuple[Any, torch.nn.Module, list[dict[str, Any]]]:
    if kind in ("dflash", "dflash2", "dspark"):
        return dflash_family(kind)
    if kind == "peagle":
        return peagle()
    return head_method(kind)


def reset_draws(method: Any) -> None:
    """The step / micro-batch counters the anchor and COD generators are seeded from, back to
    the first micro-batch of step 0 (the same draw for every call)."""
    if hasattr(method, "anchor_seed"):
        method.step, method.micro = -1, 0
        method.begin_step(0)
    if hasattr(method, "cod_generator"):
        method._step, method._micro = 0, 0


def run(method: Any, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float], list]:
    """The method's compute_loss: (loss, its metrics as floats, the gradient of every trainable
    parameter, None where unused)."""
    reset_draws(method)
    loss, metrics = method.compute_loss(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), {k: float(v) for k, v in metrics.items()}, list(grads)


def collate_packed_without_documents(rows: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """:func:`collate_packed` with the ``document_ids`` lost (positions still restart per document)."""
    out = collate_packed(rows)
    del out["document_ids"]
    return out


def batches(method: Any, seqs: list[dict[str, Any]], planned: bool,
            drop_documents: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(packed ``[[a, b], [c]]``, padded ``[a, b, c]``), collated as the trainer collates them
    (:class:`~draftsmith.train.data.BatchCollator`, with the method's batch plan when ``planned``)."""
    plan = method.batch_plan() if planned else None
    a, b, c = seqs
    base: Callable[[list], dict[str, Any]] = collate_packed_without_documents if drop_documents else collate_packed
    packed = BatchCollator(base, plan)([[a, b], [c]])
    padded = BatchCollator(collate, plan)([a, b, c])
    return packed, padded


# --------------------------------------------------------------------------------------
# Sampling: the same anchors / COD elements in both layouts


def documents(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document (B, T), start of its document (B, T))``: from ``document_ids`` (packed) or, for
    a padded batch, one document per row (the row index)."""
    B, T = batch["input_ids"].shape
    if "document_ids" not in batch:
        return torch.arange(B)[:, None].expand(B, T), torch.zeros(B, T, dtype=torch.long)
    docs = batch["document_ids"]
    start = torch.zeros(B, T, dtype=torch.long)
    for t in range(1, T):
        start[:, t] = torch.where(docs[:, t] == docs[:, t - 1], start[:, t - 1], t)
    # global document number: row 0 holds documents 0, 1; row 1 document 2
    offset = torch.cat([torch.zeros(1, dtype=torch.long), (docs.max(1).values + 1).cumsum(0)[:-1]])
    return docs + offset[:, None], start


def anchor_set(method: Any, batch: dict[str, Any]) -> list[tuple[int, int]]:
    """The (document, position in it) of every anchor compute_loss samples (DFlash family)."""
    from draftsmith.models.dflash.training import sample_anchors, NUM_ANCHORS_KEY

    reset_draws(method)
    mask, T = batch["loss_mask"], batch["loss_mask"].shape[1]
    width = batch.get(NUM_ANCHORS_KEY) or min(method.recipe.draft.num_anchors, max(T - 1, 1))
    anchors, valid = sample_anchors(mask, width, method.anchor_generator(), batch.get("document_ids"))
    doc, start = documents(batch)
    out = []
    for b, j in valid.nonzero().tolist():
        a = int(anchors[b, j])
        out.append((int(doc[b, a]), a - int(start[b, a])))
    return sorted(out)


def element_set(method: Any, batch: dict[str, Any]) -> list[tuple[int, int, int, bool]]:
    """The (document, anchor position in it, depth, trained) of every valid COD element of
    depth >= 1 (depth 0 is every position, in both layouts) that compute_loss draws (P-EAGLE)."""
    from draftsmith.models.peagle.training import cod_targets

    reset_draws(method)
    pred, el = method.sample(batch)
    trained = cod_targets(el, pred)
    doc, start = documents(batch)
    out = []
    for b, s in (el.valid & (el.depth > 0)).nonzero().tolist():
        a = int(el.anchor[b, s])
        out.append((int(doc[b, a]), a - int(start[b, a]), int(el.depth[b, s]), bool(trained[b, s])))
    return sorted(out)


# --------------------------------------------------------------------------------------
# The tests


def test_the_collated_batches_are_what_packing_writes():
    _, _, seqs = head_method("medusa")
    packed = collate_packed([seqs[:2], seqs[2:]])
    assert packed["position_ids"][0].tolist() == list(range(12)) + list(range(9))
    assert packed["document_ids"][0].tolist() == [0] * 12 + [1] * 9
    assert packed["document_ids"][1].tolist() == [0] * 15 + [-1] * 6
    assert packed["loss_mask"].sum() == collate(seqs)["loss_mask"].sum()  # the same trained tokens


@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
@pytest.mark.parametrize("kind", METHODS)
def test_packed_rows_train_exactly_like_the_padded_batch(kind, planned):
    """Loss, every data-dependent metric and every parameter gradient of the method's
    compute_loss: packed ``[[a, b], [c]]`` == padded ``[a, b, c]`` (module docstring)."""
    method, model, seqs = build(kind)
    packed, padded = batches(method, seqs, planned)
    if kind in ("dflash", "dflash2", "dspark"):
        got = anchor_set(method, packed)
        assert got == anchor_set(method, padded) and len(got) > 10
    if kind == "peagle":
        got = element_set(method, packed)
        assert got == element_set(method, padded)
        assert {d for *_, d, trained in got if trained} == {1, 2, 3}  # every depth trains
    loss_p, metrics_p, grads_p = run(method, model, packed)
    loss_u, metrics_u, grads_u = run(method, model, padded)
    assert torch.isfinite(loss_p) and loss_p > 0
    torch.testing.assert_close(loss_p, loss_u, rtol=RTOL, atol=ATOL)
    assert set(metrics_p) == set(metrics_u) and len(metrics_p) > 3
    for key in metrics_p:
        assert metrics_p[key] == pytest.approx(metrics_u[key], rel=RTOL, abs=ATOL), key
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [g is None for g in grads_p] == [g is None for g in grads_u]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads_p) >= len(names) // 2
    for name, gp, gu in zip(names, grads_p, grads_u):
        if gp is not None:  # fp32 sums in another order: absolute error relative to the tensor's scale
            torch.testing.assert_close(gp, gu, rtol=RTOL, atol=ATOL + RTOL * float(gu.abs().max()), msg=name)


@pytest.mark.parametrize("kind", METHODS)
def test_packing_without_document_ids_would_differ(kind):
    """The equivalence above is not vacuous: the packed rows without their document ids (so
    attention, labels and look-ahead run on from a into b) give another loss, for every method."""
    method, model, seqs = build(kind)
    packed, padded = batches(method, seqs, planned=True)
    merged, _ = batches(method, seqs, planned=True, drop_documents=True)
    loss_p, _, _ = run(method, model, packed)
    loss_u, _, _ = run(method, model, padded)
    loss_m, _, _ = run(method, model, merged)
    torch.testing.assert_close(loss_p, loss_u, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(loss_m, loss_p, rtol=1e-4)


def test_sampling_budgets_are_per_row_not_per_document():
    """What packing does change, by design: ``draft.num_anchors`` (DFlash family) and the COD
    depth budgets (P-EAGLE) are per-row compute budgets, so a packed row's documents share them
    (uniformly at random over the row's valid positions) instead of each document getting its own.
    The tests above therefore compare configurations that keep every valid anchor / element."""
    method, _, seqs = dflash_family("dflash")
    method.recipe.draft.num_anchors = 4
    packed, padded = batches(method, seqs, planned=True)
    assert len(anchor_set(method, packed)) == 2 * 4  # rows [a, b] and [c]
    assert len(anchor_set(method, padded)) == 3 * 4  # rows a, b, c

    method, _, seqs = peagle()
    method.recipe.draft.down_sample_ratio = 0.8
    packed, padded = batches(method, seqs, planned=True)
    # trained step-0 positions (loss_mask[t+2] == 1): a 10, b 6, c 11; depth 1 keeps int((n - 1) * 0.8)
    depth1 = [sum(d == 1 for _, _, d, _ in element_set(method, batch)) for batch in (packed, padded)]
    assert depth1 == [int(15 * 0.8) + int(10 * 0.8),  # rows [a, b] (n = 16) and [c]
                      int(9 * 0.8) + int(5 * 0.8) + int(10 * 0.8)]  # rows a, b, c


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "peagle"])
def test_flex_attention_backend_packs_too(kind):
    """``train.attention_backend: flex`` (the block masks built from the document ids): packed
    loss and metrics == padded, forward only (torch has no flex backward on the CPU; CUDA compiles it)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    method, model, seqs = build(kind)
    model.attention_backend = "flex"
    packed, padded = batches(method, seqs, planned=True)
    with torch.no_grad():
        reset_draws(method)
        loss_p, metrics_p = method.compute_loss(model, packed)
        reset_draws(method)
        loss_u, metrics_u = method.compute_loss(model, padded)
    torch.testing.assert_close(loss_p, loss_u, rtol=RTOL, atol=ATOL)
    for key in metrics_p:
        assert float(metrics_p[key]) == pytest.approx(float(metrics_u[key]), rel=RTOL, abs=ATOL), key
