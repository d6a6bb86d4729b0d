"""The gpt_oss architecture (MoE, attention sinks, sliding-window layers) as a target: a tiny
random GptOssForCausalLM runs data prep, a few training steps and export on CPU."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from draftsmith.data_prep.hidden_states import capture_batch
from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.train.eagle3 import Eagle3Method
from draftsmith.train.trainer import find_checkpoints, fit

from conftest import build_tokenizer, write_jsonl
from test_pipeline import PROMPTS, tiny_recipe


def build_tiny_gpt_oss(directory):
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False},
    )
    model = GptOssForCausalLM(cfg)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def test_gpt_oss_target_capture_train_export(tmp_path):
    target = build_tiny_gpt_oss(tmp_path / "gpt_oss")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 20))
    aux, final = capture_batch(model, ids, torch.ones_like(ids), [1, 3, 4])
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(aux[..., 64:128], ref.hidden_states[3])
    torch.testing.assert_close(final, ref.hidden_states[-1])

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(target, prompts, max_steps=3)
    run = tmp_path / "run"
    prepare(recipe, run)
    result = fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    assert result.steps == 3
    out = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    # the draft copies the target's YaRN RoPE and states it in the export
    assert layer["rope_parameters"]["rope_type"] == "yarn" and layer["rope_parameters"]["factor"] == 4.0
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and cfg["target_hidden_size"] == 64
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (64, 192)
