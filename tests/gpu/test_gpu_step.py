"""Proof on a GPU of the GPU step (docs/training_step.md, "Useful tokens per second on a GPU"):
the fused Triton loss equals the chunked torch loss, the compiled decoder-layer regions equal the
eager ones, and a recipe-geometry EAGLE-3 step under flex compiles once for its length bucket, in
under a minute.

Each test also checks that the fast path it is about really ran (tests/helpers/fast_path.py): where
the fused loss cannot run, ``chunked_distill`` warns and takes the chunked torch path, so a
fused-vs-chunked comparison would compare torch with torch. So the fused run must dispatch
``draftsmith::distill_rows`` once per chunk and launch its kernel each time, with no
``train.fused_loss`` fallback warning (and the torch run none of it); the compiled regions must
hold code torch._dynamo compiled, not just be wrapped.

    pytest -m gpu tests/gpu/test_gpu_step.py        # on a machine with a CUDA GPU

Skipped without CUDA (the CPU proves the kernel through Triton's interpreter,
tests/unit/test_fused_loss.py, and the regions on inductor's CPU backend,
tests/unit/test_compile_regions.py).
"""

from __future__ import annotations

import argparse
import copy
import time

import pytest
import torch

from draftsmith.models.common import compile_regions
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.train.losses import LOSSES, LossSpec, chunked_distill
from helpers.fast_path import compiled_regions, dynamo_frames, fast_path
from helpers.tiny import eagle3_tiny_config

CUDA = torch.cuda.is_available()
gpu_test = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: torch.cuda.is_available() is False")


@gpu_test
@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_loss_equals_the_chunked_loss_on_cuda(kind, dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator(device="cuda").manual_seed(0)
    M, N, H, V = 1500, 900, 256, 32000
    norm = torch.nn.RMSNorm(H, device="cuda", dtype=dtype)
    head = torch.nn.Linear(H, V, bias=False, device="cuda", dtype=dtype)

    class Draft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lm_head = norm, head

        def compute_logits(self, h):
            return self.lm_head(self.norm(h))

        compute_logits.fused_as = ("norm", "lm_head")

    draft = Draft()
    x = torch.randn(M, H, device="cuda", dtype=dtype, generator=g)
    teacher = (3 * torch.randn(N, V, device="cuda", generator=g)).to(dtype)
    index = torch.randint(0, N, (M,), device="cuda", generator=g)
    weight = torch.rand(M, device="cuda", generator=g)
    results = []
    for setting in (False, True):  # train.fused_loss false / true
        h = x.clone().requires_grad_()
        with fast_path() as seen:
            out = chunked_distill(h, draft.compute_logits, teacher, index, weight, LossSpec(kind), chunk_size=512,
                                  fused=setting)
            grads = torch.autograd.grad(out.loss_sum, [h, head.weight])
        if setting:  # the fused op ran, once per chunk of 512 rows, and nothing fell back to torch
            seen.assert_fused(dispatches=-(-M // 512))
        else:
            seen.assert_chunked()
        results.append((out.loss_sum.detach(), out.row_loss, out.row_hit, *grads))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for want, got in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@gpu_test
def test_compiled_regions_equal_eager_on_cuda():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = eagle3_tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=32, vocab_size=1000, draft_vocab_size=500)
    eager = Eagle3DraftModel(cfg).cuda()
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled) == 1
    assert compiled_regions(compiled) == (4, 0)  # the layer's four regions, wrapped
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    aux = torch.randn(2, 256, 3 * cfg.target_hidden_size, device="cuda")
    out = []
    for model in (eager, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, aux, 3)
        loss = sum(l.float().logsumexp(-1).mean() for l in logits)
        out.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)))
    assert compiled_regions(compiled) == (4, 4)  # ... and run as compiled code (eager holds none)
    torch.testing.assert_close(out[1][0], out[0][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(out[1][1], out[0][1]):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


@gpu_test
def test_a_recipe_geometry_flex_step_compiles_once_per_bucket_within_a_minute():
    """gpt-oss-120b's EAGLE-3 draft at 2 x 4096 packed rows under the defaults (flex, fused loss,
    compiled regions): the first step (all compilation) takes under 60 s, and two more steps of the
    same bucket compile nothing new. Each step ran the fused loss (its op's kernel, the same number
    of launches per step, no fallback warning) and the decoder layer's compiled regions (dynamo
    compiled code for every region). The steps run as the trainer runs them: the fused loss is
    counted by its kernel's launches (fast_path(dispatch=False)), no dispatch mode over the step."""
    from torch._dynamo.utils import counters

    from benchmarks.memory import (Precision, _device_batch, offline_method, prepare_model, random_batch,
                                   random_weights, trainer_step)
    from benchmarks.step import load

    torch._dynamo.reset()
    ns = argparse.Namespace(attention="flex", batch_size=None, max_length=None, launcher=None, target_config=None,
                            precision="auto")
    recipe, config_json, _source, launch = load("gptoss120b", [], ns)
    assert recipe.train.fused_loss in ("auto", True) and recipe.train.compile in ("auto", True)
    precision = Precision.of(launch, "auto")
    dev = torch.device("cuda")
    with offline_method(recipe, config_json, torch.bfloat16, random_weights) as method:
        H, V = int(method.target_info.hidden_size), int(method.target_info.vocab_size)
        n_aux = len(method.target_info.aux_layer_ids)
        model, trainable, optimizers = prepare_model(method, recipe, precision, dev)
        assert compile_regions(model) >= 1  # the draft's decoder layers
        regions = compiled_regions(model)[0]
        assert regions >= 4  # four regions per layer
        batch = _device_batch(random_batch(recipe, H, V, n_aux, fake=False), method.batch_plan(), dev, None, fake=False)
        forward_backward, update, _ = trainer_step(method, model, batch, trainable, optimizers, recipe.train, dev)
        t0 = time.perf_counter()
        with dynamo_frames() as frames, fast_path(dispatch=False) as first_step:
            forward_backward(0)
            update()
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        graphs = counters["stats"]["unique_graphs"]
        assert compiled_regions(model) == (regions, regions), "a compiled region ran eagerly"
        assert frames.frames > 0 and frames.graphs > 0
        with fast_path(dispatch=False) as later_steps:
            for i in (1, 2):
                forward_backward(i)
                update()
            torch.cuda.synchronize()
        assert counters["stats"]["unique_graphs"] == graphs, "a step of the same bucket compiled again"
    first_step.assert_fused()
    later_steps.assert_fused(dispatches=2 * first_step.launched)
    assert first < 60.0, f"first step (compilation) took {first:.1f} s"
