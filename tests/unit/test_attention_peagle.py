"""P-EAGLE training step without host syncs and with memory linear in T where it can be:

- the COD attention (per-element interval keys -> one additive mask shared by the layers, one
  SDPA call per layer, GQA without ``repeat_kv`` on CPU; or a flex-attention block mask) against
  the dense reference it replaced (outputs AND gradients, fp32, packed and unpacked rows, GQA,
  several depths);
- the vectorised COD sampler against the per-row Python sampler it replaced (same sizes at
  depth 1, the same mean retention at every depth);
- the loss computed inside the model's forward in chunks (``DistillTargets``) against the old
  ``cod_loss`` on boolean-selected logits, values, gradients and metrics, for every ``draft.loss``;
- one full training step under a dispatch mode: no tensor of ``B * nh * T^2`` elements, no
  host read (``.item()`` / ``nonzero``) in forward or backward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import repeat_kv

from draftsmith.models.common import DistillTargets, shift_left
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.model import (CODElements, PEagleDraftModel, cod_attention_bias, cod_attention_mask,
                                            cod_block_mask)
from draftsmith.models.peagle.training import cod_budget, cod_sample, cod_targets, step0_prediction_mask, PEagleMethod
from draftsmith.train.losses import LOSSES, LossSpec, StepMetrics, TargetDraftHead, chunked_distill

V, VD = 64, 48


def tiny_model(seed: int = 0, H: int = 32, nh: int = 4, nkv: int = 2, hd: int = 8, num_layers: int = 2,
               num_depths: int = 4) -> PEagleDraftModel:
    torch.manual_seed(seed)
    cfg = PEagleConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=nh, num_key_value_heads=nkv,
                       head_dim=hd, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 2], rope_theta=10000.0,
                       max_position_embeddings=256, num_layers=num_layers, num_depths=num_depths, mask_token_id=3)
    model = PEagleDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.init_from_target(torch.randn(V, H))
    return model


def make_batch(B: int, T: int, H: int, packed: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random rows; the loss mask covers the second half of each document (the "reply");
    packed: two documents per row, then padding (document -1, position 0, attention 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    attn = torch.ones(B, T, dtype=torch.long)
    batch = {"input_ids": ids, "aux_hidden_states": torch.randn(B, T, 3 * H, generator=g),
             "final_hidden_states": torch.randn(B, T, H, generator=g)}
    if not packed:
        loss_mask[:, T // 3:] = 1
        batch.update(loss_mask=loss_mask, attention_mask=attn)
        return batch
    docs = torch.full((B, T), -1, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cut, end = T // 2 - 2 * b, T - 3 - b
        for j, (s, e) in enumerate([(0, cut), (cut, end)]):
            docs[b, s:e] = j
            pos[b, s:e] = torch.arange(e - s)
            loss_mask[b, s + (e - s) // 3:e] = 1
        attn[b, end:] = 0
    batch.update(loss_mask=loss_mask, attention_mask=attn, document_ids=docs, position_ids=pos)
    return batch


def sample(batch: dict[str, torch.Tensor], num_depths: int, seed: int = 0, ratio: float = 0.8,
           max_anchors: int | None = None) -> CODElements:
    pred = step0_prediction_mask(batch["loss_mask"], batch.get("document_ids"))
    return cod_sample(pred, num_depths, ratio, 0.2, torch.Generator().manual_seed(seed), max_anchors,
                      batch.get("document_ids"))


# --------------------------------------------------------------------------------------
# The code this replaced, kept as the reference


def cod_attention_mask_reference(elements: CODElements, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The old dense construction (several ``(B, S, S)`` temporaries)."""
    a, d, v = elements.anchor, elements.depth, elements.valid
    aq, ak = a.unsqueeze(-1), a.unsqueeze(-2)
    dq, dk = d.unsqueeze(-1), d.unsqueeze(-2)
    allow = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))
    if document_ids is not None:
        doc = document_ids.gather(1, a)
        allow = allow & (doc.unsqueeze(-1) == doc.unsqueeze(-2))
    allow = allow & v.unsqueeze(-2) & v.unsqueeze(-1)
    eye = torch.eye(a.shape[1], dtype=torch.bool, device=a.device)
    return allow | (eye & ~v.unsqueeze(-1))


