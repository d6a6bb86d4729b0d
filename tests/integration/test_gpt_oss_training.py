"""A tiny random gpt-oss target through capture, training and export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.target.capture import capture_batch
from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import build_tiny_gpt_oss, write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe


@pytest.mark.integration
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
