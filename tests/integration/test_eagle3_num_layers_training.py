"""``draft.num_layers: 2`` end to end on the tiny target: the trainer trains both layers (with
activation checkpointing, which wraps each layer), the export holds both, and the reference
decoder drafts from it losslessly with one KV cache per layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration


def test_a_two_layer_draft_trains_exports_and_decodes_losslessly(prepared, tiny_target, tmp_path):
    from draftsmith.eval.export import export
    from draftsmith.eval.spec_decode import SpecCounters, Target, load_draft, plain_generate, speculative_generate
    from draftsmith.models.eagle3.format import expected_weight_shapes
    from draftsmith.models.eagle3.training import Eagle3Method
    from draftsmith.target import load_target
    from draftsmith.train.checkpoint import find_checkpoints, read_draft
    from draftsmith.train.trainer import fit

    recipe, run, _ = prepared
    recipe = recipe.model_copy(deep=True)
    recipe.draft.num_layers = 2
    recipe.draft.gradient_checkpointing = True
    method = Eagle3Method(recipe, run)
    assert method.config.num_layers == 2
    fit(recipe, method, run, progress=False)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.7 * metrics[0]["loss"]

    ckpt = find_checkpoints(run / "checkpoints")[-1]
    draft = read_draft(ckpt)
    assert draft.config.num_layers == 2 and "layers.1.mlp.down_proj.weight" in draft.state
    out = export(ckpt, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_weight_shapes(draft.config)

    model, tok = load_target(tiny_target, torch.float32)
    proposer = load_draft(out, model)
    assert len(proposer.caches) == 2
    target, plain = Target(model, proposer.aux_layer_ids), Target(model)
    counters = SpecCounters(3)
    for text in ("Write a haiku about autumn.", "What is the capital of Italy?"):
        p = tok(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=False), add_special_tokens=False)["input_ids"]
        assert speculative_generate(target, proposer, p, k=3, max_new_tokens=24, counters=counters) == \
            plain_generate(plain, p, max_new_tokens=24)
    assert counters.drafts > 0 and counters.accepted_tokens > 0
