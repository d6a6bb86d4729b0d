"""``draft.accept_weighting`` and ``draft.opd`` for DSpark and XPress (docs/training.md,
"Acceptance-aware loss" and "On-policy distillation"): their own losses against whole-logits
references, ``none`` against today's loss bit for bit, which terms the reach weights, the methods'
recipe keys and their ``reach_k`` metrics.

DFlash's and EAGLE-3's cases are tests/unit/test_accept_weighting.py and tests/unit/test_opd.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith.models.dflash.training import block_labels, sample_anchors, slot_weights, teacher_rows
from draftsmith.models.dspark import training as dspark_training
from draftsmith.models.dspark.training import DSparkLossSpec, DSparkOut, dspark_loss, dspark_slot_weights
from draftsmith.models.xpress import training as xpress_training
from draftsmith.models.xpress.config import XPressConfig
from draftsmith.models.xpress.model import XPressDraftModel
from draftsmith.models.xpress.training import RefinedOut, XPressLossSpec, XPressOut, xpress_loss
from draftsmith.recipe import load_recipe
from draftsmith.train.losses import AcceptSpec, LossSpec, TargetDraftHead, acceptance_probability, chunk_rows

from helpers.tiny import dspark_tiny_config, random_dspark_model
from helpers.ttt_cases import reference_acceptance

OPD_GAMMA = 0.7


def _kl(log_a, log_b):
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _reverse_kl(target, logits, target_temperature=1.0):
    """``KL(q || p)`` per row, written out."""
    return _kl(torch.log_softmax(logits.float(), -1), torch.log_softmax(target.float() / target_temperature, -1))


def _reach(target, logits, trained, accept):
    """``(..., G)`` the exclusive product over the earlier slots of each block of the hit / expected
    acceptance (an untrained slot passes the chain on): the hand-computed cumprod."""
    a = torch.where(trained, reference_acceptance(target, logits, accept), torch.ones(()))
    return torch.cat([torch.ones_like(a[..., :1]), a[..., :-1].cumprod(-1)], -1)


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _assert_matches(model, reference, run, accept):
    """``run`` (the loss, its gradients, its metrics) equals ``reference`` (the whole-logits loss, the
    reach and trained mask ``(B, A, G)``): loss, gradients and ``reach_j`` of the j-th trained slot
    of a block; ``reach_0`` is 1, and at hard some chains broke and some did not."""
    want, reach, trained = reference
    want_grads = torch.autograd.grad(want, _params(model))
    got, grads, metrics = run
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, ref in zip(grads, want_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    for j in range(trained.shape[-1]):
        n = trained[..., j].sum().clamp_min(1)
        assert float(metrics[f"reach_{j}"]) == pytest.approx(float((reach[..., j] * trained[..., j]).sum() / n), abs=1e-6)
    assert float(metrics["reach_0"]) == 1.0
    if not accept.soft:
        assert 0 < float(metrics["reach_2"]) < 1


# --------------------------------------------------------------------------------------
# DSpark


def _dspark_case(seed: int = 0):
    """A tiny DSpark draft (blocks of 4, a draft vocab of 3: the argmaxes agree often) and a batch
    with a hole inside a block; labels 0..5, in and out of the draft vocab."""
    cfg = dspark_tiny_config(draft_vocab_size=3)
    model = random_dspark_model(cfg).train()
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 16
    ids = torch.randint(0, 6, (B, T), generator=g)
    aux = torch.randn(B, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    final = torch.randn(B, T, cfg.target_hidden_size, generator=g)
    mask = torch.ones(B, T)
    mask[:, :2] = 0
    mask[0, 8] = 0
    mask[1, 13:] = 0
    head = TargetDraftHead(2 * torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=g))
    anchors, valid = sample_anchors(mask, 5, torch.Generator().manual_seed(2))
    return cfg, model, (ids, aux, final, mask, anchors, valid), head


def _dspark_reference(model, cfg, batch, head, spec, accept):
    """The DSpark loss from the whole ``(B, A, Bk, Vd)`` Markov-corrected logits: slot k's CE and
    divergence weighted ``w_k * reach``, its BCE ``w_k``; with draft.opd plus the reverse KL on the
    unreached share."""
    ids, aux, final, mask, anchors, valid = batch
    Bk = cfg.block_size
    w = dspark_slot_weights(Bk, 4.0)
    pos, lab = block_labels(anchors, valid, mask, Bk + 1)
    pos, trained = pos[:, :, 1:], lab[:, :, 1:]  # slot k: x_{a+k+1}, teacher p_{a+k}
    h = model.block_hidden(ids, aux, anchors, valid)  # (B, A, Bk, H)
    prev_pos = (anchors[..., None] + torch.arange(Bk)).clamp(max=ids.shape[1] - 1)  # x_{a+k}: the Markov bias
    e = model.markov_embed(ids.gather(1, prev_pos.flatten(1)).view_as(prev_pos))
    logits = model.markov_logits(h, e).float()
    b = torch.arange(ids.shape[0])[:, None, None]
    teacher = head(final)[b, pos - 1].float()
    tokens = ids.gather(1, pos.flatten(1)).view_as(pos)
    ok = tokens < cfg.draft_vocab_size  # the draft vocab is the first 3 target ids
    ce = F.cross_entropy(logits.flatten(0, 2), torch.where(ok, tokens, 0).flatten(), reduction="none")
    ce = ce.view_as(ok) * ok
    d = spec.distill(teacher, logits)
    alpha = acceptance_probability(torch.log_softmax(teacher, -1), torch.log_softmax(logits, -1)).detach()
    bce = F.binary_cross_entropy_with_logits(model.confidence_logit(h, e), alpha, reduction="none")
    slot_w = w * trained
    reach = _reach(teacher, logits, trained, accept) if accept is not None else torch.ones_like(slot_w)
    total = (slot_w * (reach * (spec.ce_weight * ce + spec.distill_weight * d) + spec.confidence_weight * bce)).sum()
    if accept is not None and accept.opd:
        decay = accept.opd_gamma ** torch.arange(Bk, dtype=torch.float32)
        rkl = _reverse_kl(teacher, logits, spec.distill.target_temperature)
        total = total + spec.distill_weight * (slot_w * (1 - reach) * decay * rkl).sum()
    return total / slot_w.sum(), reach, trained


def _dspark_run(model, cfg, batch, head, spec, accept=None, chunk=6):
    loss, metrics = dspark_loss(model, *batch[:3], batch[3], batch[4], batch[5], head, model.t2d,
                                dspark_slot_weights(cfg.block_size, 4.0), spec, chunk_size=chunk, accept=accept)
    return loss, torch.autograd.grad(loss, _params(model)), metrics


_DSPARK_SPEC = DSparkLossSpec(LossSpec("forward_kl", target_temperature=0.8), 0.2, 0.8, 0.5)


def test_dspark_hard_weights_are_the_cumprod_of_the_earlier_slots_hits_and_soft_is_at_most_one():
    cfg, model, batch, head = _dspark_case()
    spec = _DSPARK_SPEC
    plain, plain_grads, plain_m = _dspark_run(model, cfg, batch, head, spec)
    hard, hard_grads, hard_m = _dspark_run(model, cfg, batch, head, spec, AcceptSpec("hard", 0.0, 4))
    soft0, soft0_grads, soft0_m = _dspark_run(model, cfg, batch, head, spec, AcceptSpec("soft", 0.0, 4))
    soft, _, soft_m = _dspark_run(model, cfg, batch, head, spec, AcceptSpec("soft", 0.8, 4))
    # the hand-computed cumprod of the argmax hits of each block's slots 0..k-1
    with torch.no_grad():
        ids, aux, final, mask, anchors, valid = batch
        logits = model(ids, aux, anchors, valid)  # (B, A, Bk, Vd), slot k -> x_{a+k+1}
        pos, lab = block_labels(anchors, valid, mask, cfg.block_size + 1)
        teacher = head(final)[torch.arange(2)[:, None, None], pos[:, :, 1:] - 1]
        hit = (logits.argmax(-1) == teacher.argmax(-1)).float()
        trained = lab[:, :, 1:]
        a = torch.where(trained, hit, torch.ones(()))
        reach = torch.stack([a[..., :k].prod(-1) for k in range(cfg.block_size)], -1)
    for k in range(cfg.block_size):
        want = (reach[..., k] * trained[..., k]).sum() / trained[..., k].sum()
        assert float(hard_m[f"reach_{k}"]) == pytest.approx(float(want), abs=1e-6)
    assert torch.equal(soft0, hard) and all(torch.equal(g, h) for g, h in zip(soft0_grads, hard_grads))
    assert all(torch.equal(soft0_m[f"reach_{k}"], hard_m[f"reach_{k}"]) for k in range(cfg.block_size))
    assert all(0.0 <= float(soft_m[f"reach_{k}"]) <= 1.0 for k in range(cfg.block_size))
    assert float(hard.detach()) < float(plain.detach()) and float(soft.detach()) < float(plain.detach())  # weights <= 1, terms >= 0
    assert "reach_0" not in plain_m
    # the confidence head calibrates: its BCE keeps the plain weights, so its gradient is unchanged
    conf = [i for i, (n, _) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)
            if n.startswith("confidence_head.")]
    assert conf
    for i in conf:
        torch.testing.assert_close(hard_grads[i], plain_grads[i], rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(h, p) for h, p in zip(hard_grads, plain_grads))


def _todays_dspark_chunk(model, hidden, embed, teacher, teacher_index, labels, label_ok, weight, spec):
    logits = model.markov_logits(hidden, embed).float()  # (C, Vd)
    target = teacher.index_select(0, teacher_index).float()  # (C, Vd)
    alpha = acceptance_probability(torch.log_softmax(target, -1), torch.log_softmax(logits, -1)).detach()
    ce = F.cross_entropy(logits, labels, reduction="none") * label_ok
    row = spec.ce_weight * ce + spec.distill_weight * spec.distill(target, logits)
    if model.confidence_head is not None:
        conf = model.confidence_logit(hidden, embed)
        row = row + spec.confidence_weight * F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
    hit = logits.argmax(-1) == target.argmax(-1)
    return (weight * row).sum(), row.detach(), hit.float(), alpha


def _todays_dspark_rows(model, hidden, embed, targets):
    """``dspark_rows`` as it was before draft.accept_weighting reached DSpark, verbatim."""
    spec = targets.options or DSparkLossSpec()
    rows = chunk_rows(targets.teacher.shape[-1], targets.chunk_size)
    flat = [t.reshape(-1) for t in (targets.teacher_index, targets.labels, targets.label_ok.float(), targets.weight)]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    outs = []
    for s in range(0, hidden.shape[0], rows):
        args = (model, hidden[s:s + rows], embed[s:s + rows], targets.teacher, *(t[s:s + rows] for t in flat), spec)
        outs.append(checkpoint(_todays_dspark_chunk, *args, use_reentrant=False) if grad else _todays_dspark_chunk(*args))
    total = torch.stack([o[0] for o in outs]).sum()
    row_loss, row_hit, row_alpha = (torch.cat([o[i] for o in outs]) for i in (1, 2, 3))
    return DSparkOut(total, row_loss, row_hit, row_alpha)


def test_dspark_none_is_todays_loss_bit_for_bit(monkeypatch):
    cfg, model, batch, head = _dspark_case()
    got = [_dspark_run(model, cfg, batch, head, _DSPARK_SPEC, accept, chunk=5)
           for accept in (None, AcceptSpec("none", 0.0, 4))]
    monkeypatch.setattr(dspark_training, "dspark_rows", _todays_dspark_rows)
    want, want_grads, want_m = _dspark_run(model, cfg, batch, head, _DSPARK_SPEC, chunk=5)
    for loss, grads, metrics in got:
        assert torch.equal(loss, want)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert metrics.keys() == want_m.keys() and not any(key.startswith("reach_") for key in metrics)


def test_dspark_opd_split_changes_the_gradient():
    cfg, model, batch, head = _dspark_case()
    _, plain, _ = _dspark_run(model, cfg, batch, head, _DSPARK_SPEC)
    _, hard, _ = _dspark_run(model, cfg, batch, head, _DSPARK_SPEC, AcceptSpec("hard", 0.0, 4))
    loss, opd, metrics = _dspark_run(model, cfg, batch, head, _DSPARK_SPEC, AcceptSpec("hard", 0.0, 4, OPD_GAMMA))
    assert torch.isfinite(loss) and 0 < float(metrics["reach_2"]) < 1
    assert any(not torch.allclose(o, p) for o, p in zip(opd, plain))
    assert any(not torch.allclose(o, h) for o, h in zip(opd, hard))


# --------------------------------------------------------------------------------------
# XPress


def _xpress_case(seed: int = 1):
    """A tiny XPress draft over a 12-token vocab (mask token 7, tokens 8..11), the target's lm_head its
    own (rows 2.. small: both argmaxes mostly 0 or 1), and a batch with a hole inside a block."""
    V = 12
    cfg = XPressConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3],
                       block_size=4, mask_token_id=7, target_hidden_size=24, num_target_layers=6, rope_theta=500.0,
                       xpress_rank=6, xpress_mlp_ratio=2, num_jacobi_passes=2, xpress_topc=0)
    torch.manual_seed(seed)
    model = XPressDraftModel(cfg)
    emb = torch.randn(V, cfg.hidden_size)
    emb[2:] *= 0.05  # both argmaxes mostly 0 or 1: chains of mixed length
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
        model.init_from_target(torch.randn(V, cfg.hidden_size), lm_head_draft_rows=emb)
        model.set_vocab_mapping(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    B, T = 2, 16
    ids = torch.randint(8, V, (B, T), generator=g)
    aux = torch.randn(B, T, 2 * cfg.target_hidden_size, generator=g)
    final = torch.randn(B, T, cfg.hidden_size, generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :2] = 0
    mask[0, 8] = 0
    mask[1, 13:] = 0
    head = TargetDraftHead(emb.clone())  # the target's lm_head is the draft's (frozen): argmaxes agree often
    anchors, valid = sample_anchors(mask, 5, torch.Generator().manual_seed(2))
    return cfg, model, (ids, aux, final, mask, anchors, valid), head


_XPRESS_SPEC = XPressLossSpec((("ce", 0.2), ("forward_kl", 0.8)), consistency_weight=0.3, consistency_passes=2,
                              base_anchor_weight=0.6, divergence=LossSpec(target_temperature=0.9))


def _xpress_reference(model, cfg, batch, head, spec, accept):
    """The XPress loss from whole logits: every part's slot k weighted ``w_k * reach_k``, the reach
    from the teacher-forced refined logits' hits / expected acceptance; with draft.opd each part's
    unreached share on its own reverse KL."""
    ids, aux, final, mask, anchors, valid = batch
    Bk = cfg.block_size
    weights = slot_weights(Bk, 4.0)
    h = model.block_hidden(ids, aux, anchors, valid)
    B, A = anchors.shape
    pos, lab = block_labels(anchors, valid, mask, Bk)
    teacher, index = teacher_rows(final, pos, head)
    p = teacher[index[:, :, 1:]].float().reshape(B * A, Bk - 1, -1)
    tokens = ids.gather(1, pos.flatten(1)).view_as(pos)
    before = torch.where(anchors > 0, ids.gather(1, (anchors - 1).clamp_min(0)), tokens[..., 0])
    prev = torch.cat([before[..., None], tokens[..., :-1]], -1).reshape(B * A, Bk)
    hb = h.reshape(B * A, Bk, -1)
    trained = lab[:, :, 1:].reshape(B * A, Bk - 1)
    decay_w = weights[1:] * trained
    tf_logits = model.refined_logits(hb, prev)[:, 1:].float()
    reach = _reach(p, tf_logits, trained, accept) if accept is not None else torch.ones_like(decay_w)
    opd = accept is not None and accept.opd
    slot_decay = (accept.opd_gamma if opd else 1.0) ** torch.arange(Bk - 1, dtype=torch.float32)
    terms = dict(spec.terms)

    def L(z, w):  # z (B*A, Bk-1, V)
        z = z.float()
        ce = F.cross_entropy(z.flatten(0, 1), p.argmax(-1).flatten(), reduction="none").view_as(w)
        fkl = spec.divergence(p, z)
        total = (w * reach * (terms["ce"] * ce + terms["forward_kl"] * fkl)).sum()
        if opd:
            total = total + terms["forward_kl"] * (w * (1 - reach) * slot_decay * _reverse_kl(p, z, 0.9)).sum()
        return total / trained.sum()

    base = model.compute_logits(hb)[:, 1:]
    pred, rounds = base.argmax(-1), []
    for _ in range(spec.rounds):
        z = model.refined_logits(hb, torch.cat([prev[:, :2], pred[:, :-1]], 1))[:, 1:]
        rounds.append(L(z, decay_w))
        pred = z.argmax(-1)
    total = L(tf_logits, decay_w) + spec.consistency_weight * torch.stack(rounds).mean() \
        + spec.base_anchor_weight * L(base, decay_w)
    return total, reach.view(B, A, Bk - 1), trained.view(B, A, Bk - 1)


def _xpress_run(model, cfg, batch, head, spec, accept=None, chunk=5):
    loss, metrics = xpress_loss(model, *batch, head, slot_weights(cfg.block_size, 4.0), spec, chunk_size=chunk,
                                accept=accept)
    return loss, torch.autograd.grad(loss, _params(model)), metrics


def test_xpress_soft_at_t0_is_hard_soft_is_at_most_one_and_opd_changes_the_gradient():
    cfg, model, batch, head = _xpress_case()
    plain, plain_grads, _ = _xpress_run(model, cfg, batch, head, _XPRESS_SPEC)
    hard, hard_grads, hard_m = _xpress_run(model, cfg, batch, head, _XPRESS_SPEC, AcceptSpec("hard", 0.0, 3))
    soft0, soft0_grads, soft0_m = _xpress_run(model, cfg, batch, head, _XPRESS_SPEC, AcceptSpec("soft", 0.0, 3))
    soft, _, soft_m = _xpress_run(model, cfg, batch, head, _XPRESS_SPEC, AcceptSpec("soft", 0.8, 3))
    _, opd_grads, _ = _xpress_run(model, cfg, batch, head, _XPRESS_SPEC, AcceptSpec("hard", 0.0, 3, OPD_GAMMA))
    assert torch.equal(soft0, hard) and all(torch.equal(g, h) for g, h in zip(soft0_grads, hard_grads))
    assert all(torch.equal(soft0_m[f"reach_{k}"], hard_m[f"reach_{k}"]) for k in range(3))
    assert all(0.0 <= float(soft_m[f"reach_{k}"]) <= 1.0 for k in range(3))
    assert float(hard.detach()) < float(plain.detach()) and float(soft.detach()) < float(plain.detach())
    assert any(not torch.allclose(o, p) for o, p in zip(opd_grads, plain_grads))
    assert any(not torch.allclose(o, h) for o, h in zip(opd_grads, hard_grads))


def _todays_refined_chunk(model, normed, latent, teacher, teacher_index, weight, spec):
    logits = model.lm_head(normed)
    if latent is not None:
        logits = logits + model.xpress_head.w2(latent)
    logits = logits.float()
    target = teacher.index_select(0, teacher_index).float()
    terms = spec.row_terms(target, logits)
    row = spec.terms[0][1] * terms[0]
    for (_, w), term in zip(spec.terms[1:], terms[1:]):
        row = row + w * term
    argmax = logits.argmax(-1)
    return ((weight * row).sum(), (terms * weight).sum(1).detach(), row.detach(),
            (argmax == target.argmax(-1)).float(), argmax)


def _todays_refined_rows(model, normed, latent, teacher, teacher_index, weight, spec, chunk_size=None):
    rows = chunk_rows(teacher.shape[-1], chunk_size)
    grad = torch.is_grad_enabled() and normed.requires_grad
    outs = []
    for s in range(0, normed.shape[0], rows):
        args = (model, normed[s:s + rows], None if latent is None else latent[s:s + rows], teacher,
                teacher_index[s:s + rows], weight[s:s + rows], spec)
        outs.append(checkpoint(_todays_refined_chunk, *args, use_reentrant=False) if grad
                    else _todays_refined_chunk(*args))
    return RefinedOut(torch.stack([o[0] for o in outs]).sum(), torch.stack([o[1] for o in outs]).sum(0),
                      *(torch.cat([o[i] for o in outs]) for i in (2, 3, 4)))


def _todays_xpress_block_loss(model, hidden, targets):
    """``xpress_block_loss`` as it was before draft.accept_weighting reached XPress, verbatim."""
    spec = targets.options or XPressLossSpec()
    B, A, Bk, H = hidden.shape
    head = model.xpress_head
    normed = model.norm(hidden)
    hcache = head.hidden_cache(normed.reshape(B * A, Bk, H))
    rows = normed[:, :, 1:].reshape(-1, H)
    index = targets.teacher_index.reshape(-1)

    def run(prev, weight):
        latent = None if prev is None else head.latent(prev, hcache)[:, 1:].reshape(-1, head.rank)
        return _todays_refined_rows(model, rows, latent, targets.teacher, index, weight.reshape(-1), spec,
                                    targets.chunk_size)

    base = run(None, targets.base_weight) if spec.base_anchor_weight > 0 else None
    prev = targets.prev.reshape(B * A, Bk)
    tf = run(prev, targets.weight)
    rounds = []
    if spec.rounds:
        pred = base.row_argmax
        for _ in range(spec.rounds):
            out = run(torch.cat([prev[:, :2], pred.view(B * A, Bk - 1)[:, :-1]], dim=1), targets.weight)
            rounds.append(out)
            pred = out.row_argmax
    return XPressOut(tf, rounds, base)


def test_xpress_none_is_todays_loss_bit_for_bit(monkeypatch):
    cfg, model, batch, head = _xpress_case()
    got = [_xpress_run(model, cfg, batch, head, _XPRESS_SPEC, accept) for accept in (None, AcceptSpec("none", 0.0, 3))]
    monkeypatch.setattr(xpress_training, "xpress_block_loss", _todays_xpress_block_loss)
    want, want_grads, want_m = _xpress_run(model, cfg, batch, head, _XPRESS_SPEC)
    for loss, grads, metrics in got:
        assert torch.equal(loss, want)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert all(torch.equal(metrics[key], want_m[key]) for key in want_m)
        assert metrics.keys() == want_m.keys() and not any(key.startswith("reach_") for key in metrics)


# --------------------------------------------------------------------------------------
# Both against their references


_METHODS = {"dspark": (_dspark_case, _dspark_reference, _dspark_run, _DSPARK_SPEC, 4),
            "xpress": (_xpress_case, _xpress_reference, _xpress_run, _XPRESS_SPEC, 3)}


@pytest.mark.parametrize("mode", ["hard", "soft", "opd-hard", "opd-soft"])
@pytest.mark.parametrize("method", ["dspark", "xpress"])
def test_the_loss_and_gradient_equal_the_whole_block_reference(method, mode):
    """DSpark: groups of Bk = 4 (the anchor's slot 0 is the first drafted token: reach_k for slot k),
    chunks of 6 rows -> 4. XPress: groups of Bk - 1 = 3 (reach_{k-1} for slot k, as DFlash), chunks of
    5 rows -> 3. Soft at the served T = 0.8."""
    case, reference, run, spec, group = _METHODS[method]
    accept = AcceptSpec(mode.removeprefix("opd-"), 0.8 if mode.endswith("soft") else 0.0, group,
                        OPD_GAMMA if mode.startswith("opd") else None)
    cfg, model, batch, head = case()
    _assert_matches(model, reference(model, cfg, batch, head, spec, accept), run(model, cfg, batch, head, spec, accept),
                    accept)


# --------------------------------------------------------------------------------------
# The recipe keys and the methods


@pytest.mark.parametrize("method", ["dspark", "xpress"])
def test_the_recipe_takes_both_keys_for_the_method(method):
    for key, value in (("accept_weighting", "hard"), ("accept_weighting", "soft"), ("opd", "hard"), ("opd", "soft")):
        recipe = load_recipe(None, [f"draft.method={method}", f"draft.{key}={value}"])
        assert getattr(recipe.draft, key) == value
    recipe = load_recipe(None, [f"draft.method={method}", "draft.opd=soft", "draft.opd_gamma=0.5",
                                "train.eval_temperatures=[0.6,0.0]"])
    assert AcceptSpec.from_recipe(recipe, group=4) == AcceptSpec("soft", 0.6, 4, 0.5)


@pytest.mark.parametrize("method,group", [("dspark", 8), ("xpress", 15)])
def test_the_methods_pass_the_spec_to_their_loss_in_training_only(monkeypatch, method, group):
    """Slot k's chain: DSpark's every slot (a group of block_size), XPress's slots 1..Bk-1; validation
    (no grad) reports the plain loss."""
    module = {"dspark": dspark_training, "xpress": xpress_training}[method]
    cls = {"dspark": dspark_training.DSparkMethod, "xpress": xpress_training.XPressMethod}[method]
    seen = {}
    monkeypatch.setattr(module, f"{method}_loss", lambda *a, **kw: seen.update(kw) or (None, {}))
    m = cls.__new__(cls)
    m.recipe = load_recipe(None, [f"draft.method={method}", "draft.accept_weighting=hard"])
    m.training_states = lambda model, batch: (batch["aux"], batch["aux"])
    m.target_head = m.t2d = m.weights = m.spec = m.global_denominators = m.accelerator = None
    m.step, m.micro = 0, 0
    model = torch.nn.Linear(2, 2)
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "loss_mask": torch.ones(1, 8),
             "aux": torch.zeros(1, 8, 3)}
    m.compute_loss(model, batch)
    assert seen["accept"] == AcceptSpec("hard", 0.0, group)
    with torch.no_grad():
        m.compute_loss(model, batch)
    assert seen["accept"] is None