def reference_forward(model: PEagleDraftModel, input_ids, aux, elements, position_ids=None, document_ids=None):
    """The old training forward: dense bool mask, ``repeat_kv`` copies, one SDPA per layer."""
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T).unsqueeze(0).expand(B, T)
    a, d, v = elements.anchor, elements.depth, elements.valid
    pos = elements.pos.clamp_max(T - 1)
    is_mask = d > 0
    mask_ids = torch.full_like(pos, model.config.mask_token_id)
    ids = torch.where(is_mask, mask_ids, shift_left(input_ids, 1).gather(1, pos))
    fused = model.fc(aux)
    hidden = fused.gather(1, pos.unsqueeze(-1).expand(-1, -1, fused.shape[-1]))
    hidden = torch.where(is_mask.unsqueeze(-1), model.mask_state().to(hidden.dtype), hidden)
    rope_pos = position_ids.gather(1, a) + d
    mask = cod_attention_mask_reference(elements, document_ids)
    embeds = F.embedding(ids, model.embed_tokens).to(hidden.dtype)
    cos, sin = model.rotary_emb(hidden, torch.where(v, rope_pos, torch.zeros_like(rope_pos)))
    for i, layer in enumerate(model.layers):
        x, residual = layer._input(embeds if i == 0 else None, hidden)
        attn = layer.self_attn
        q, k, vv = attn._qkv(x, cos, sin)
        groups = attn.nh // attn.nkv
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(vv, groups),
                                             attn_mask=mask.unsqueeze(1))
        hidden = layer._output(residual, attn._out(out))
    return hidden


def cod_loss_reference(logits, target_logits, depth, num_depths, denominator=None, loss=None):
    """The old loss: ``(M, Vd)`` logits of the boolean-selected elements, python per-depth metrics."""
    M = logits.shape[0]
    if M == 0:
        return logits.sum() * 0.0, StepMetrics([0.0] * num_depths, [0.0] * num_depths, [0] * num_depths)
    kl = (loss or LossSpec())(target_logits, logits)
    total = kl.sum() / (denominator if denominator is not None else M)
    losses, accs, counts = [], [], []
    with torch.no_grad():
        hit = logits.argmax(-1) == target_logits.argmax(-1)
        for d in range(num_depths):
            sel = depth == d
            n = int(sel.sum())
            counts.append(n)
            losses.append(float(kl[sel].mean()) if n else 0.0)
            accs.append(float(hit[sel].float().mean()) if n else 0.0)
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts)


def _random_subset(items, size, generator):
    if len(items) <= size:
        return list(items)
    idx = torch.randperm(len(items), generator=generator)[:size]
    return sorted(items[i] for i in idx.tolist())


def cod_sample_reference(prediction_mask, num_depths, ratio, ratio_min, generator, max_anchors=None,
                         document_ids=None) -> list[list[int]]:
    """The old per-row Python sampler -> per row, the element count at each depth."""
    B, T = prediction_mask.shape
    pm, docs = prediction_mask.bool(), document_ids
    counts = []
    for b in range(B):
        valid_set = set(torch.nonzero(pm[b]).flatten().tolist())
        seeds = sorted(valid_set)
        if max_anchors is not None:
            seeds = _random_subset(seeds, max_anchors, generator)
        row = [T] + [0] * (num_depths - 1)
        prev = seeds
        for d in range(1, num_depths):
            eligible = [i for i in prev if i >= d and (docs is None or docs[b, i] == docs[b, i - d])]
            size = min(int(max(0, len(seeds) - d) * max(ratio**d, ratio_min)), len(eligible))
            if size == 0:
                break
            chosen = _random_subset(eligible, size, generator)
            row[d] = len(chosen)
            prev = [i + 1 for i in chosen if (i + 1) in valid_set]
        counts.append(row)
    return counts


