"""Every target family end to end at tiny size: MoE (Qwen3-MoE, GLM-4.5, MiniMax-M2), MLA + MoE
(DeepSeek-V3 / Kimi), hybrid linear / full attention (Qwen3-Next, Qwen3.5) and sliding / global
attention (Gemma 4), each a random target built from its own transformers config class
(``helpers.families``), through ``prepare`` (transformers regeneration and capture) ->
``train`` (EAGLE-3) -> ``export`` -> the EAGLE-3 target check -> the reference decoder, whose
speculative output must equal the target's own greedy output."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.eval.spec_decode import SpecCounters, Target, load_draft, plain_generate, speculative_generate
from draftsmith.models.eagle3.proposer import Eagle3Proposer, target_check
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.target import load_target, target_weight_bytes, validate_geometry
from draftsmith.target.capture import capture_batch, decoder_layers
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.families import FAMILIES, FAMILY_AUX, FAMILY_LAYERS, build_family_model, build_family_target, module_counts
from helpers.recipes import PROMPTS, tiny_recipe
from helpers.tiny import write_jsonl

pytestmark = pytest.mark.integration

DECODE_PROMPTS = ["Write a haiku about autumn.", "What is the capital of Italy?", "Summarize: the meeting moved."]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_target_keeps_its_family_features(name):
    model, _ = build_family_model(name)
    counts = module_counts(model)
    family = FAMILIES[name]
    assert model.config.model_type == name
    for cls, least in family.modules.items():
        assert counts.get(cls, 0) >= least, f"{name}: {counts.get(cls, 0)} {cls}, want >= {least}"
    for cls, attrs in family.attrs.items():
        for m in (m for m in model.modules() if type(m).__name__ == cls):
            assert all(hasattr(m, a) for a in attrs), f"{name}: a {cls} without one of {attrs}"
    assert len(decoder_layers(model)) == FAMILY_LAYERS
    config_json = model.config.to_dict()
    validate_geometry(config_json, name)  # the preflight's and the data plan's reading of the config
    assert target_weight_bytes(config_json, "float32")["parameters"] > 0
    types = getattr(model.config, "layer_types", None) or []
    if name in ("qwen3_next", "qwen3_5_moe_text"):
        assert {"linear_attention", "full_attention"} <= set(types)
    if name == "gemma4_text":
        attn = [layer.self_attn for layer in decoder_layers(model)]
        assert [a.sliding_window for a in attn] == [8, 8, 8, None]
        assert attn[3].head_dim == 32 and attn[0].head_dim == 16  # the global layer's larger head dim
        assert model.config.final_logit_softcapping == 30.0 and model.config.tie_word_embeddings


@pytest.mark.parametrize("name", list(FAMILIES))
def test_capture_is_the_input_of_each_aux_layer(name):
    """The pre-hook capture (padded batch, per-layer kwargs of hybrid / sliding layers) equals
    transformers' own ``hidden_states[L]`` and the final normed state."""
    model, _ = build_family_model(name)
    ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(1))
    att = torch.ones_like(ids)
    att[1, 14:] = 0
    aux, final = capture_batch(model, ids, att, FAMILY_AUX)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    H = model.config.hidden_size
    for i, L in enumerate(FAMILY_AUX):
        torch.testing.assert_close(aux[0, :, i * H:(i + 1) * H], ref.hidden_states[L][0])
        torch.testing.assert_close(aux[1, :14, i * H:(i + 1) * H], ref.hidden_states[L][1, :14])
    torch.testing.assert_close(final[0], ref.hidden_states[-1][0])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prepare_train_export_decode_losslessly(name, tmp_path):
    target_dir = build_family_target(name, tmp_path / name)
    recipe = tiny_recipe(target_dir, write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS[:4])]), max_steps=8)
    recipe.data.aux_layer_ids = list(FAMILY_AUX)
    recipe.data.regenerate.temperatures = [0.0]
    recipe.data.regenerate.max_new_tokens = 16
    run = tmp_path / "run"
    prepare(recipe, run)
    assert json.loads((run / "data" / "target.json").read_text())["aux_layer_ids"] == FAMILY_AUX
    result = fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    assert result.steps == 8
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"]

    out = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "draft")
    cfg = target_check(out, target_dir)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == FAMILY_AUX and cfg["target_hidden_size"] == 64

    model, tok = load_target(target_dir, torch.float32, device="cpu")
    proposer = load_draft(out, model)
    assert isinstance(proposer, Eagle3Proposer)
    target, plain = Target(model, proposer.aux_layer_ids), Target(model)
    counters = SpecCounters(3)
    for prompt in DECODE_PROMPTS:
        ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=False), add_special_tokens=False)["input_ids"]
        want = plain_generate(plain, ids, max_new_tokens=24)
        assert speculative_generate(target, proposer, ids, k=3, max_new_tokens=24, counters=counters) == want
        with torch.no_grad():  # the target's own greedy decoding, through generate()
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id)
        assert want == ref[0, len(ids):].tolist()[:len(want)]
    # rounds with a rejection happened: the cache was rolled back and decoding stayed lossless
    assert counters.drafts > 0 and counters.accepted_tokens < counters.draft_tokens
