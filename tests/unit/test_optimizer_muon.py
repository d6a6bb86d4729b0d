"""``train.optimizer: muon``: torch's Muon on the draft's 2-D hidden weight matrices, AdamW on the
rest (the speculators split), both stepped by the trainer's loop and guarded against non-finite
steps. Muon is :class:`draftsmith.train.optim.Muon`: torch's update and ``state_dict`` with the
Newton-Schulz iterations in the dtype the device runs fast (bf16 on a GPU / a CPU with native
bf16, fp32 elsewhere). Resume exactness of a Muon run: tests/integration/test_resume.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.recipe import TrainConfig
from draftsmith.train import optim as optim_module
from draftsmith.train.optim import newton_schulz_dtype
from draftsmith.train.components.nonfinite import NonFiniteGuard
from draftsmith.train.components.optimizer import build_optimizers, split_muon_params

from helpers.reference_losses import ttt_loss
from helpers.tiny import eagle3_tiny_config

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def _draft() -> Eagle3DraftModel:
    torch.manual_seed(0)
    cfg = eagle3_tiny_config()
    model = Eagle3DraftModel(cfg)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    return model


def test_split_gives_muon_the_hidden_matrices_and_adamw_the_rest():
    model = _draft()
    model.norm.weight.requires_grad_(False)  # frozen parameters go to neither optimizer
    muon, adamw = split_muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names, adamw_names = {names[id(p)] for p in muon}, {names[id(p)] for p in adamw}
    assert muon_names == {n for n, p in model.named_parameters()
                          if p.ndim == 2 and "lm_head" not in n and "embed_tokens" not in n}
    assert "fc.weight" in muon_names and "layers.0.self_attn.q_proj.weight" in muon_names
    assert "lm_head.weight" in adamw_names  # 2-D, but the output head stays on AdamW
    assert all(p.ndim == 1 for n, p in model.named_parameters() if n in adamw_names and n != "lm_head.weight")
    assert "norm.weight" not in muon_names | adamw_names
    assert not muon_names & adamw_names
    assert muon_names | adamw_names == {n for n, p in model.named_parameters() if p.requires_grad}


def test_adamw_default_is_one_fused_adamw_and_muon_adds_torch_muon():
    model = _draft()
    (only,) = build_optimizers(model, TrainConfig(lr=1e-3), torch.device("cpu"))
    assert type(only) is torch.optim.AdamW
    assert sum(len(g["params"]) for g in only.param_groups) == len(list(model.parameters()))
    adamw, muon = build_optimizers(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=2e-2, muon_weight_decay=0.05),
                                   torch.device("cpu"))
    assert type(adamw) is torch.optim.AdamW and type(muon) is optim_module.Muon
    assert isinstance(muon, torch.optim.Muon) and muon.ns_dtype == newton_schulz_dtype("cpu")[0]
    assert adamw.param_groups[0]["lr"] == 1e-3 and adamw.param_groups[0]["fused"]
    assert muon.param_groups[0]["lr"] == 2e-2 and muon.param_groups[0]["weight_decay"] == 0.05
    want_muon, want_adamw = split_muon_params(model)
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(p) for p in want_muon]
    assert [id(p) for p in adamw.param_groups[0]["params"]] == [id(p) for p in want_adamw]
    (_, muon_default) = build_optimizers(model, TrainConfig(optimizer="muon", lr=1e-3), torch.device("cpu"))
    assert muon_default.param_groups[0]["lr"] == 1e-3  # muon_lr null: train.lr


def test_a_few_muon_steps_reduce_the_ttt_loss():
    model = _draft()
    cfg = model.config
    B, T = 4, 12
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    aux = torch.randn(B, T, 3 * cfg.hidden_size)
    target = torch.randn(B, T, cfg.draft_vocab_size) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", lr=3e-3, muon_lr=2e-2), torch.device("cpu"))
    losses = []
    for _ in range(30):
        loss, _ = ttt_loss(model(ids, aux, 3, mask), target, mask)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        for o in optimizers:
            o.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def guarded_step(model, optimizers, guard, loss_value: float, grads: dict | None = None) -> None:
    """One trainer-shaped step: gradients (``grads`` by name, else ones), the loss noted, every
    optimizer stepped under the guard, gradients cleared."""
    for n, p in model.named_parameters():
        p.grad = grads[n].clone() if grads is not None else torch.ones_like(p)
    guard.note_loss(torch.tensor(loss_value))
    for o in optimizers:
        o.step()
    guard.end_step()
    for o in optimizers:
        o.zero_grad(set_to_none=True)


def test_guard_skips_a_nonfinite_step_in_both_optimizers():
    """The fused AdamW part skips on the device (``found_inf``); Muon has no fused kernel, so its
    weights and momentum are put back on the device after its step: both stay put, bit for bit."""
    model = _draft()
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", lr=1e-2), torch.device("cpu"))
    guard = NonFiniteGuard(optimizers, torch.device("cpu"), num_processes=1)
    assert not guard.fused  # Muon's groups are not fused

    def step(loss_value: float) -> None:
        guarded_step(model, optimizers, guard, loss_value)

    step(1.0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    muon_state = {id(p): s["momentum_buffer"].clone() for p, s in optimizers[1].state.items()}
    step(float("nan"))
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(muon_state[id(p)], s["momentum_buffer"]) for p, s in optimizers[1].state.items())
    step(1.0)
    assert not torch.equal(weights["fc.weight"], model.fc.weight)
    assert not torch.equal(weights["norm.weight"], model.norm.weight)
    assert [round(v) for v in guard.read()] == [1, 0, 1]


def test_unknown_optimizer_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd")


def test_guard_skips_a_nonfinite_first_step_without_leaving_muon_state():
    """A skipped first step: Muon creates its momentum buffers inside that step; the guard zeroes
    them (as if never stepped) and puts the weights back, so the next good step equals a fresh
    optimizer's first step."""
    torch.manual_seed(0)
    model = _draft()
    twin = _draft()
    twin.load_state_dict(model.state_dict())
    cfg = TrainConfig(optimizer="muon", lr=1e-2)
    optimizers = build_optimizers(model, cfg, torch.device("cpu"))
    twin_optimizers = build_optimizers(twin, cfg, torch.device("cpu"))
    guard = NonFiniteGuard(optimizers, torch.device("cpu"), num_processes=1)
    twin_guard = NonFiniteGuard(twin_optimizers, torch.device("cpu"), num_processes=1)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}

    guarded_step(model, optimizers, guard, float("inf"), grads)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert all(torch.count_nonzero(s["momentum_buffer"]) == 0 for s in optimizers[1].state.values())
    guarded_step(model, optimizers, guard, 1.0, grads)
    guarded_step(twin, twin_optimizers, twin_guard, 1.0, grads)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_dry_run_counts_muon_state_and_the_guard_copies_from_above():
    """The dry run's ``optimizer_state`` under ``train.optimizer: muon`` (12 B per trainable
    parameter) bounds what a real step leaves alive: AdamW's moments, Muon's momentum and the
    non-finite guard's copies of the Muon group's weights and momentum; AdamW's 8 B stays exact."""
    from draftsmith.train.dry_run import state_bytes_per_gpu
    from draftsmith.train.components.nonfinite import _step_tensors

    model = _draft()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", lr=1e-2), torch.device("cpu"))
    guard = NonFiniteGuard(optimizers, torch.device("cpu"), num_processes=1)
    for _ in range(2):  # the second step reuses the guard's copies
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        for o in optimizers:
            o.step()
        guard.end_step()
    params = {id(p) for p in model.parameters()}
    state = sum(t.numel() * t.element_size() for o in optimizers for t in _step_tensors(o) if id(t) not in params)
    copies = sum(c.numel() * c.element_size() for _, cs in guard._saved.values() for c in cs)
    muon_numel = sum(p.numel() for p in split_muon_params(model)[0])
    assert copies == 2 * 4 * muon_numel  # weights + momentum of the Muon group, fp32
    assert state + copies <= state_bytes_per_gpu(trainable, None, "fp32", "muon")["optimizer_state"]
    assert state_bytes_per_gpu(trainable, None, "fp32")["optimizer_state"] == 8 * trainable


