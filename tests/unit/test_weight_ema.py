"""``train.ema_decay``'s weight average (:mod:`draftsmith.train.components.ema`): the update rule
against a hand-computed average, trainable parameters only, the file round trip, and the launchers
it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftsmith.train.components.ema import WeightEMA, build_ema, resume_ema


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 4))
    model[0].weight.requires_grad_(False)  # frozen, like a draft's target embedding
    return model


def test_the_average_follows_the_ramped_decay_step_by_step():
    model = _model()
    ema = WeightEMA(model, decay=0.9)
    assert ema.names == ["1.weight", "1.bias"]
    want = {n: p.detach().clone().double() for n, p in model.named_parameters() if p.requires_grad}
    for step in range(1, 40):
        with torch.no_grad():
            for p in model[1].parameters():
                p.add_(torch.randn_like(p))
        d = min(0.9, (1 + step) / (10 + step))
        assert ema.decay_at(step) == d
        ema.update(step)
        for n, p in model.named_parameters():
            if p.requires_grad:
                want[n] = d * want[n] + (1 - d) * p.detach().double()
    got = ema.state_dict()
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n].double(), want[n], rtol=1e-6, atol=1e-6)
        assert got[n].dtype == torch.float32
        assert not torch.equal(got[n], dict(model.named_parameters())[n].detach())


def test_bf16_parameters_keep_an_fp32_average():
    model = _model().to(torch.bfloat16)
    ema = WeightEMA(model, decay=0.5)
    before = model[1].weight.detach().float().clone()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    ema.update(1_000)
    assert ema.shadow[0].dtype == torch.float32
    torch.testing.assert_close(ema.shadow[0], 0.5 * before + 0.5 * model[1].weight.float())


def test_saved_average_loads_back_and_a_foreign_file_is_refused(tmp_path):
    model = _model()
    ema = WeightEMA(model, decay=0.9)
    with torch.no_grad():
        model[1].weight.mul_(3.0)
    ema.update(100)
    ema.save(tmp_path / "ema.safetensors")
    fresh = WeightEMA(model, decay=0.9)
    fresh.load(tmp_path / "ema.safetensors")
    for a, b in zip(fresh.shadow, ema.shadow):
        assert torch.equal(a, b)
    other = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 6))
    other[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"ema.safetensors: 1.weight has shape \(4, 3\)"):
        WeightEMA(other, 0.9).load(tmp_path / "ema.safetensors")
    with pytest.raises(ValueError, match="not this draft's average"):
        WeightEMA(torch.nn.Linear(3, 4), 0.9).load(tmp_path / "ema.safetensors")


def test_a_resume_from_a_checkpoint_without_an_average_starts_it_from_the_resumed_weights(tmp_path, caplog):
    model = _model()
    ema = WeightEMA(model, decay=0.9)  # built from the fresh initialisation, as the trainer does
    with torch.no_grad():
        model[1].weight.add_(5.0)  # the checkpoint's weights, loaded after
    resume_ema(ema, tmp_path)
    assert torch.equal(ema.shadow[0], model[1].weight.detach())
    assert "has no ema.safetensors" in caplog.text


def _accelerator(kind: str, zero_stage: int | None = None, main: bool = True):
    plugin = SimpleNamespace(zero_stage=zero_stage) if zero_stage is not None else None
    return SimpleNamespace(distributed_type=SimpleNamespace(value=kind), state=SimpleNamespace(deepspeed_plugin=plugin),
                           is_main_process=main, unwrap_model=lambda m: m)


def test_build_ema_is_off_at_zero_main_process_only_and_refuses_sharded_parameters():
    model = _model()
    assert build_ema(_accelerator("NO"), model, 0.0) is None
    assert isinstance(build_ema(_accelerator("MULTI_GPU"), model, 0.99), WeightEMA)
    assert build_ema(_accelerator("MULTI_GPU", main=False), model, 0.99) is None
    assert isinstance(build_ema(_accelerator("DEEPSPEED", zero_stage=2), model, 0.99), WeightEMA)
    with pytest.raises(ValueError, match="train.ema_decay: not supported under FSDP"):
        build_ema(_accelerator("FSDP"), model, 0.99)
    with pytest.raises(ValueError, match="DEEPSPEED ZeRO-3"):
        build_ema(_accelerator("DEEPSPEED", zero_stage=3), model, 0.99)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        WeightEMA(model, 1.0)


def test_the_dry_run_counts_the_average_on_the_main_process():
    from draftsmith.train.dry_run import state_bytes_per_gpu

    off = state_bytes_per_gpu(1_000, None, "fp32", "adamw")
    on = state_bytes_per_gpu(1_000, None, "fp32", "adamw", weight_average=True)
    assert on["weight_average"] == 4_000 and "weight_average" not in off
    assert on["total"] == off["total"] + 4_000
