"""draft.loss: every divergence's value and gradient on a hand-made case, worked out here in
plain Python (no torch), and the recipe / training wiring."""

import math

import pytest
import torch

from draftsmith.recipe import Recipe, RecipeError, load_recipe
from draftsmith.train.losses import LOSSES, LossSpec, acceptance_probability, divergence

from helpers.reference_losses import ttt_loss

P = [0.5, 0.3, 0.2]  # target distribution
Q = [0.2, 0.3, 0.5]  # draft distribution: draft logits log(Q) (softmax(log Q) = Q)


def softmax_grad(dl_dq: list[float], q: list[float]) -> list[float]:
    """dL/dz for q = softmax(z): sum_i dL/dq_i * q_i (delta_ij - q_j)."""
    inner = sum(g * qi for g, qi in zip(dl_dq, q))
    return [qj * (gj - inner) for gj, qj in zip(dl_dq, q)]


def expected(kind: str) -> tuple[float, list[float]]:
    """(value, d value / d draft logits) of each divergence at (P, Q), by hand."""
    fkl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    alpha = sum(min(p, q) for p, q in zip(P, Q))  # 0.2 + 0.3 + 0.2 = 0.7
    # d(1 - alpha)/dq_i = -1 where q_i < p_i (q_i is the min), 0 where q_i > p_i; ties (0.3)
    # take torch.minimum's even split of the gradient: -1/2
    dtv_dq = [-1.0 if q < p else (-0.5 if q == p else 0.0) for p, q in zip(P, Q)]
    dtv = softmax_grad(dtv_dq, Q)
    if kind == "forward_kl":
        return fkl, [q - p for p, q in zip(P, Q)]
    if kind == "reverse_kl":
        rkl = sum(q * math.log(q / p) for p, q in zip(P, Q))
        return rkl, [q * (math.log(q / p) - rkl) for p, q in zip(P, Q)]
    if kind == "jsd":
        M = [(p + q) / 2 for p, q in zip(P, Q)]
        value = 0.5 * sum(p * math.log(p / m) for p, m in zip(P, M)) + 0.5 * sum(q * math.log(q / m) for q, m in zip(Q, M))
        return value, softmax_grad([0.5 * math.log(q / m) for q, m in zip(Q, M)], Q)
    if kind == "tv":
        return 1 - alpha, dtv
    if kind == "lk_alpha":
        return -math.log(alpha), [g / alpha for g in dtv]
    if kind == "lk_lambda":
        w = 2.0 * math.exp(-3.0 * alpha)  # lk_kl_scale 2, lk_kl_decay 3; alpha is not differentiated in w
        return w * fkl + 1 - alpha, [w * (q - p) + g for p, q, g in zip(P, Q, dtv)]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", LOSSES)
def test_divergence_value_and_gradient_by_hand(kind):
    target = torch.tensor([P]).log()
    draft = torch.tensor([Q]).log().requires_grad_(True)
    value = divergence(kind, target, draft, lk_kl_scale=2.0, lk_kl_decay=3.0)
    value.sum().backward()
    want, want_grad = expected(kind)
    assert value.shape == (1,)
    assert value.item() == pytest.approx(want, abs=1e-6)
    assert draft.grad[0].tolist() == pytest.approx(want_grad, abs=1e-6)


@pytest.mark.parametrize("kind", LOSSES)
def test_divergence_is_zero_where_the_draft_is_the_target_and_positive_elsewhere(kind):
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    assert divergence(kind, target, target + 3.0).abs().max() < 1e-5  # softmax is shift invariant
    assert (divergence(kind, target, draft) > 1e-4).all()


def test_lk_alpha_is_cross_entropy_at_a_one_hot_target_and_finite_at_zero_overlap():
    draft = torch.tensor([[0.1, 2.0, -1.0]])
    one_hot = torch.tensor([[0.0, -1e4, -1e4]])
    ce = torch.nn.functional.cross_entropy(draft, torch.tensor([0]))
    assert divergence("lk_alpha", one_hot, draft).item() == pytest.approx(ce.item(), abs=1e-5)
    disjoint = divergence("lk_alpha", torch.tensor([[0.0, -1e4]]), torch.tensor([[-1e4, 0.0]]))
    assert torch.isfinite(disjoint).all() and disjoint.item() > 10


def test_acceptance_probability_is_one_minus_total_variation():
    log_p, log_q = torch.tensor(P).log(), torch.tensor(Q).log()
    assert acceptance_probability(log_p, log_q).item() == pytest.approx(0.7)
    tv = 0.5 * sum(abs(p - q) for p, q in zip(P, Q))
    assert acceptance_probability(log_p, log_q).item() == pytest.approx(1 - tv)