# -- the Newton-Schulz dtype

MUON_ARGS = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "adjust_lr_fn": "match_rms_adamw"}
SHAPES = ((16, 40), (40, 16), (24, 24))  # wide, tall (transposed inside the iterations), square


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _step(optimizer, params, grads) -> None:
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    optimizer.step()


@contextlib.contextmanager
def _torch_in_fp32():
    """torch's own Muon step with its ``grad.bfloat16()`` giving an fp32 copy instead: the
    reference for ``ns_dtype=torch.float32`` (only inside the block)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.to(torch.float32, copy=True))
        yield


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_muon_is_torchs_update_in_its_ns_dtype(ns_dtype, nesterov):
    """Four steps with weight decay and momentum: the weights and momentum buffers equal torch's
    Muon bit for bit, torch's as it is (bf16) or with its iterations in fp32."""
    ours_p, ref_p = _params(), _params()
    ours = optim_module.Muon(ours_p, nesterov=nesterov, ns_dtype=ns_dtype, **MUON_ARGS)
    ref = torch.optim.Muon(ref_p, nesterov=nesterov, **MUON_ARGS)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(*s, generator=g) for s in SHAPES]
        _step(ours, ours_p, grads)
        if ns_dtype == torch.float32:
            with _torch_in_fp32():
                _step(ref, ref_p, grads)
        else:
            _step(ref, ref_p, grads)
        for p, q in zip(ours_p, ref_p):
            assert torch.equal(p, q)
            assert torch.equal(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    plain = _params()  # torch's bf16 iterations give another update: the dtype is really switched
    _step(torch.optim.Muon(plain, nesterov=nesterov, **MUON_ARGS), plain, grads)
    fp32 = _params()
    _step(optim_module.Muon(fp32, nesterov=nesterov, ns_dtype=torch.float32, **MUON_ARGS), fp32, grads)
    assert not torch.equal(plain[0], fp32[0])


def test_muon_state_dict_is_torchs_both_ways(tmp_path):
    """Same ``state_dict`` keys as torch's Muon (``ns_dtype`` is not in it): a checkpoint of either
    loads into the other (through a file, as optimizer_1.bin) and the next steps agree."""
    ours_p, ref_p = _params(), _params()
    ours = optim_module.Muon(ours_p, ns_dtype=torch.bfloat16, **MUON_ARGS)
    ref = torch.optim.Muon(ref_p, **MUON_ARGS)
    grads = [torch.randn(*s) for s in SHAPES]
    _step(ours, ours_p, grads)
    _step(ref, ref_p, grads)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and a["state"].keys() == b["state"].keys()
    assert [g.keys() for g in a["param_groups"]] == [g.keys() for g in b["param_groups"]]
    assert all(a["state"][i].keys() == b["state"][i].keys() for i in a["state"])
    torch.save(b, tmp_path / "optimizer_1.bin")
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
    resumed = optim_module.Muon(resumed_p, ns_dtype=torch.bfloat16, **MUON_ARGS)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer_1.bin", weights_only=True))
    assert resumed.ns_dtype == torch.bfloat16
    back_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    back = torch.optim.Muon(back_p, **MUON_ARGS)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # a copy: load_state_dict keeps same-device tensors
    grads = [torch.randn(*s) for s in SHAPES]
    for o, ps in ((resumed, resumed_p), (back, back_p), (ref, ref_p)):
        _step(o, ps, grads)
    assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(resumed_p, back_p, ref_p))


