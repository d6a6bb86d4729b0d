"""EAGLE-3 export formats have one owner (Eagle3Config.to_/from_speculators, to_/from_legacy):
what export writes, the loaders read back unchanged, in both RoPE spellings."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.eval.export import export
from draftsmith.models.eagle3.format import load_eagle3
from draftsmith.models.common import rope_theta_and_scaling
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel

from helpers.tiny import write_draft_checkpoint

H, V, VD = 32, 64, 48
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048}


def tiny(**kw) -> Eagle3Config:
    return Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 2, 3],
                        max_position_embeddings=8192, **kw)


CONFIGS = {
    "default_rope": tiny(),
    "llama3_rope": tiny(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, norm_before_residual=False),
    "wide_target": tiny(target_hidden_size=48, rms_norm_eps=1e-6, hidden_act="gelu"),
    "biases": tiny(attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_speculators_config_round_trips(name):
    cfg = CONFIGS[name]
    written = cfg.to_speculators({"name_or_path": "t", "architectures": []}, 3, "float32", "0.3.0", {})
    assert Eagle3Config.from_speculators(json.loads(json.dumps(written))) == cfg


@pytest.mark.parametrize("name", CONFIGS)
def test_legacy_config_round_trips(name):
    cfg = CONFIGS[name]
    written = cfg.to_legacy("float32", {})
    assert Eagle3Config.from_legacy(json.loads(json.dumps(written))) == cfg
    assert Eagle3Config.from_export(written) == cfg


def test_speculators_config_without_norm_before_residual_reads_as_vllm_does():
    written = tiny(norm_before_residual=False).to_speculators({}, 3, "float32", "0.3.0", {})
    del written["norm_before_residual"]
    assert Eagle3Config.from_speculators(written).norm_before_residual is True
    legacy = tiny(norm_before_residual=True).to_legacy("float32", {})
    del legacy["norm_before_residual"]
    assert Eagle3Config.from_legacy(legacy).norm_before_residual is False


def test_export_without_aux_layer_ids_is_an_error():
    written = tiny().to_speculators({}, 3, "float32", "0.3.0", {})
    del written["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_export(written)


def test_rope_parameters_and_rope_scaling_spellings_normalise_alike():
    new = rope_theta_and_scaling({"rope_theta": 500000.0, **LLAMA3_ROPE})
    old = rope_theta_and_scaling(None, 500000.0, LLAMA3_ROPE)
    assert new == old == (500000.0, LLAMA3_ROPE)
    assert rope_theta_and_scaling({"rope_type": "default", "rope_theta": 1e6}) == (1e6, None)
    assert rope_theta_and_scaling(None) == (10000.0, None)


def test_rope_parameters_invert_the_normalisation():
    cfg = CONFIGS["llama3_rope"]
    assert rope_theta_and_scaling(cfg.rope_parameters()) == (cfg.rope_theta, cfg.rope_scaling)


def test_from_target_reads_transformers_rope_parameters():
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, vocab_size=V, num_hidden_layers=4, max_position_embeddings=8192,
                         rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})
    cfg = Eagle3Config.from_target(target, VD, [0, 2, 3], norm_before_residual=False)
    assert (cfg.rope_theta, cfg.rope_scaling) == (500000.0, LLAMA3_ROPE)


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
@pytest.mark.parametrize("name", CONFIGS)
def test_exported_draft_loads_back_equal(tmp_path, name, legacy):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    embed = torch.randn(V, H)
    model.set_vocab_mapping(torch.arange(VD), torch.arange(V) < VD)
    model.init_from_target(embed)
    ckpt = tmp_path / "ckpt"
    state = write_draft_checkpoint(model, ckpt, "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)

    loaded = load_eagle3(export(ckpt, tmp_path / "export", legacy=legacy), embed)

    assert loaded.config == cfg
    reloaded = loaded.state_dict()
    assert set(reloaded) == set(model.state_dict())
    for k, v in state.items():
        torch.testing.assert_close(reloaded[k], v, rtol=0, atol=0, msg=k)


def test_loading_an_export_without_aux_layer_ids_names_the_config_file(tmp_path):
    from draftsmith.eval.spec_decode import DraftLoadError

    written = tiny().to_speculators({}, 3, "float32", "0.3.0", {})
    del written["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(DraftLoadError, match=r"config\.json: no eagle_aux_hidden_state_layer_ids"):
        load_eagle3(tmp_path, torch.zeros(V, H))


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
def test_biases_are_exported_under_the_names_and_config_keys_vllm_reads(tmp_path, legacy):
    # vLLM's llama_eagle3 layer: attention_bias -> qkv_proj and o_proj biases, mlp_bias -> gate_up_proj and
    # down_proj biases, read from the layer config and loaded from {q,k,v,o}_proj.bias / {gate,up,down}_proj.bias
    from safetensors.torch import load_file

    cfg = tiny(attention_bias=True, mlp_bias=False)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    ckpt = tmp_path / "ckpt"
    state = write_draft_checkpoint(model, ckpt, "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    out = export(ckpt, tmp_path / "export", legacy=legacy)
    written = load_file(str(out / "model.safetensors"))
    prefix = "midlayer." if legacy else "layers.0."
    biases = sorted(k for k in written if k.endswith(".bias"))
    assert biases == sorted(f"{prefix}self_attn.{p}_proj.bias" for p in "qkvo")
    for k in biases:
        assert torch.equal(written[k], state[k.replace("midlayer.", "layers.0.")])
    config = json.loads((out / "config.json").read_text())
    layer = config if legacy else config["transformer_layer_config"]
    assert (layer["attention_bias"], layer["mlp_bias"]) == (True, False)


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
def test_export_facts_read_either_format_as_from_export_does(legacy):
    from draftsmith.models.eagle3.config import Eagle3ExportFacts

    cfg = tiny(target_hidden_size=48, norm_before_residual=False)
    verifier = {"name_or_path": "t", "architectures": ["LlamaForCausalLM"]}
    written = json.loads(json.dumps(cfg.to_legacy("float32", {}) if legacy else
                                    cfg.to_speculators(verifier, 5, "float32", "0.3.0", {})))
    facts = Eagle3Config.export_facts(written)
    assert facts == Eagle3ExportFacts(
        format="legacy" if legacy else "speculators", aux_layer_ids=[0, 2, 3], draft_vocab_size=VD, vocab_size=V,
        hidden_size=H, target_hidden_size=48, norm_before_residual=False,
        num_speculative_tokens=None if legacy else 5, verifier={} if legacy else verifier)
    del written["norm_before_residual"]  # vLLM's defaults, as from_export
    assert Eagle3Config.export_facts(written).norm_before_residual is (not legacy)
    assert Eagle3Config.from_export(written).norm_before_residual is (not legacy)
