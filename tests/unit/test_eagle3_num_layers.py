"""EAGLE-3 drafts of more than one decoder layer (``draft.num_layers``).

vLLM parity of the exported layers (llama, qwen3, mla; speculators and legacy formats) is in
tests/with_vllm/test_vllm_eagle3_parity.py and test_vllm_eagle3_layers_parity.py; here: layer 0
reads ``cat(embed, hidden)`` and the later layers the hidden state only, the chained cached
inference of the reference decoder is the TTT unroll, a training step trains every tensor of every
layer, the export holds every layer and loads back, the dry run counts what is built, and bad
values are one line naming the key.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.eval.export import export, load_export
from draftsmith.models.common import LayerGeometry
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.format import expected_weight_shapes
from draftsmith.models.eagle3.model import Eagle3DraftModel, Eagle3KVCache
from draftsmith.models.eagle3.training import draft_parameter_count, parameter_estimate
from draftsmith.recipe import RecipeError, load_recipe

from helpers.tiny import random_eagle3_model as model_of, write_draft_checkpoint

H, V, VD, T = 64, 256, 128, 10
MLA = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def config(layer: str = "llama", num_layers: int = 2, **kw) -> Eagle3Config:
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if layer == "mla":
        heads = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24, **MLA)
    return Eagle3Config(hidden_size=H, intermediate_size=96, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 3],
                        max_position_embeddings=512, layer=layer, num_layers=num_layers, **heads, **kw)


def test_layer_zero_reads_the_embedding_and_later_layers_the_hidden_state():
    model = model_of(config(num_layers=3))
    first, *later = model.layers
    assert first.self_attn.q_proj.in_features == 2 * H and hasattr(first, "hidden_norm")
    for layer in later:
        assert layer.self_attn.q_proj.in_features == H and not hasattr(layer, "hidden_norm")
    assert set(model.state_dict()) - {"embed_tokens"} == set(expected_weight_shapes(model.config))
    # a later layer does not read the embedding: changing x_{t+1} moves the output through layer 0 only
    gen = torch.Generator().manual_seed(1)
    hidden, embeds = torch.randn(1, T, H, generator=gen), torch.randn(1, T, H, generator=gen)
    cos, sin = model.rotary_emb(hidden, torch.arange(T)[None])
    with torch.no_grad():
        out, _ = later[0](embeds, hidden, cos, sin, ())
        same, _ = later[0](torch.randn(1, T, H, generator=gen), hidden, cos, sin, ())
    torch.testing.assert_close(out, same, rtol=0, atol=0)


@pytest.mark.parametrize("layer,num_layers", [("llama", 2), ("llama", 3), ("qwen3", 2), ("mla", 2)])
def test_cached_chained_inference_is_the_ttt_unroll(layer, num_layers):
    """The reference decoder's chain (step 0 over the prompt, then one cached step per drafted token,
    one KV cache per layer) computes the TTT steps at the prompt's last position."""
    model = model_of(config(layer, num_layers)).eval()
    gen = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, V, (1, T), generator=gen), torch.randn(1, T, 3 * H, generator=gen)
    with torch.no_grad():
        ttt = model(ids, aux, ttt_steps=3)
        caches = [Eagle3KVCache() for _ in model.layers]
        g = model.fuse(aux)
        h0 = model.step_cached(ids[:, 1:T - 2], g[:, :T - 3], torch.arange(T - 3)[None], caches)
        h1 = model.step_cached(ids[:, T - 2:T - 1], model.next_hidden(h0[:, -1:]), torch.tensor([[T - 3]]), caches)
        h2 = model.step_cached(ids[:, T - 1:], model.next_hidden(h1), torch.tensor([[T - 2]]), caches)
        with pytest.raises(ValueError, match=f"1 KV caches for {num_layers} draft layers"):
            model.step_cached(ids[:, :1], g[:, :1], torch.zeros(1, 1, dtype=torch.long), Eagle3KVCache())
    assert [len(c) for c in caches] == [T - 1] * num_layers
    torch.testing.assert_close(model.compute_logits(h0), ttt[0][:, :T - 3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(h1)[:, 0], ttt[1][:, T - 4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(h2)[:, 0], ttt[2][:, T - 4], rtol=1e-5, atol=1e-5)


def test_a_training_step_trains_every_tensor_of_every_layer():
    model = model_of(config(num_layers=2))
    gen = torch.Generator().manual_seed(4)
    ids, aux = torch.randint(0, V, (2, T), generator=gen), torch.randn(2, T, 3 * H, generator=gen)
    labels = torch.randint(0, VD, (3, 2, T), generator=gen)
    logits = model(ids, aux, ttt_steps=3)
    sum(0.8**k * F.cross_entropy(lg.flatten(0, 1), labels[k].flatten()) for k, lg in enumerate(logits)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert any(name.startswith("layers.1.") for name, _ in model.named_parameters())


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
def test_export_holds_every_layer_and_loads_back(tmp_path, legacy):
    model = model_of(config(num_layers=2)).eval()
    write_draft_checkpoint(model, tmp_path / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    out = export(tmp_path / "ckpt", tmp_path / "export", legacy=legacy, embed_tokens=model.embed_tokens.clone())
    raw = json.loads((out / "config.json").read_text())
    layer_config = raw if legacy else raw["transformer_layer_config"]
    assert layer_config["num_hidden_layers"] == 2 and layer_config["layer_types"] == ["full_attention"] * 2
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.1.self_attn.q_proj.weight" in names and "layers.1.hidden_norm.weight" not in names
    assert ("midlayer.hidden_norm.weight" if legacy else "layers.0.hidden_norm.weight") in names
    loaded = load_export(out)
    assert loaded.config == model.config
    gen = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, V, (1, T), generator=gen), torch.randn(1, T, 3 * H, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, aux, ttt_steps=2), model(ids, aux, ttt_steps=2), rtol=0, atol=0)


@pytest.mark.parametrize("layer,num_layers", [("llama", 1), ("llama", 3), ("mla", 2)])
def test_the_dry_run_counts_the_layers_as_built(layer, num_layers):
    cfg = config(layer, num_layers)
    counts = draft_parameter_count(cfg)
    built = {n: p.numel() for n, p in Eagle3DraftModel(cfg).named_parameters()}
    assert counts["attention"] == sum(v for n, v in built.items() if ".self_attn." in n and "layernorm" not in n)
    assert counts["mlp"] == sum(v for n, v in built.items() if ".mlp." in n)
    assert sum(v for k, v in counts.items() if not k.startswith("frozen_")) == sum(built.values())


def test_the_recipe_key_reaches_the_dry_run_and_bad_values_are_one_line():
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    geometry = LayerGeometry.from_target(target, VD, [0, 1, 3])
    one, _ = parameter_estimate(load_recipe(None, []), geometry, V)
    two, _ = parameter_estimate(load_recipe(None, ["draft.num_layers=2"]), geometry, V)
    assert two["mlp"] == 2 * one["mlp"] and two["attention"] > one["attention"]
    with pytest.raises(RecipeError) as caught:
        load_recipe(None, ["draft.num_layers=0"])
    assert "draft.num_layers" in str(caught.value) and "\n" not in str(caught.value).strip()
    with pytest.raises(ValueError, match="num_layers must be a whole number of decoder layers >= 1, got 0"):
        config(num_layers=0)