def test_unknown_loss_names_the_choices():
    with pytest.raises(ValueError, match="forward_kl, reverse_kl"):
        divergence("kl", torch.zeros(1, 2), torch.zeros(1, 2))


def test_ttt_loss_uses_the_recipe_divergence():
    """The step loss of ttt_loss is the chosen divergence's mean over the step's positions."""
    g = torch.Generator().manual_seed(1)
    B, T, V = 1, 6, 7
    target_logits = torch.randn(B, T, V, generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    # step 0 at position t predicts x_{t+2}: positions 0..3 (loss_mask at t+2)
    draft = torch.randn(4, V, generator=g)
    for kind in ("forward_kl", "tv", "lk_alpha"):
        total, m = ttt_loss([draft], target_logits, loss_mask, loss=LossSpec(kind))
        want = divergence(kind, target_logits[0, 1:5], draft).mean()
        assert total.item() == pytest.approx(want.item(), rel=1e-6)
        assert m.tokens == [4]


def test_recipe_takes_the_losses_and_refuses_them_for_hard_label_heads():
    r = Recipe.model_validate({"draft": {"loss": "lk_lambda", "lk_kl_scale": 0.5}})
    assert LossSpec.from_recipe(r.draft) == LossSpec("lk_lambda", 0.5, 3.0)
    with pytest.raises(RecipeError, match="draft.loss: Input should be 'forward_kl'"):
        load_recipe(None, ["draft.loss=l2"])
    # medusa / mlp_speculator heads train on hard labels: their sections have no loss key
    with pytest.raises(RecipeError, match=r"draft.loss: unknown key for draft.method medusa "
                                          r"\(a key of eagle3 / dflash / peagle / dspark / dflash2 / xpress / mtp\)"):
        load_recipe(None, ["draft.method=medusa", "draft.loss=jsd"])


def test_distill_temperature_sharpens_the_target_side_only():
    """p = softmax(target / tau), worked out by hand at (P, Q); tau 1 is the plain divergence and
    a small tau turns forward KL into cross-entropy on the target's argmax (token 0 of P)."""
    target = torch.tensor([P]).log().requires_grad_(False)
    draft = torch.tensor([Q]).log().requires_grad_(True)
    tau = 0.5
    sharp = [p ** (1 / tau) for p in P]
    sharp = [v / sum(sharp) for v in sharp]  # softmax(log P / tau) = P^(1/tau), renormalised
    want = sum(p * math.log(p / q) for p, q in zip(sharp, Q))
    got = LossSpec("forward_kl", target_temperature=tau)(target, draft)
    assert got.item() == pytest.approx(want, rel=1e-6)
    got.sum().backward()
    assert draft.grad[0].tolist() == pytest.approx([q - p for p, q in zip(sharp, Q)], abs=1e-6)  # q - p
    assert LossSpec("forward_kl", target_temperature=1.0)(target, draft).item() == pytest.approx(
        divergence("forward_kl", target, draft).item(), abs=0)
    cold = LossSpec("forward_kl", target_temperature=1e-3)(target, draft)
    assert cold.item() == pytest.approx(-math.log(Q[0]), rel=1e-4)  # CE on argmax P: -log q_0
    assert LossSpec.from_recipe(Recipe.model_validate({"draft": {"distill_temperature": 0.5}}).draft) == \
        LossSpec("forward_kl", 1.0, 3.0, 0.5)
    with pytest.raises(RecipeError, match="draft.distill_temperature: Input should be greater than 0"):
        load_recipe(None, ["draft.distill_temperature=0"])
    with pytest.raises(RecipeError, match="draft.distill_temperature: unknown key for draft.method medusa"):
        load_recipe(None, ["draft.method=medusa", "draft.distill_temperature=0.5"])


def _tiny_eagle3(seed: int = 0):
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.model import Eagle3DraftModel

    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=100, draft_vocab_size=40, aux_layer_ids=[0, 1, 2])
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(100, 32))
    return model