# --------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("packed", [False, True])
def test_mask_bias_and_block_mask_equal_the_reference_rule(packed):
    batch = make_batch(2, 40, 8, packed)
    el = sample(batch, 5, max_anchors=None)
    docs = batch.get("document_ids")
    want = cod_attention_mask_reference(el, docs)
    assert torch.equal(cod_attention_mask(el, docs), want)
    bias = cod_attention_bias(el, docs)
    assert bias.shape == (2, 1, el.anchor.shape[1], el.anchor.shape[1]) and bias.stride(-2) % 16 == 0
    assert torch.equal(bias[:, 0] == 0, want) and torch.isneginf(bias[:, 0][~want]).all()
    # flex: every tile with an allowed pair is listed, and a tile listed as full is fully allowed
    bs = 8
    bm = cod_block_mask(el, docs, block_size=bs)
    S = want.shape[-1]
    nb = -(-S // bs)
    padded = F.pad(want, (0, nb * bs - S, 0, nb * bs - S)).view(2, nb, bs, nb, bs)
    touched, fully = padded.any((2, 4)), padded.all((2, 4))
    listed = bm.to_dense()[:, 0].bool()  # partial + full tiles
    assert (listed | ~touched).all()
    full_only = type(bm).from_kv_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, BLOCK_SIZE=bs).to_dense()[:, 0]
    assert (~full_only.bool() | fully).all() and full_only.any()
    assert listed.sum() < nb * nb * 2  # block-sparse


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nh, nkv, num_depths", [(4, 2, 4), (4, 4, 2), (6, 2, 6)])
def test_forward_and_gradients_equal_the_dense_reference(packed, nh, nkv, num_depths):
    H = 8 * nh
    model = tiny_model(H=H, nh=nh, nkv=nkv, num_depths=num_depths).train()
    batch = make_batch(2, 24, H, packed, seed=1)
    el = sample(batch, num_depths, seed=2, ratio=0.9)
    assert (el.depth == num_depths - 1).any() and not el.valid.all()  # deep chains and empty slots
    args = (batch["input_ids"], batch["aux_hidden_states"], el, batch.get("position_ids"), batch.get("document_ids"))
    w = torch.randn(*el.anchor.shape, H, generator=torch.Generator().manual_seed(3))
    grads = []
    outs = []
    for fn in (reference_forward, lambda m, *a: m(*a)):
        model.zero_grad()
        out = fn(model, *args)
        (out * w).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys() and "mask_hidden" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


def test_flex_backend_forward_equals_sdpa_on_cpu():
    """flex_attention runs eagerly on CPU (forward only: torch 2.13 has no flex backward on CPU,
    so gradients are compared for SDPA above; CUDA compiles flex)."""
    model = tiny_model(nh=4, nkv=2, num_depths=4).eval()
    for packed in (False, True):
        batch = make_batch(2, 40, 32, packed, seed=4)
        el = sample(batch, 4, seed=5)
        args = (batch["input_ids"], batch["aux_hidden_states"], el, batch.get("position_ids"),
                batch.get("document_ids"))
        with torch.no_grad():
            model.attention_backend = "sdpa"
            want = model(*args)
            model.attention_backend = "flex"
            got = model(*args)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        PEagleDraftModel(model.config, attention_backend="xformers")


# --------------------------------------------------------------------------------------
# COD sampling


