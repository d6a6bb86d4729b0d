"""The GPU step's settings on a CPU: train.fused_loss routes the loss (and falls back with one
warning where it cannot run), packing refuses what cannot pack with one line naming the key."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.train import losses
from draftsmith.train.losses import LossSpec, chunked_distill
from helpers.tiny import eagle3_tiny_config

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture
def fused_setting():
    saved = losses.FUSED_LOSS
    losses._fused_warned.clear()
    yield losses.set_fused_loss
    losses.set_fused_loss(saved)
    losses._fused_warned.clear()


def _model():
    torch.manual_seed(0)
    cfg = eagle3_tiny_config()
    return Eagle3DraftModel(cfg), cfg


def _distill(model, cfg, **kw):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, cfg.hidden_size, generator=g, requires_grad=True)
    teacher = torch.randn(5, cfg.draft_vocab_size, generator=g)
    out = chunked_distill(hidden, model.compute_logits, teacher, torch.arange(7) % 5, torch.full((7,), 0.5),
                          LossSpec("forward_kl"), chunk_size=3, **kw)
    (grad,) = torch.autograd.grad(out.loss_sum, hidden)
    return out.loss_sum.detach(), grad


def test_the_fused_loss_asked_for_on_a_cpu_warns_once_and_computes_the_chunked_values(fused_setting):
    model, cfg = _model()
    fused_setting(False)
    want = _distill(model, cfg)
    fused_setting(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_distill(model, cfg) for _ in range(3)]
    messages = [str(w.message) for w in caught if "train.fused_loss" in str(w.message)]
    assert messages == ["train.fused_loss: the fused loss needs a CUDA device, got cpu; using the chunked loss"]
    for loss, grad in got:
        assert torch.equal(loss, want[0]) and torch.equal(grad, want[1])


def test_auto_on_a_cpu_is_the_chunked_loss_without_a_warning(fused_setting):
    model, cfg = _model()
    fused_setting("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _distill(model, cfg)


def test_which_heads_the_fused_loss_can_run():
    model, _ = _model()
    norm, weight = losses._fused_head(model.compute_logits)
    assert norm is model.norm and weight is model.lm_head.weight
    linear = nn.Linear(4, 6, bias=False)
    assert losses._fused_head(linear) == (None, linear.weight)
    assert losses._fused_head(nn.Linear(4, 6)) is None  # a bias the kernel does not add
    assert losses._fused_head(lambda h: model.lm_head(h)) is None  # not known to be lm_head(norm(h))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_on_a_gpu_the_loss_is_the_fused_kernel_and_no_log_softmax(fused_setting, monkeypatch):
    """Routing on a GPU without one: fake tensors, the device check answering as CUDA does. The
    kernel's fake implementation is shape-only; the chunked path's log-softmaxes and argmaxes are gone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pytest.importorskip("triton")
    model, cfg = _model()
    fused_setting("auto")
    monkeypatch.setattr(losses, "fused_device_ok", lambda device: True)
    ops = _Ops()
    with FakeTensorMode(allow_non_fake_inputs=True), ops:
        _distill(model, cfg)
    assert ops.names.count("draftsmith.distill_rows.default") == 3  # 7 rows in chunks of 3
    assert not [n for n in ops.names if "log_softmax" in n or "argmax" in n]


@pytest.mark.parametrize("overrides,message", [
    (["train.packing=true", "train.pack_tokens=512"], "train.pack_tokens=512 is below data.max_length=1024"),
    (["train.packing=true", "data.hidden_states_mode=online"], "train.packing needs data.hidden_states_mode: offline"),
])
def test_packing_that_cannot_work_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE_DIR / "smollm2_135m.yaml", ["data.max_length=1024", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)
