"""The target's final-norm form (Llama's ``x_hat * w`` or a zero-centred ``x_hat * (1 + w)``), read
off the model class, and the final norm the drafts and the vLLM capture engine apply with it."""

from __future__ import annotations

import pytest
import torch

from draftsmith.target.load import final_norm_offset, load_target_head_tensors
from draftsmith.target.vllm_capture import rms_norm

from helpers.families import build_family_target, family_config


@pytest.mark.parametrize("name, offset", [("qwen3_next", 1.0), ("qwen3_5_moe_text", 1.0), ("qwen3_moe", 0.0),
                                          ("deepseek_v3", 0.0), ("gemma4_text", 0.0), ("glm4_moe", 0.0),
                                          ("minimax_m2", 0.0)])
def test_final_norm_offset_of_each_family(name, offset):
    assert final_norm_offset(family_config(name)) == offset


def test_final_norm_offset_of_gemma3_and_llama():
    from transformers import Gemma3TextConfig, LlamaConfig

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, vocab_size=32)
    assert final_norm_offset(Gemma3TextConfig(**small)) == 1.0
    assert final_norm_offset(LlamaConfig(**small)) == 0.0


def test_head_tensors_hold_the_scale_the_final_norm_multiplies_by(tmp_path):
    """A zero-centred target's final norm comes out as ``1 + w``: the Llama RMSNorm a draft (or the
    vLLM capture engine) applies with it equals the target's own norm."""
    target = build_family_target("qwen3_next", tmp_path / "t")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.normal_(0.0, 0.2)
    model.save_pretrained(target)
    heads = load_target_head_tensors(target)
    torch.testing.assert_close(heads["final_norm"], 1.0 + model.model.norm.weight.detach())
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, heads["final_norm"], model.config.rms_norm_eps), model.model.norm(x))
