"""``draft.accept_weighting`` (docs/training.md, "Acceptance-aware loss"): EAGLE-3's TTT step k and
DFlash's block slot k weighted by whether the draft's own earlier positions of the same chain hit
(P-EAGLE's depths: tests/unit/test_accept_weighting_peagle.py).

The chunked torch path here (in process); the fused Triton loss against it under Triton's
interpreter is in tests/unit/test_fused_loss.py (its ``accept`` cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models.common import shift_left, ttt_prediction_mask
from draftsmith.models.eagle3.training import eagle3_batch_plan, ttt_loss, ttt_plan
from draftsmith.recipe import RecipeError, load_recipe, recipe_schema
from draftsmith.train.labels import ttt_prediction_masks
from draftsmith.train.losses import AcceptSpec, LossSpec, TargetDraftHead, chunked_distill, group_reach

from helpers.ttt_cases import FixedSteps, dflash_case, host_reads_mode, tiny_eagle3, ttt_batch

K = 3


# --------------------------------------------------------------------------------------
# EAGLE-3


_tiny_eagle3, _batch = tiny_eagle3, ttt_batch


def _todays_ttt_loss(model, batch, head, gamma, loss, chunk):
    """``ttt_loss`` as it was before draft.accept_weighting (its step head verbatim): the reference
    that ``none`` must equal bit for bit."""
    docs = batch.get("document_ids")
    plan = ttt_plan(ttt_prediction_masks(batch["loss_mask"], K, docs))
    counts = plan["ttt_counts_host"]
    final = batch["final_hidden_states"]
    counts_t = plan["ttt_counts"]
    teacher = head(final.flatten(0, 1).index_select(0, plan["ttt_teacher_rows"]))
    denominators = counts_t.clamp_min(1).float()
    index = torch.split(plan["ttt_index"], counts)
    teacher_index = torch.split(plan["ttt_teacher_index"], counts)

    def step_head(k, hidden, logits_fn):
        h = hidden.flatten(0, 1).index_select(0, index[k])
        weight = (gamma**k / denominators[k]).expand(counts[k])
        return chunked_distill(h, logits_fn, teacher, teacher_index[k], weight, loss, chunk, fused=False)

    outs = model(batch["input_ids"], batch["aux_hidden_states"], K, None, None, docs, step_head=step_head)
    return torch.stack([o.loss_sum for o in outs]).sum()


def _run_ttt(model, batch, head, accept, gamma=0.7, loss=None, chunk=5):
    docs = batch.get("document_ids")
    plan = eagle3_batch_plan(batch, K)
    total, metrics = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], batch["final_hidden_states"], plan,
                              K, head, gamma, loss, chunk, None, None, docs, fused=False, accept=accept)
    grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    return total, grads, metrics


@pytest.mark.parametrize("packed", [False, True])
def test_none_is_todays_loss_bit_for_bit(packed):
    model, batch = _tiny_eagle3(), _batch(packed)
    head = TargetDraftHead(torch.randn(12, 32))
    params = [p for p in model.parameters() if p.requires_grad]
    want = _todays_ttt_loss(model, batch, head, 0.7, LossSpec("jsd"), 5)
    want_grads = torch.autograd.grad(want, params)
    for accept in (None, AcceptSpec("none", 0.7)):
        got, grads, metrics = _run_ttt(model, batch, head, accept, loss=LossSpec("jsd"))
        assert torch.equal(got, want)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert not any(key.startswith("reach_") for key in metrics)


def _reference_ttt(model, batch, head, gamma, accept: AcceptSpec):
    """The acceptance-weighted TTT loss from every step's whole ``(B, T, Vd)`` logits: the chain of
    position t is t at every step; a step without a row at t passes it on."""
    docs = batch.get("document_ids")
    steps = model(batch["input_ids"], batch["aux_hidden_states"], K, None, None, docs)
    target = head(batch["final_hidden_states"])  # (B, T, Vd): row t is the distribution of x_{t+1}
    reach = torch.ones(batch["loss_mask"].shape)
    total, reaches = 0.0, []
    for k, logits in enumerate(steps):
        sel = ttt_prediction_mask(batch["loss_mask"], k, docs)
        p = shift_left(target, k + 1)  # the distribution of x_{t+k+2}
        d = LossSpec()(p[sel], logits[sel])
        total = total + gamma**k * (reach[sel] * d).sum() / max(int(sel.sum()), 1)
        reaches.append(reach[sel].mean())
        with torch.no_grad():
            if accept.soft:
                a = torch.minimum(torch.softmax(p / accept.temperature, -1),
                                  torch.softmax(logits / accept.temperature, -1)).sum(-1)
            else:
                a = (logits.argmax(-1) == p.argmax(-1)).float()
            reach = reach * torch.where(sel, a, torch.ones(()))
    return total, reaches


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("accept", [AcceptSpec("hard", 0.0), AcceptSpec("soft", 0.6), AcceptSpec("soft", 0.0)])
def test_the_weighted_loss_equals_the_whole_logits_reference(packed, accept):
    # a draft vocab of 3: the draft's argmax agrees with the target's often enough for chains of mixed length
    model, batch = _tiny_eagle3(2, draft_vocab=3), _batch(packed, seed=3)
    head = TargetDraftHead(torch.randn(3, 32))
    want, reaches = _reference_ttt(model, batch, head, 0.7, accept)
    want_grads = torch.autograd.grad(want, [p for p in model.parameters() if p.requires_grad])
    got, grads, metrics = _run_ttt(model, batch, head, accept)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    for k in range(1, K):
        assert float(metrics[f"reach_{k}"]) == pytest.approx(float(reaches[k]), abs=1e-6)
    if not accept.soft:  # some chains broke and some did not: the case tests something
        assert 0 < float(metrics[f"reach_{K - 1}"]) < 1


_FixedSteps = FixedSteps


def _one_hot_logits(tokens: list[int], V: int, scale: float = 6.0) -> torch.Tensor:
    return scale * F.one_hot(torch.tensor(tokens), V).float()


def _hand_built(hits: dict[int, set[int]], loss_mask: torch.Tensor, V: int = 7):
    """B = 1: the target's argmax of x_{p+1} is ``p % V``; step k at t drafts the target's token
    where t is in ``hits[k]``, another one elsewhere."""
    T = loss_mask.shape[1]
    final = _one_hot_logits([p % V for p in range(T)], V)[None]  # (1, T, V): row p -> x_{p+1}
    hidden = []
    for k in range(K):
        want = [(t + k + 1) % V for t in range(T)]
        hidden.append(_one_hot_logits([w if t in hits[k] else (w + 1) % V for t, w in enumerate(want)], V)[None]
                      + 0.3 * torch.randn(1, T, V, generator=torch.Generator().manual_seed(k)))
    model = _FixedSteps(hidden)
    batch = {"input_ids": torch.zeros(1, T, dtype=torch.long), "loss_mask": loss_mask,
             "aux_hidden_states": torch.zeros(1, T, 3), "final_hidden_states": final}
    return model, batch


@pytest.mark.parametrize("mode", ["hard", "soft-T0"])
def test_hard_zeroes_the_rows_of_step_k_after_a_miss_at_an_earlier_step(mode):
    T = 10
    # steps 0..2 have rows t <= 7, 6, 5; step 0 misses at t = 1, step 1 at t = 2 (step 1 hits at t = 1:
    # step 2's row there is cut by step 0's miss alone, through the product)
    everything = set(range(T))
    model, batch = _hand_built({0: everything - {1}, 1: everything - {2}, 2: everything}, torch.ones(1, T))
    accept = AcceptSpec("hard", 0.0) if mode == "hard" else AcceptSpec("soft", 0.0)  # soft at T = 0 is hard
    plan = eagle3_batch_plan(batch, K)
    total, metrics = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], batch["final_hidden_states"],
                              plan, K, lambda rows: rows, 1.0, None, 4, None, None, None, fused=False, accept=accept)
    total.backward()
    rows_of = {k: T - k - 2 for k in range(K)}  # t = 0 .. T-k-3
    broken = {0: set(), 1: {1}, 2: {1, 2}}
    for k in range(K):
        grad = model.hidden[k].grad[0]  # (T, V)
        for t in range(rows_of[k]):
            assert bool(grad[t].any()) == (t not in broken[k]), (k, t)
        assert not grad[rows_of[k]:].any()  # no row past the step's last
    assert float(metrics["reach_1"]) == pytest.approx(1 - 1 / rows_of[1])
    assert float(metrics["reach_2"]) == pytest.approx(1 - 2 / rows_of[2])
    # the denominators stay M_k: the loss is today's minus the dropped rows' share
    none, _ = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], batch["final_hidden_states"],
                       plan, K, lambda rows: rows, 1.0, None, 4, None, None, None, fused=False)
    assert float(total.detach()) < float(none.detach())


def test_a_step_without_a_row_passes_the_chain_on():
    T = 10
    mask = torch.ones(1, T)
    mask[0, 4] = 0  # x_4 untrained: no row of step 0 at t = 2, of step 1 at t = 1, of step 2 at t = 0
    everything = set(range(T))
    model, batch = _hand_built({0: everything - {3}, 1: everything - {4}, 2: everything}, mask)
    plan = eagle3_batch_plan(batch, K)
    total, _ = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], batch["final_hidden_states"],
                        plan, K, lambda rows: rows, 1.0, None, None, None, None, None, fused=False,
                        accept=AcceptSpec("hard", 0.0))
    total.backward()
    grad1, grad2 = model.hidden[1].grad[0], model.hidden[2].grad[0]
    assert not grad1[1].any() and not grad2[0].any()  # no rows there
    assert grad1[2].any()  # step 0 has no row at t = 2: reached
    assert not grad1[3].any() and grad1[4].any()  # step 0 missed at 3
    assert grad2[1].any()  # t = 1: step 0 hit, step 1 has no row (factor 1): still reached
    assert grad2[2].any()  # t = 2: step 0 has no row, step 1 hit
    assert not grad2[3].any() and not grad2[4].any()  # step 0 missed at 3, step 1 at 4
    assert grad2[5].any()


def test_accept_weighting_reads_nothing_from_the_device():
    model, batch = _tiny_eagle3(), _batch(True)
    head = TargetDraftHead(torch.randn(12, 32))
    plan = eagle3_batch_plan(batch, K)  # the DataLoader's, outside the step
    for accept in (AcceptSpec("hard", 0.0), AcceptSpec("soft", 0.7)):
        mode = host_reads_mode()
        with mode:
            total, _ = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], batch["final_hidden_states"],
                                plan, K, head, 0.8, None, 5, None, None, batch["document_ids"], fused=False,
                                accept=accept)
            total.backward()
        assert mode.seen == []


# --------------------------------------------------------------------------------------
# the shared pieces


def test_group_reach_is_the_exclusive_product_within_each_group():
    factor = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.2, 1.0, 1.0])
    trained = torch.tensor([True, True, True, True, True, True, True, False, True])
    reach = group_reach(factor, ~trained, 3)
    torch.testing.assert_close(reach, torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 0.2, 0.2]))


def test_soft_factor_is_the_expected_acceptance_at_the_served_temperature():
    torch.manual_seed(0)
    x, w, t = torch.randn(6, 5), torch.randn(9, 5), torch.randn(4, 9) * 2
    idx = torch.tensor([0, 1, 2, 3, 0, 1])
    out = chunked_distill(x, lambda h: F.linear(h, w), t, idx, torch.ones(6), LossSpec(target_temperature=0.5),
                          chunk_size=4, fused=False, accept=AcceptSpec("soft", 0.7))
    p, q = torch.softmax(t[idx] / 0.7, -1), torch.softmax(F.linear(x, w) / 0.7, -1)  # not distill_temperature's
    torch.testing.assert_close(out.row_alpha, torch.minimum(p, q).sum(-1))
    # hard / soft at T = 0 without a group: nothing beyond the loss is computed
    for accept in (AcceptSpec("hard", 0.7), AcceptSpec("soft", 0.0)):
        plain = chunked_distill(x, lambda h: F.linear(h, w), t, idx, torch.ones(6), chunk_size=4, fused=False,
                                accept=accept)
        assert plain.row_alpha is None and plain.row_reach is None


# --------------------------------------------------------------------------------------
# DFlash


_dflash_case = dflash_case


@pytest.mark.parametrize("accept", [AcceptSpec("hard", 0.0, 4), AcceptSpec("soft", 0.8, 4)])
def test_dflash_slot_k_weighs_the_product_over_the_earlier_slots_of_its_block(accept):
    from draftsmith.models.dflash.training import block_labels, dflash_loss, sample_anchors, slot_weights

    cfg, model, ids, aux, final, mask, head = _dflash_case()
    Bk = cfg.block_size
    anchors, valid = sample_anchors(mask, 6, torch.Generator().manual_seed(2))
    w = slot_weights(Bk, 4.0)
    # the reference from the whole block logits
    label_pos, label_mask = block_labels(anchors, valid, mask, Bk)
    logits = model(ids, aux, anchors, valid)[:, :, 1:]  # (B, A, Bk-1, Vd)
    b = torch.arange(ids.shape[0])[:, None, None]
    teacher = head(final)[b, (label_pos[:, :, 1:] - 1).clamp_min(0)]  # (B, A, Bk-1, Vd)
    d = LossSpec()(teacher, logits)
    trained = label_mask[:, :, 1:]
    with torch.no_grad():
        if accept.soft:
            a = torch.minimum(torch.softmax(teacher / accept.temperature, -1),
                              torch.softmax(logits / accept.temperature, -1)).sum(-1)
        else:
            a = (logits.argmax(-1) == teacher.argmax(-1)).float()
        a = torch.where(trained, a, torch.ones(()))
        reach = torch.cat([torch.ones_like(a[..., :1]), a[..., :-1].cumprod(-1)], -1)
    slot_w = w[1:] * trained
    want = (slot_w * reach * d).sum() / slot_w.sum()
    want_grads = torch.autograd.grad(want, [p for p in model.parameters() if p.requires_grad])

    got, metrics = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w, None, chunk_size=6,
                               accept=accept)  # chunks of 6 rows hold whole groups of 4: 4 per chunk
    grads = torch.autograd.grad(got, [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, ref in zip(grads, want_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    for k in range(Bk - 1):
        n = trained[..., k].sum().clamp_min(1)
        assert float(metrics[f"reach_{k}"]) == pytest.approx(float((reach[..., k] * trained[..., k]).sum() / n), abs=1e-6)
    if not accept.soft:
        assert 0 < float(metrics[f"reach_{Bk - 2}"]) < 1

    plain, _ = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w, None, chunk_size=6)
    none, _ = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w, None, chunk_size=6,
                          accept=AcceptSpec("none"))
    assert torch.equal(plain, none)
    assert torch.allclose(plain, (slot_w * d).sum() / slot_w.sum(), rtol=1e-5)


# --------------------------------------------------------------------------------------
# the recipe key


def test_the_recipe_key_its_methods_and_the_served_temperature():
    assert load_recipe(None).draft.accept_weighting == "none"
    recipe = load_recipe(None, ["draft.accept_weighting=soft", "train.eval_temperatures=[0.6,0.0]"])
    assert AcceptSpec.from_recipe(recipe) == AcceptSpec("soft", 0.6, 0)
    assert AcceptSpec.from_recipe(load_recipe(None)) is None
    for method in ("dflash", "dflash2", "dspark", "xpress", "peagle"):
        assert load_recipe(None, [f"draft.method={method}", "draft.accept_weighting=hard"]).draft.accept_weighting == "hard"
    for method in ("medusa", "mlp_speculator"):  # methods without the key: the same one line
        with pytest.raises(RecipeError, match=rf"draft.accept_weighting: not supported by draft.method {method} "
                                              rf"\(supported: eagle3, dflash, dflash2, dspark, xpress, peagle;"):
            load_recipe(None, [f"draft.method={method}", "draft.accept_weighting=hard"])
        with pytest.raises(RecipeError, match=rf"draft.opd: on-policy distillation is not supported by "
                                              rf"draft.method {method} \(supported: eagle3, dflash, dflash2, dspark, xpress, peagle\)"):
            load_recipe(None, [f"draft.method={method}", "draft.opd=hard"])
    with pytest.raises(RecipeError, match="Input should be 'none', 'hard' or 'soft'"):
        load_recipe(None, ["draft.accept_weighting=yes"])
    keys = {row["key"] for row in recipe_schema()}
    assert "draft.accept_weighting" in keys


def test_the_methods_pass_the_recipe_key_to_their_loss(monkeypatch):
    from draftsmith.models.eagle3 import training as eagle3_training

    seen = {}
    monkeypatch.setattr(eagle3_training, "ttt_loss", lambda *a, **kw: seen.update(kw) or (None, {}))
    method = eagle3_training.Eagle3Method.__new__(eagle3_training.Eagle3Method)
    method.recipe = load_recipe(None, ["draft.accept_weighting=hard", "draft.ttt_steps=3"])
    method.training_states = lambda model, batch: (batch["aux_hidden_states"], batch["final_hidden_states"])
    method.target_head, method.loss, method.global_denominators = None, None, None
    method.compute_loss(None, _batch(False))
    assert seen["accept"] == AcceptSpec("hard", 0.0, 0)


def test_dflash2_weights_its_dflash_term_and_keeps_the_selector_term():
    from draftsmith.models.dflash.training import dflash_loss, sample_anchors, slot_weights
    from draftsmith.models.dflash2.config import DFlash2Config
    from draftsmith.models.dflash2.model import DFlash2DraftModel
    from draftsmith.models.dflash2.training import dflash2_loss

    V = 40
    cfg = DFlash2Config(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3],
                        block_size=4, mask_token_id=7, target_hidden_size=24, num_target_layers=6, rope_theta=500.0,
                        conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    torch.manual_seed(0)
    model = DFlash2DraftModel(cfg)
    with torch.no_grad():
        model.init_from_target(torch.randn(V, 32))
        model.set_vocab_mapping(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, V, (2, 14), generator=gen)
    aux, final = torch.randn(2, 14, 48, generator=gen), torch.randn(2, 14, 32, generator=gen)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[:, :3] = 0
    head = TargetDraftHead(3 * torch.randn(V, 32, generator=gen))
    anchors, valid = sample_anchors(mask, 4, torch.Generator().manual_seed(1))
    w, accept = slot_weights(4, 4.0), AcceptSpec("hard", 0.0, 3)
    args = (model, ids, aux, final, mask, anchors, valid, head, w)
    plain, plain_m = dflash2_loss(*args, alpha=0.7)
    hard, hard_m = dflash2_loss(*args, alpha=0.7, accept=accept)
    dflash_term, _ = dflash_loss(*args, accept=accept)
    assert torch.equal(hard_m["dflash_loss"], dflash_term.detach())
    assert float(hard_m["dflash_loss"]) < float(plain_m["dflash_loss"])
    assert torch.equal(hard_m["selector_loss"], plain_m["selector_loss"])
    torch.testing.assert_close(hard, dflash_term + 0.7 * hard_m["selector_loss"])
    assert float(hard_m["reach_0"]) == 1.0 and float(hard_m["reach_2"]) < 1.0  # slot 1 always counts
