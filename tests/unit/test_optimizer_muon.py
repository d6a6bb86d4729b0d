"""``train.optimizer: muon``: torch's Muon on the draft's 2-D hidden weight matrices, AdamW on the
rest (the speculators split), both stepped by the trainer's loop and guarded against non-finite
steps. Resume exactness of a Muon run: tests/integration/test_resume.py."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models.eagle3 import Eagle3DraftModel
from draftsmith.recipe import TrainConfig
from draftsmith.train.trainer import NonFiniteGuard, build_optimizers, split_muon_params

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
    assert type(adamw) is torch.optim.AdamW and type(muon) is torch.optim.Muon
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


def test_guard_skips_a_nonfinite_step_in_both_optimizers():
    """The fused AdamW part skips on the device (``found_inf``); Muon has no fused kernel, so its
    gradients are dropped after the one host read: weights and Muon's momentum stay put."""
    model = _draft()
    optimizers = build_optimizers(model, TrainConfig(optimizer="muon", lr=1e-2), torch.device("cpu"))
    guard = NonFiniteGuard(optimizers, torch.device("cpu"), num_processes=1)
    assert not guard.fused  # Muon's groups are not fused

    def step(loss_value: float) -> None:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        guard.note_loss(torch.tensor(loss_value))
        for o in optimizers:
            o.step()
        guard.end_step()
        for o in optimizers:
            o.zero_grad(set_to_none=True)

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
