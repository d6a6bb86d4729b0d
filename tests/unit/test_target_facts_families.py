"""Target facts per family (``target/families.py``, ``target/facts.py``): the parameter count from
``config.json`` against the ``sum(p.numel())`` of a random transformers model built from a
shrunken copy of each family's config, the shipped real configs against their published sizes,
fp8 block-scale bytes, KV / recurrent-state bytes, and the geometry checks per family."""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftsmith.target import bundled_target_config
from draftsmith.target.facts import (
    config_from_json,
    target_facts,
    target_parameter_counts,
    target_weight_bytes,
    validate_geometry,
)

SMALL = dict(hidden_size=64, vocab_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, tie_word_embeddings=False)

# shrunken copies of each family's published config: every structural key the real one sets
TINY = {
    "qwen3_moe": dict(SMALL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen3_next": dict(SMALL, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=4,
                       full_attention_interval=2, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                       num_experts_per_tok=2, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                       mlp_only_layers=[2], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, mtp_num_hidden_layers=1),
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **SMALL,
                        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                        shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "deepseek_v3": dict(SMALL, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=3,
                        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        moe_layer_freq=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=12, num_nextn_predict_layers=1),
    "deepseek_v3_no_q_lora": dict(SMALL, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                                  num_hidden_layers=2, num_key_value_heads=4, intermediate_size=96,
                                  moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                  num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=12),
    "glm4_moe": dict(SMALL, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=3,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, intermediate_size=96,
                     moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     n_group=1, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=1),
    "gemma4": dict(SMALL, architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", num_hidden_layers=6,
                   tie_word_embeddings=True, intermediate_size=96, head_dim=16, global_head_dim=32,
                   num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                   enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
                   use_double_wide_mlp=True),
    "minimax_m2": dict(SMALL, architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", num_hidden_layers=2,
                       intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(SMALL, architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=2,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16),
}


def transformers_count(config_json: dict) -> int:
    """``sum(p.numel())`` of the transformers model of ``config_json`` (built on the meta device:
    shapes only), without the buffers vLLM loads as weights (counted by the facts, subtracted here:
    DeepSeek / GLM ``e_score_correction_bias``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_json(config_json))
    buffers = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("family", sorted(TINY))
def test_parameter_count_matches_a_tiny_transformers_model(family):
    cfg = TINY[family]
    ours = sum(target_parameter_counts(cfg).values())
    theirs = transformers_count(cfg)
    # transformers builds no MTP layers and these tiny models have every weight vLLM holds, so the
    # counts agree to the parameter (the ~1% budget is left unused)
    assert ours == theirs, (family, ours, theirs, target_parameter_counts(cfg))


def real(hub_id: str) -> dict:
    return json.loads(bundled_target_config(hub_id).read_text())


@pytest.mark.parametrize("hub_id, total, active, rel", [
    # model cards: total / activated parameters (without MTP layers)
    ("Qwen/Qwen3-30B-A3B", 30.5e9, 3.3e9, 0.02),
    ("Qwen/Qwen3-235B-A22B", 235e9, 22e9, 0.02),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 80e9, None, 0.01),
    ("deepseek-ai/DeepSeek-V3", 671e9, 37e9, 0.02),
    ("google/gemma-4-26B-A4B-it", 25.2e9, 3.8e9, 0.01),
    ("zai-org/GLM-4.5-Air", 106e9, None, 0.01),
])
def test_real_configs_match_the_published_sizes(hub_id, total, active, rel):
    facts = target_facts(real(hub_id))
    assert facts["parameters"] == pytest.approx(total, rel=rel)
    if active:
        assert facts["active_parameters"] == pytest.approx(active, rel=rel)


def test_mtp_layers_are_counted_apart_from_the_target():
    ds = target_facts(real("deepseek-ai/DeepSeek-V3"))
    assert ds["mtp_layers"] == 1 and ds["mtp_parameters"] == pytest.approx(14e9, rel=0.05)  # 685B = 671B + 14B
    assert ds["parameters"] + ds["mtp_parameters"] == pytest.approx(685e9, rel=0.01)
    # Qwen3-Next: one MTP layer of 1.65B beside the embedding it shares (81.3B with it, as the Hub counts)
    nxt = target_facts(real("Qwen/Qwen3-Next-80B-A3B-Instruct"))
    assert nxt["parameters"] + nxt["mtp_parameters"] == pytest.approx(81.3e9, rel=0.005)
    assert target_facts(real("Qwen/Qwen3-30B-A3B"))["mtp_parameters"] == 0


def test_fp8_block_scales_and_unconverted_modules():
    cfg = real("deepseek-ai/DeepSeek-V3")
    fp8, bf16 = target_weight_bytes(cfg), target_weight_bytes(dict(cfg, quantization_config=None))
    assert fp8["quantization"] == "fp8" and bf16["quantization"] is None
    # the published FP8 checkpoint (with its MTP layer) is ~688 GB; bf16 would be 2 B per parameter
    assert fp8["bytes"] + target_facts(cfg)["mtp_bytes"] == pytest.approx(688e9, rel=0.01)
    assert bf16["bytes"] == 2 * bf16["parameters"]
    # one expert's down_proj (7168 x 2048): 1 B per parameter + 56 x 16 fp32 block scales
    tiny = dict(TINY["qwen3_moe"], quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    counts = target_parameter_counts(tiny)
    quantised = counts["attention"] + counts["experts"] + counts["mlp"]
    blocks = target_weight_bytes(tiny)["bytes"] - 2 * (sum(counts.values()) - quantised) - quantised
    assert blocks % 4 == 0 and blocks > 0  # one fp32 scale per (ceil) 128 x 128 block of every linear
    skip = dict(tiny, quantization_config={**tiny["quantization_config"], "modules_to_not_convert": ["mlp.experts"]})
    experts = counts["experts"]
    assert target_weight_bytes(skip)["bytes"] > target_weight_bytes(tiny)["bytes"] + experts * 0.9


def test_kv_cache_and_recurrent_state_per_family():
    ds = target_facts(real("deepseek-ai/DeepSeek-V3"))
    assert ds["kv_bytes_per_token"] == 61 * (512 + 64) * 2  # MLA: the latent and the rope key per layer
    nxt = target_facts(real("Qwen/Qwen3-Next-80B-A3B-Instruct"))
    assert nxt["layer_kinds"] == {"linear_attention": 36, "full_attention": 12}
    assert nxt["kv_bytes_per_token"] == 12 * 2 * 2 * 256 * 2  # only the 12 full-attention layers keep KV
    conv, ssm = 3 * (2 * 16 * 128 + 32 * 128) * 2, 32 * 128 * 128 * 4
    assert nxt["state_bytes_per_sequence"] == 36 * (conv + ssm)
    gemma = target_facts(real("google/gemma-4-26B-A4B-it"))
    assert gemma["layer_kinds"] == {"sliding_attention": 25, "full_attention": 5}
    assert gemma["kv_bytes_per_token"] == 5 * 1 * 2 * 512 * 2  # global: 2 KV heads of 512, K = V
    assert gemma["sliding_kv_bytes_per_token"] == 25 * 2 * 8 * 256 * 2 and gemma["sliding_window"] == 1024


@pytest.mark.parametrize("hub_id, key", [
    ("deepseek-ai/DeepSeek-V3", "kv_lora_rank"),
    ("deepseek-ai/DeepSeek-V3", "qk_rope_head_dim"),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", "linear_num_value_heads"),
    ("Qwen/Qwen3-30B-A3B", "moe_intermediate_size"),
    ("meta-llama/Llama-3.1-8B-Instruct", "intermediate_size"),
])
def test_a_config_missing_what_its_family_needs_is_refused_in_one_line(hub_id, key):
    cfg = {k: v for k, v in real(hub_id).items() if k != key}
    with pytest.raises(ValueError, match=rf"^cfg\.json: target config key {re.escape(key)} missing") as err:
        validate_geometry(cfg, "cfg.json")
    assert "\n" not in str(err.value)


def test_every_family_accepts_its_real_config_without_dense_only_keys():
    for hub_id in ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-Next-80B-A3B-Instruct",
                   "deepseek-ai/DeepSeek-V3", "google/gemma-4-26B-A4B-it", "zai-org/GLM-4.5-Air",
                   "openai/gpt-oss-120b"):
        validate_geometry(real(hub_id), hub_id)
    # an all-MoE Qwen3.5 text config has no intermediate_size at all, and needs none
    validate_geometry(dict(TINY["qwen3_5_moe"]), "qwen3.5")


def test_a_family_without_eagle3_in_vllm_is_refused_naming_the_key_and_what_works(tmp_path):
    from draftsmith.data_prep.preflight import preflight
    from draftsmith.recipe import load_recipe

    target = tmp_path / "GLM-4.5-Air"
    target.mkdir()
    (target / "config.json").write_text(bundled_target_config("zai-org/GLM-4.5-Air").read_text())
    recipe = load_recipe(None, [f"target.name_or_path={target}"])
    with pytest.raises(ValueError) as err:
        preflight(recipe)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"target.name_or_path={target}: architecture Glm4MoeForCausalLM")
    assert "SupportsEagle3" in line and "method mtp" in line


def test_the_eagle3_table_is_the_installed_vllm_sources():
    """Re-derive :data:`EAGLE3_TARGET_ARCHITECTURES` from vLLM's registry and model files by the
    AST (no vLLM import): a registered architecture whose class derives from SupportsEagle3."""
    import ast
    import importlib.util
    from pathlib import Path

    from draftsmith.vllm_bridge.eagle3_targets import EAGLE3_TARGET_ARCHITECTURES
    from draftsmith.vllm_bridge.releases import installed_vllm_version, release_line

    spec = importlib.util.find_spec("vllm")
    version = installed_vllm_version()
    if spec is None or version is None or release_line(version) != (0, 32):
        pytest.skip("the table is read from vLLM 0.32's sources")
    models = Path(spec.submodule_search_locations[0]) / "model_executor" / "models"
    archs = {}
    for node in ast.parse((models / "registry.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("_TEXT_GENERATION_MODELS",
                                                                                  "_MULTIMODAL_MODELS"):
            archs.update({k.value: v.elts[1].value for k, v in zip(node.value.keys, node.value.values)
                          if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple)})
    bases: dict[str, set[str]] = {}
    for path in models.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute)))

    def eagle3(name: str, seen: frozenset = frozenset()) -> bool:
        return name == "SupportsEagle3" or (name not in seen and any(eagle3(b, seen | {name})
                                                                    for b in bases.get(name, ())))

    assert {arch for arch, cls in archs.items() if eagle3(cls)} == EAGLE3_TARGET_ARCHITECTURES


def test_a_target_larger_than_a_node_says_how_many_nodes():
    from draftsmith.data_prep.plan import Cluster, PlanError, nodes_needed, tensor_parallel_size

    weights = target_weight_bytes(real("Qwen/Qwen3-235B-A22B"))["bytes"]  # 438 GiB in bf16
    assert tensor_parallel_size(weights, Cluster(1, 8, 141), 0.9, 64) == 8  # one H200 node
    assert nodes_needed(weights, Cluster(1, 8, 80), 0.85) == 2
    with pytest.raises(PlanError, match=r"span 2 such nodes \(tensor_parallel_size 8 x pipeline_parallel_size 2\)"):
        tensor_parallel_size(weights, Cluster(1, 8, 80), 0.85, 64)