def test_ns_dtype_is_detected_from_what_torch_reports(monkeypatch):
    """bf16 only where torch reports a fast bf16 matmul: CUDA with native bf16, a CPU with native
    bf16 instructions and oneDNN's bf16 path; fp32 everywhere else (this CI's AVX2 EPYC)."""
    caps = dict(torch.cpu.get_capabilities()) if hasattr(torch.cpu, "get_capabilities") else {}
    native = any(caps.get(k) for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
    expected = torch.bfloat16 if native and optim_module._onednn_bf16() else torch.float32
    assert newton_schulz_dtype("cpu")[0] == expected
    assert optim_module.Muon(_params()).ns_dtype == expected  # None: the parameters' device

    monkeypatch.setattr(optim_module, "_onednn_bf16", lambda: True)
    for flags, want in (({"avx2": True}, torch.float32), ({"avx512_f": True}, torch.float32),
                        ({"avx512_f": True, "avx512_bf16": True}, torch.bfloat16), ({"amx_bf16": True}, torch.bfloat16),
                        ({"architecture": "arm64", "bf16": True}, torch.bfloat16)):
        monkeypatch.setattr(optim_module, "_cpu_capabilities", lambda flags=flags: flags)
        dtype, why = newton_schulz_dtype("cpu")
        assert dtype == want, (flags, why)
    monkeypatch.setattr(optim_module, "_onednn_bf16", lambda: False)  # native bf16, but torch's matmul is not oneDNN's
    assert newton_schulz_dtype("cpu")[0] == torch.float32

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native_gpu, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native_gpu: n)
        assert newton_schulz_dtype("cuda")[0] == want
    assert newton_schulz_dtype("mps")[0] == torch.float32


def test_build_optimizers_uses_the_detected_or_the_given_ns_dtype(caplog):
    model = _draft()
    cfg = TrainConfig(optimizer="muon", lr=1e-3)
    with caplog.at_level("INFO", logger="draftsmith.train"):
        _, muon = build_optimizers(model, cfg, torch.device("cpu"))
    assert muon.ns_dtype == newton_schulz_dtype("cpu")[0]
    assert "Newton-Schulz iterations in" in caplog.text
    _, muon = build_optimizers(model, cfg, torch.device("cpu"), ns_dtype=torch.bfloat16)
    assert muon.ns_dtype == torch.bfloat16
