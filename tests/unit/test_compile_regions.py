"""train.compile: the draft decoder layer's regions around attention under torch.compile give the
eager step's loss and gradients (inductor's CPU backend here; on CUDA the same graphs lower to
Triton kernels, which only a GPU run checks)."""

from __future__ import annotations

import copy

import torch

from draftsmith.models.common import compile_regions, resolve_compile
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.recipe import TrainConfig
from helpers.tiny import eagle3_tiny_config


def test_compile_setting_resolves_by_device():
    assert TrainConfig().compile == "auto"
    assert resolve_compile("auto", torch.device("cuda", 0)) and not resolve_compile("auto", torch.device("cpu"))
    assert resolve_compile(True, torch.device("cpu")) and not resolve_compile(False, torch.device("cuda"))


def test_compiled_layer_regions_equal_eager_loss_and_gradients():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = eagle3_tiny_config()
    eager = Eagle3DraftModel(cfg)
    eager.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled) == 1  # the one decoder layer
    B, T, K = 2, 24, 3
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size)
    mask = torch.ones(B, T, dtype=torch.long)

    def loss_and_grads(model):
        logits = model(ids, aux, K, mask)
        loss = sum(l.float().logsumexp(-1).mean() * (k + 1) for k, l in enumerate(logits))
        return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    try:
        want, grads_want = loss_and_grads(eager)
        got, grads_got = loss_and_grads(compiled)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    # the state dict is the module's: compiled regions add no keys
    assert compiled.state_dict().keys() == eager.state_dict().keys()