def test_vectorised_sampler_has_the_reference_sizes_and_retention():
    """Same draws in law as the per-row sampler: the depth-1 count is deterministic and equal;
    deeper counts (random: they depend on where the chains hit untrained positions) have the
    same mean."""
    batch = make_batch(2, 48, 8, packed=True, seed=6)
    holes = torch.rand(2, 48, generator=torch.Generator().manual_seed(6)) < 0.25  # chains break at random
    pred = step0_prediction_mask(batch["loss_mask"] * ~holes, batch["document_ids"])
    D, r = 5, 0.8
    new = torch.zeros(2, D)
    old = torch.zeros(2, D)
    draws = 300
    for i in range(draws):
        el = cod_sample(pred, D, r, 0.2, torch.Generator().manual_seed(i), document_ids=batch["document_ids"])
        new += torch.stack([((el.depth == d) & el.valid).sum(1) for d in range(D)], 1)
        old += torch.tensor(cod_sample_reference(pred, D, r, 0.2, torch.Generator().manual_seed(i),
                                                 document_ids=batch["document_ids"]), dtype=torch.float)
        if i == 0:
            assert torch.equal(new[:, 1], old[:, 1])
    new, old = new / draws, old / draws
    assert (old[:, D - 1] > 0.5).all()  # chains reach the last depth
    torch.testing.assert_close(new, old, atol=0.35, rtol=0.06)
    # S is known on the host: T + the per-depth budget
    assert el.anchor.shape[1] == 48 + sum(cod_budget(48, D, r, 0.2))


def test_sampler_is_deterministic_per_generator_and_keeps_max_anchors():
    batch = make_batch(2, 40, 8, packed=False)
    a, b, c = (sample(batch, 4, seed=s, max_anchors=10) for s in (0, 0, 1))
    assert torch.equal(a.anchor, b.anchor) and torch.equal(a.depth, b.depth) and torch.equal(a.valid, b.valid)
    assert not torch.equal(a.anchor, c.anchor)
    assert (((a.depth == 1) & a.valid).sum(1) == int(9 * 0.8)).all()
    assert a.anchor.shape[1] == 40 + sum(cod_budget(40, 4, 0.8, 0.2, 10))


# --------------------------------------------------------------------------------------
# Loss


def stub_method(cfg: PEagleConfig, loss: str = "forward_kl", H: int = 32, seed: int = 0,
                ratio: float = 0.8) -> PEagleMethod:
    """A PEagleMethod without a run directory: the recipe fields and target head the step reads."""
    m = PEagleMethod.__new__(PEagleMethod)
    m.recipe = SimpleNamespace(seed=seed, train=SimpleNamespace(),
                               draft=SimpleNamespace(num_depths=cfg.num_depths, down_sample_ratio=ratio,
                                                     down_sample_ratio_min=0.2, max_anchors=None))
    m.accelerator = SimpleNamespace(num_processes=1, process_index=0)
    m.target = None
    m.config = cfg
    m.loss = LossSpec(loss, 1.0, 3.0)
    m.target_head = TargetDraftHead(torch.randn(VD, H, generator=torch.Generator().manual_seed(7)))
    m._step, m._micro = 0, 0
    return m


def reference_compute_loss(method: PEagleMethod, model, batch, elements):
    """The old compute_loss on the same elements: boolean-selected logits, shifted teacher copy."""
    pred = step0_prediction_mask(batch["loss_mask"], batch.get("document_ids"))
    sel = cod_targets(elements, pred)
    logits = model(batch["input_ids"], batch["aux_hidden_states"], elements, batch.get("position_ids"),
                   batch.get("document_ids"), select=sel)
    teacher = method.target_head(shift_left(batch["final_hidden_states"], 1))
    target = teacher.gather(1, elements.pos.unsqueeze(-1).expand(-1, -1, teacher.shape[-1]))[sel]
    return cod_loss_reference(logits, target, elements.depth[sel], method.config.num_depths, None, method.loss)