def _method_stub(kind: str, gamma: float, chunk: int | None):
    """An Eagle3Method with only what compute_loss reads (no run directory)."""
    from types import SimpleNamespace

    from draftsmith.train.losses import TargetDraftHead
    from draftsmith.models.eagle3.training import Eagle3Method

    method = Eagle3Method.__new__(Eagle3Method)
    method.recipe = SimpleNamespace(train=SimpleNamespace(loss_chunk_rows=chunk),
                                    draft=SimpleNamespace(ttt_steps=3, gamma=gamma))
    method.loss = LossSpec(kind)
    method.target_head = TargetDraftHead(torch.randn(40, 32))
    method.accelerator = SimpleNamespace(num_processes=1)
    return method


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_ttt_loss_inside_forward_equals_the_unchunked_loss_with_gradients(kind, packed):
    # the training path (batch plan -> teacher once per batch -> chunked divergence inside the
    # draft's forward) against the reference that keeps every step's (M_k, Vd) logits
    model = _tiny_eagle3()
    method = _method_stub(kind, gamma=0.7, chunk=5)
    B, T = 2, 24
    batch = {"input_ids": torch.randint(0, 100, (B, T)), "loss_mask": (torch.rand(B, T) > 0.3).long(),
             "aux_hidden_states": torch.randn(B, T, 96), "final_hidden_states": torch.randn(B, T, 32)}
    if packed:
        batch["document_ids"] = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    docs = batch.get("document_ids")
    logits = model(batch["input_ids"], batch["aux_hidden_states"], 3, batch["loss_mask"], None, docs)
    want, m = ttt_loss(logits, method.target_head(batch["final_hidden_states"]), batch["loss_mask"], 0.7, None,
                       docs, LossSpec(kind))
    want_grads = torch.autograd.grad(want, [p for p in model.parameters() if p.requires_grad])
    from draftsmith.models.eagle3.training import eagle3_batch_plan

    for b in (batch, eagle3_batch_plan(batch, steps=3)):  # without and with the collate's plan
        got, metrics = method.compute_loss(model, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grads = torch.autograd.grad(got, [p for p in model.parameters() if p.requires_grad])
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        for k in range(3):  # per-step metrics stay device tensors, equal to the reference's
            assert isinstance(metrics[f"loss_{k}"], torch.Tensor)
            assert metrics[f"loss_{k}"].item() == pytest.approx(m.loss[k], rel=1e-5, abs=1e-6)
            assert metrics[f"acc_{k}"].item() == pytest.approx(m.acc[k], abs=1e-6)


def test_chunked_ttt_loss_weights_step_k_by_gamma_to_the_k():
    # the step weights are pinned: with gamma = 1 every step counts fully, with gamma = 0.5
    # step k's divergence is halved k times
    model = _tiny_eagle3(1)
    B, T = 2, 20
    batch = {"input_ids": torch.randint(0, 100, (B, T)), "loss_mask": torch.ones(B, T, dtype=torch.long),
             "aux_hidden_states": torch.randn(B, T, 96), "final_hidden_states": torch.randn(B, T, 32)}
    torch.manual_seed(5)
    loss_1, m1 = _method_stub("forward_kl", 1.0, None).compute_loss(model, batch)
    torch.manual_seed(5)
    loss_h, mh = _method_stub("forward_kl", 0.5, None).compute_loss(model, batch)
    steps = [m1[f"loss_{k}"] for k in range(3)]
    torch.testing.assert_close(loss_1, sum(steps))
    torch.testing.assert_close(loss_h, sum(0.5**k * s for k, s in enumerate(steps)))


def test_teacher_logits_stay_in_the_targets_dtype_on_an_accelerator(monkeypatch):
    """A bf16 target's teacher logits are bf16 products either way; on an accelerator they are kept
    bf16 (half the (N, Vd) memory, no cast kernel) and every loss reads its chunk in float32, so
    the loss and gradients equal those of the float32 copy exactly."""
    from draftsmith.train import losses
    from draftsmith.train.losses import LossSpec, TargetDraftHead, chunked_distill

    gen = torch.Generator().manual_seed(0)
    head = TargetDraftHead(torch.randn(40, 16, generator=gen).bfloat16())
    final = torch.randn(12, 16, generator=gen)
    assert head(final).dtype == torch.float32  # the CPU: fp32 product
    monkeypatch.setattr(losses, "teacher_in_target_dtype", lambda device: True)
    teacher = head(final)
    assert teacher.dtype == torch.bfloat16
    w = torch.randn(40, 8, generator=gen)
    results = []
    for t in (teacher, teacher.float()):
        h = torch.randn(9, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = chunked_distill(h, lambda x: x @ w.T, t, torch.arange(9) % 12, torch.full((9,), 0.1),
                              LossSpec("jsd"), chunk_size=4)
        (grad,) = torch.autograd.grad(out.loss_sum, h)
        results.append((out.loss_sum.detach(), out.row_hit, grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# train.fused_loss reaches the loss as an argument


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _route(fused, monkeypatch, labels=False):
    """Which loss a chunked_distill call with ``fused`` runs on a GPU (fake tensors, the device check
    answering as CUDA does): ``"fused"`` (the Triton kernel's op) or ``"chunked"`` (log-softmaxes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from draftsmith.train import losses
    from draftsmith.train.losses import chunked_distill

    monkeypatch.setattr(losses, "fused_device_ok", lambda device: True)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    ops = _OpNames()
    with FakeTensorMode(allow_non_fake_inputs=True), ops:
        h = torch.randn(9, 16, requires_grad=True)
        teacher = torch.randint(0, 40, (12,)) if labels else torch.randn(12, 40)
        out = chunked_distill(h, lm_head, teacher, torch.arange(9) % 12, torch.full((9,), 0.1), LossSpec(),
                              chunk_size=4, labels=labels, vocab_size=40, fused=fused)
        out.loss_sum.backward()
    if any("distill_rows" in n for n in ops.names):
        return "fused"
    assert any("log_softmax" in n or "cross_entropy" in n or "nll_loss" in n for n in ops.names)
    return "chunked"


@pytest.mark.parametrize("labels", [False, True], ids=["distill", "labels"])
def test_the_loss_takes_train_fused_loss_as_an_argument_not_the_process_setting(monkeypatch, labels):
    """``fused`` decides, whatever the deprecated process-wide setting says; ``None`` falls back to it."""
    pytest.importorskip("triton")
    from draftsmith.train import losses

    monkeypatch.setattr(losses, "FUSED_LOSS", False)
    assert _route("auto", monkeypatch, labels) == "fused"
    assert _route(True, monkeypatch, labels) == "fused"
    assert _route(None, monkeypatch, labels) == "chunked"  # the process setting (False)
    monkeypatch.setattr(losses, "FUSED_LOSS", True)
    assert _route(False, monkeypatch, labels) == "chunked"
    assert _route(None, monkeypatch, labels) == "fused"


def test_set_fused_loss_is_a_deprecated_shim_for_the_calls_that_pass_none(monkeypatch):
    from draftsmith.train import losses

    monkeypatch.setattr(losses, "FUSED_LOSS", "auto")
    with pytest.warns(DeprecationWarning, match="pass train.fused_loss to the loss"):
        losses.set_fused_loss(False)
    assert losses.FUSED_LOSS is False


def test_the_trainer_does_not_set_the_loss_globally():
    """The methods pass their recipe's train.fused_loss; the trainer no longer sets a module global."""
    import inspect

    from draftsmith.train import trainer

    assert "set_fused_loss" not in inspect.getsource(trainer)


def test_uses_fused_loss_is_one_predicate_for_the_step_and_the_dry_run(monkeypatch):
    from draftsmith.train import fused_loss as fl
    from draftsmith.train import losses
    from draftsmith.train.losses import uses_fused_loss

    assert uses_fused_loss(False, "cuda", torch.bfloat16) == (False, "")
    assert uses_fused_loss("auto", "cpu", torch.bfloat16) == (False, "")  # auto off CUDA: not asked for
    ok, why = uses_fused_loss(True, "cpu", torch.bfloat16)
    assert not ok and "CUDA" in why  # asked for, cannot run
    ok, why = uses_fused_loss("auto", "cuda", torch.float32, LossSpec("hinge"), runtime=False)
    assert not ok and "hinge" in why
    assert uses_fused_loss("auto", "cuda", torch.float32, LossSpec("hinge"), labels=True, runtime=False) == (True, "")
    monkeypatch.setattr(fl, "triton", None)  # the dry run's machine need not have Triton
    assert uses_fused_loss("auto", "cuda", torch.bfloat16, LossSpec("jsd"), runtime=False) == (True, "")
    ok, why = uses_fused_loss("auto", "cuda", torch.bfloat16, LossSpec("jsd"))
    assert not ok and "triton" in why
    monkeypatch.setattr(losses, "fused_device_ok", lambda device: False)
    assert uses_fused_loss("auto", "cuda", torch.bfloat16, runtime=False) == (False, "")


def test_the_teacher_of_a_soft_capped_target_is_capped_as_the_target_samples(tmp_path):
    """Gemma's ``final_logit_softcapping`` c: the target samples from ``c * tanh(z / c)``, so the
    teacher logits over the draft vocab are capped the same way (element-wise, exact on the rows)."""
    import json

    from draftsmith.target.load import final_logit_softcap
    from draftsmith.train.losses import TargetDraftHead

    torch.manual_seed(0)
    lm_head, hidden = torch.randn(12, 8) * 10, torch.randn(5, 8)
    t2d = torch.tensor([True, False] * 6)
    plain = TargetDraftHead.from_full(lm_head, t2d)(hidden)
    capped = TargetDraftHead.from_full(lm_head, t2d, softcap=30.0)(hidden)
    assert plain.abs().max() > 30  # the cap binds on these logits
    torch.testing.assert_close(capped, 30.0 * torch.tanh(plain / 30.0))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": {"final_logit_softcapping": 30.0}}))
    assert final_logit_softcap(tmp_path) == 30.0
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "final_logit_softcapping": None}))
    assert final_logit_softcap(tmp_path) is None
