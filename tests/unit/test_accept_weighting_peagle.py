"""``draft.accept_weighting`` and ``draft.opd`` on P-EAGLE (docs/training.md, "Acceptance-aware loss"):
the COD element (anchor a, depth d) weighted by the detached product over its chain's depths j < d
of the argmax hit (hard) or the expected acceptance (soft), one loss call per depth.

The chunked torch path here (in process); the fused Triton loss against it under Triton's
interpreter is in tests/unit/test_fused_loss.py (its ``peagle_accept`` cases)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models.common import DistillTargets, shift_left
from draftsmith.models.peagle import training
from draftsmith.models.peagle.training import cod_loss, cod_targets, step0_prediction_mask
from draftsmith.train.losses import AcceptSpec, LossSpec, chunked_distill

from helpers import REPO
from helpers.ttt_cases import host_reads_mode, peagle_case, reference_acceptance

D = 4


def _draw(method, batch, planned: bool):
    """The batch (with the DataLoader's plan when ``planned``) and the elements the next step draws."""
    if planned:
        batch = {**batch, **method.batch_plan()(batch)}
    method._micro = 0
    _, elements = method.sample(batch)
    method._micro = 0  # compute_loss draws the same elements again
    return batch, elements


def _todays_compute_loss(method, model, batch):
    """``PEagleMethod.compute_loss`` as it was before draft.accept_weighting (verbatim): the reference
    that ``none`` must equal bit for bit."""
    import functools

    aux, final = method.training_states(model, batch)
    pred, elements = method.sample(batch)
    sel = cod_targets(elements, pred)
    B, T = pred.shape
    shifted = final[:, 1:] if T > 1 else final
    teacher = method.target_head(shifted).reshape(-1, method.target_head.weight.shape[0])
    per_row = shifted.shape[1]
    index = elements.pos.clamp_max(per_row - 1) + per_row * torch.arange(B, device=pred.device).unsqueeze(1)
    weight = (sel.float() / method.denominator(sel.sum())).reshape(-1)
    index, depth, sel = index.reshape(-1), elements.depth.reshape(-1), sel.reshape(-1)
    train_rows = None
    if "cod_rows0" in batch:
        S = elements.anchor.shape[1]
        r0 = batch["cod_rows0"]
        deeper = torch.arange(T, S, device=pred.device) + S * torch.arange(B, device=pred.device).unsqueeze(1)
        train_rows = torch.cat([r0 // T * S + r0 % T, deeper.reshape(-1)])
        index, weight, depth, sel = (t.index_select(0, train_rows) for t in (index, weight, depth, sel))
    out = model(batch["input_ids"], aux, elements, batch.get("position_ids"), batch.get("document_ids"),
                targets=DistillTargets(teacher, index, weight,
                                       functools.partial(chunked_distill,
                                                         fused=getattr(method.recipe.train, "fused_loss", None)),
                                       method.loss, rows=train_rows))
    return cod_loss(out, depth, sel, method.recipe.draft.num_depths)


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def _step(method, model, batch, spy=None):
    """``compute_loss`` and its gradients; with ``spy`` (a dict) also the DepthTargets and the DistillOut
    the step built (``spy["targets"]``, ``spy["out"]``)."""
    if spy is None:
        loss, metrics = method.compute_loss(model, batch)
        return loss, _grads(model, loss), metrics
    build, metric = training.depth_targets, training.cod_loss

    def depth_targets(*args, **kwargs):
        spy["targets"] = build(*args, **kwargs)
        return spy["targets"]

    def cod_loss_spy(out, *args):
        spy["out"] = out
        return metric(out, *args)

    training.depth_targets, training.cod_loss = depth_targets, cod_loss_spy
    try:
        loss, metrics = method.compute_loss(model, batch)
    finally:
        training.depth_targets, training.cod_loss = build, metric
    return loss, _grads(model, loss), metrics


def _chain_reach(elements, trained: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` by hand: element (a, d) of row b gets ``prod_{j<d} factor`` of its chain's depth-j element
    (found by its anchor and depth), an untrained one counting 1."""
    B, S = elements.anchor.shape
    T = int((elements.depth[0] == 0).sum() - (~elements.valid[0]).sum())  # the depth-0 slots: positions 0..T-1
    reach = torch.ones(B, S)
    for b in range(B):
        slot = {(int(elements.anchor[b, s]), int(elements.depth[b, s])): s
                for s in range(S) if elements.valid[b, s]}
        assert all(slot[(i, 0)] == i for i in range(T))
        for s in range(S):
            a, d = int(elements.anchor[b, s]), int(elements.depth[b, s])
            if not elements.valid[b, s]:
                continue
            for j in range(d):
                prev = slot[(a, j)]  # COD: every earlier depth of the chain is an element
                if trained[b, prev]:
                    reach[b, s] *= float(factor[b, prev])
    return reach


def _reference(method, model, batch, elements, accept: AcceptSpec):
    """The weighted loss from the whole ``(B, S, Vd)`` logits, the reach by hand (:func:`_chain_reach`):
    ``sum_trained w * (reach * D + [opd] (1 - reach) * opd_gamma**d * KL(q || p)) / N``."""
    docs = batch.get("document_ids")
    pred = step0_prediction_mask(batch["loss_mask"], docs)
    sel = cod_targets(elements, pred)
    hidden = model(batch["input_ids"], batch["aux_hidden_states"], elements, batch.get("position_ids"), docs)
    logits = model.compute_logits(hidden)  # (B, S, Vd)
    teacher = method.target_head(shift_left(batch["final_hidden_states"], 1))  # row p: the distribution of x_{p+2}
    target = teacher.gather(1, elements.pos.unsqueeze(-1).expand(-1, -1, teacher.shape[-1]))
    d = LossSpec()(target, logits)
    reach = _chain_reach(elements, sel, reference_acceptance(target, logits.detach(), accept))
    w = sel.float() / sel.sum()
    total = (w * reach * d).sum()
    if accept.opd:
        rkl = LossSpec("reverse_kl")(target, logits)
        total = total + (w * (1 - reach) * accept.opd_gamma ** elements.depth * rkl).sum()
    return total, reach, sel


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_none_is_todays_loss_bit_for_bit(packed, planned):
    method, model, batch = peagle_case(packed=packed)
    batch, _ = _draw(method, batch, planned)
    want, want_metrics = _todays_compute_loss(method, model, batch)
    want_grads = _grads(model, want)
    method._micro = 0
    got, grads, metrics = _step(method, model, batch)
    assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    assert metrics.keys() == want_metrics.keys() and not any(k.startswith("reach_") for k in metrics)
    assert all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
    # validation (no grad) reports the plain loss with the key set, as DFlash's
    method.recipe.draft.accept_weighting = "hard"
    method._micro = 0
    with torch.no_grad():
        plain, plain_metrics = method.compute_loss(model, batch)
    assert torch.equal(plain, want.detach()) and "reach_1" not in plain_metrics


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["hard", "soft", "opd-hard", "opd-soft"])
def test_each_element_weighs_the_product_over_its_chain_s_earlier_depths(mode, packed, planned):
    opd = mode.startswith("opd-")
    split = mode.removeprefix("opd-")
    keys = {"opd": split} if opd else {"accept_weighting": split}
    temperature = 0.7 if split == "soft" else 0.0
    method, model, batch = peagle_case(packed=packed, temperature=temperature, **keys)
    accept = AcceptSpec(split, temperature, 0, 0.8 if opd else None)
    assert AcceptSpec.from_recipe(method.recipe) == accept
    batch, elements = _draw(method, batch, planned)
    want, want_reach, trained = _reference(method, model, batch, elements, accept)
    want_grads = _grads(model, want)
    spy = {}
    got, grads, metrics = _step(method, model, batch, spy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # the weights themselves, element by element: the reach each row's loss was multiplied by
    targets, out = spy["targets"], spy["out"]
    B, S = elements.anchor.shape
    assert targets.counts == [targets.counts[0]] + [B * k for k in method.depth_budgets(24, batch)]
    assert len(targets.counts) == D and targets.counts[0] == (int(batch["cod_rows0"].numel()) if planned else B * 24)
    reach = torch.full((B * S,), -1.0).index_copy(0, targets.rows, out.row_reach).view(B, S)
    torch.testing.assert_close(reach[trained], want_reach[trained], rtol=1e-5, atol=1e-6)
    assert float(reach.max()) <= 1.0 and float(reach[trained].min()) >= 0.0
    for d in range(1, D):
        at = trained & (elements.depth == d)
        assert float(metrics[f"reach_{d}"]) == pytest.approx(float(want_reach[at].mean()), abs=1e-6)
    assert "reach_0" not in metrics
    if split == "hard":  # chains cut and chains kept at the deepest depth: the case tests something
        deepest = want_reach[trained & (elements.depth == D - 1)]
        assert 0 < float(deepest.mean()) < 1 and set(deepest.unique().tolist()) == {0.0, 1.0}
    else:
        assert 0 < float(want_reach[trained & (elements.depth == D - 1)].max()) < 1


def test_soft_at_t0_is_hard_and_soft_weighs_no_more_than_one():
    runs = {}
    for name, keys in (("hard", {"accept_weighting": "hard"}), ("soft0", {"accept_weighting": "soft"}),
                       ("soft", {"accept_weighting": "soft", "temperature": 0.7})):
        method, model, batch = peagle_case(**keys)
        batch, _ = _draw(method, batch, True)
        spy = {}
        loss, _, _ = _step(method, model, batch, spy)
        runs[name] = (loss, spy["out"].row_reach, spy["out"].row_alpha)
    assert torch.equal(runs["soft0"][0], runs["hard"][0]) and torch.equal(runs["soft0"][1], runs["hard"][1])
    assert runs["hard"][2] is None and runs["soft0"][2] is None  # T = 0: no softmax at T computed
    reach, alpha = runs["soft"][1], runs["soft"][2]
    assert float(reach.max()) <= 1.0 and float(reach.min()) >= 0.0 and 0 < float(alpha.min()) and float(alpha.max()) < 1


def test_the_denominator_is_unchanged_and_unreached_rows_weigh_zero():
    """Every trained element still counts in N: the hard loss is the plain one minus the unreached rows'
    share, and an unreached row gets no gradient."""
    method, model, batch = peagle_case(accept_weighting="hard")
    batch, elements = _draw(method, batch, True)
    spy = {}
    hard, _, _ = _step(method, model, batch, spy)
    row_loss, reach, weight = spy["out"].row_loss, spy["out"].row_reach, spy["targets"].weight
    method.recipe.draft.accept_weighting = "none"
    method._micro = 0
    plain, _, _ = _step(method, model, batch)
    torch.testing.assert_close(plain.detach(), (weight * row_loss).sum())
    torch.testing.assert_close(hard.detach(), (weight * reach * row_loss).sum())
    assert float(hard.detach()) < float(plain.detach())


def test_the_weighted_step_reads_nothing_from_the_device():
    for keys in ({"accept_weighting": "hard"}, {"accept_weighting": "soft", "temperature": 0.7}, {"opd": "soft"}):
        method, model, batch = peagle_case(**keys)
        batch = {**batch, **method.batch_plan()(batch)}  # the DataLoader's, outside the step
        with host_reads_mode() as mode:
            loss, metrics = method.compute_loss(model, batch)
            loss.backward()
        assert mode.seen == [] and "reach_3" in metrics


def test_the_recipe_takes_the_keys_for_peagle():
    from draftsmith.recipe import RecipeError, load_recipe

    recipe = load_recipe(None, ["draft.method=peagle", "draft.accept_weighting=soft", "train.eval_temperatures=[0.6]"])
    assert AcceptSpec.from_recipe(recipe) == AcceptSpec("soft", 0.6, 0)
    recipe = load_recipe(None, ["draft.method=peagle", "draft.opd=hard", "draft.opd_gamma=0.5"])
    assert AcceptSpec.from_recipe(recipe) == AcceptSpec("hard", float(recipe.validation_temperatures[0]), 0, 0.5)
    with pytest.raises(RecipeError, match="set draft.accept_weighting=none"):
        load_recipe(None, ["draft.method=peagle", "draft.opd=hard", "draft.accept_weighting=hard"])


def test_the_dry_run_counts_an_lm_head_gradient_per_depth():
    from draftsmith.recipe import load_recipe
    from draftsmith.train.dry_run import Shapes

    s = Shapes(B=2, T=256, H=64, Ht=64, I=128, nh=4, nkv=2, hd=16, Vd=256, V=512, n_aux=3, precision="amp-bf16",
               param_bytes=4, act_bytes=2, hidden_state_bytes=2, target_bytes=2, checkpointing=False, packing=True)

    def gradients(*sets: str) -> int:
        recipe = load_recipe(None, ["draft.method=peagle", "train.fused_loss=true", *sets])
        return training.activation_estimate(recipe, s, 0)["fused_loss_gradients"]

    recipe = load_recipe(None, ["draft.method=peagle", "draft.accept_weighting=hard"])
    calls = training.loss_calls(recipe, s.T)
    assert calls == recipe.draft.num_depths == training.loss_calls(load_recipe(None, ["draft.method=peagle",
                                                                                      "draft.opd=soft"]), s.T)
    assert training.loss_calls(load_recipe(None, ["draft.method=peagle"]), s.T) == 1
    assert gradients("draft.accept_weighting=hard") - gradients() == (calls - 1) * s.Vd * s.H * s.act_bytes


def test_bench_step_counts_the_same_matmuls_and_no_host_read(tmp_path):
    """``draftsmith bench step``'s count (fake CUDA, the fused loss) of a tiny P-EAGLE step: with
    draft.accept_weighting (and draft.opd) one ``distill_rows`` kernel per depth instead of one in all,
    the same matmul FLOPs (each row through the lm_head once), no host read."""
    import json

    from benchmarks.memory import Precision
    from benchmarks.step import build_parser, count_step, load

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
                                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0}))
    recipe_path = REPO / "recipes/smollm2_135m_peagle.yaml"

    def count(*sets: str):
        args = build_parser().parse_args([str(recipe_path), "--target-config", str(config), "--batch-size", "2",
                                          "--max-length", "32", "--set", "data.draft_vocab_size=256", "--set",
                                          "data.aux_layer_ids=[1,2,3]", *sum((["--set", s] for s in sets), [])])
        recipe, config_json, _, launch = load(args.recipe, list(args.overrides), args)
        c = count_step(recipe, config_json, Precision.of(launch, args.precision))
        assert c.extra["loss_path"] == "fused" and c.host_syncs == 0
        kernels = sum(s.count for s in c.stats if "distill_rows" in s.name)
        return kernels, sum(s.flops * s.count for s in c.stats), sum(s.count for s in c.stats), recipe

    plain, hard, opd = count(), count("draft.accept_weighting=hard"), count("draft.opd=hard")
    depths = training.loss_calls(hard[3], 32)
    assert plain[0] == 1 and hard[0] == opd[0] == depths == hard[3].draft.num_depths
    assert plain[1] == hard[1] == opd[1] > 0
    assert plain[2] < hard[2] < opd[2]