@pytest.mark.parametrize("kind", LOSSES)
def test_loss_values_gradients_and_metrics_equal_the_reference(kind):
    """Every element the reference trains on, with and without the batch plan (which sizes the
    depth budgets from the CPU batch and projects only trained depth-0 rows)."""
    model = tiny_model(num_depths=4).train()
    method = stub_method(model.config, kind)
    for packed, planned in ((False, False), (True, False), (True, True)):
        batch = make_batch(2, 24, 32, packed, seed=8)
        if planned:
            plan = method.batch_plan()(batch)
            assert plan["cod_seed_bound"] < 24 and plan["cod_rows0"].shape[0] < 2 * 24
            batch = {**batch, **plan}
        method.begin_step(3)
        method._micro = 0
        _, elements = method.sample(batch)
        model.zero_grad()
        ref_loss, ref = reference_compute_loss(method, model, batch, elements)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        method._micro = 0  # the same draw again
        loss, metrics = method.compute_loss(model, batch)
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, atol=1e-6, rtol=1e-4, msg=name)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
        torch.testing.assert_close(metrics["loss"], ref_loss.detach())
        for d in range(4):
            torch.testing.assert_close(metrics[f"loss_{d}"].item(), ref.loss[d], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(metrics[f"acc_{d}"].item(), ref.acc[d], atol=1e-6, rtol=0)
        assert ref.tokens[3] > 0
        al, run = 1.0, 1.0
        for a in ref.acc:
            run *= a
            al += run
        torch.testing.assert_close(metrics["expected_al"].item(), al, atol=1e-6, rtol=1e-6)


def test_loss_chunks_equal_one_chunk():
    model = tiny_model(num_depths=3).train()
    method = stub_method(model.config)
    batch = make_batch(2, 24, 32, packed=True, seed=9)
    pred, el = method.sample(batch)
    sel = cod_targets(el, pred)
    teacher = method.target_head(batch["final_hidden_states"][:, 1:]).reshape(-1, VD)
    index = el.pos.clamp_max(22) + 23 * torch.arange(2).unsqueeze(1)
    outs = []
    for chunk in (None, 7):
        model.zero_grad()
        out = model(batch["input_ids"], batch["aux_hidden_states"], el, batch["position_ids"], batch["document_ids"],
                    targets=DistillTargets(teacher, index, sel.float() / sel.sum(), chunked_distill, None, chunk))
        out.loss_sum.backward()
        outs.append((out.loss_sum.detach(), out.row_loss, model.fc.weight.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert outs[0][1].shape == (el.anchor.numel(),)


# --------------------------------------------------------------------------------------
# One training step: no quadratic tensor, no host read


class Watch(TorchDispatchMode):
    """Records the largest tensor any op produces and the ops that read a tensor on the host."""

    HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                  torch.ops.aten.masked_select.default, torch.ops.aten.item.default}

    def __init__(self):
        super().__init__()
        self.largest, self.where, self.host_reads, self.shapes = 0, None, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.HOST_READS:
            self.host_reads.append(str(func))
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
                if t.numel() > self.largest:
                    self.largest, self.where = t.numel(), f"{func} {tuple(t.shape)}"
        return out


def test_training_step_has_no_quadratic_tensor_and_no_host_read():
    """nh = 16 heads of head_dim 4: with D = 4 depths at r = 0.7 the sampled count is
    S = T + budget ~ 2.5 T, so the one ``(B, 1, S, S)`` mask (~6.3 B T^2 elements) stays below
    ``B * nh * T^2``, the size of the per-head score matrix that a materialising attention
    (``repeat_kv`` + math SDPA) would produce."""
    B, T, nh, H = 2, 32, 16, 64
    model = tiny_model(H=H, nh=nh, nkv=4, hd=4, num_depths=4).train()
    method = stub_method(model.config, H=H, ratio=0.7)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = make_batch(B, T, H, packed=True, seed=10)
    limit = B * nh * T * T
    S = T + sum(cod_budget(T, 4, 0.7, 0.2))
    assert B * S * S < limit  # the mask itself fits under the bound
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = method.batch_plan()(batch)  # on the CPU batch, as the DataLoader workers run it
    for step, extra in enumerate(({}, plan)):
        method.begin_step(step)
        with Watch() as watch:
            loss, metrics = method.compute_loss(model, {**batch, **extra})
            loss.backward()
        assert watch.host_reads == []
        assert watch.largest < limit, watch.where
        n = T + sum(cod_budget(T, 4, 0.7, 0.2, seed_bound=extra.get("cod_seed_bound")))
        assert (B, 1, n, n) in watch.shapes  # the mode does see the mask
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss) and loss > 0 and set(metrics) >= {"loss", "loss_0", "acc_3", "expected_al"}
    assert n < S  # the plan's bound shrinks the budgets
    assert not torch.equal(before["mask_hidden"], model.mask_hidden.detach())
