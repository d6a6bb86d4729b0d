"""Every shipped recipe passes the dry run against its target's config (built in code, no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.methods import registered_methods
from draftsmith.recipe import load_recipe
from draftsmith.train.dry_run import dry_run, format_report

RECIPES = Path(__file__).parent.parent / "recipes"


def target_config(name: str):
    """Published geometries of the recipes' targets."""
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config

    if name == "gptoss120b":
        return GptOssConfig(num_hidden_layers=36, num_local_experts=128)
    if name == "gptoss20b":
        return GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    if name == "llama3_1_8b":
        return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192})
    if name == "qwen3_8b":
        return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936)
    return None


# decoder layers N of each recipe's target (published configs; SmolLM2-135M: 30)
TARGET_LAYERS = {"gptoss120b": 36, "gptoss20b": 24, "llama3_1_8b": 32, "qwen3_8b": 36, "smollm2_135m": 30}


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipe_passes_dry_run(path, tmp_path):
    recipe = load_recipe(path)
    # the other methods' recipes (<target>_<method>.yaml) share their target's config with the EAGLE-3 one
    target = path.stem
    for method in registered_methods():
        target = target.removesuffix(f"_{method}")
    cfg = target_config(target)
    config_file = None
    if cfg is not None:
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
        cfg.save_pretrained(tmp_path)
        config_file = tmp_path / "config.json"
    report = dry_run(recipe, config_file)
    n = TARGET_LAYERS[target]
    assert report["target_layers"] == n
    # every shipped recipe uses vLLM's default layers (2, N//2, N-3), named or not
    assert report["aux_layer_ids"] == [2, n // 2, n - 3]
    assert report["aux_layer_ids_are_vllm_default"]
    assert report["draft_trainable_parameters"] > 0
    assert "aux layer ids" in format_report(report)
    # the recipe's launcher (when it names one) was validated and is reported
    assert (report["launcher"] is None) == (recipe.launcher is None)


def test_gptoss120b_dry_run_figures(tmp_path):
    cfg = target_config("gptoss120b")
    cfg.save_pretrained(tmp_path)
    r = dry_run(load_recipe(RECIPES / "gptoss120b.yaml"), tmp_path / "config.json")
    assert r["target_layers"] == 36 and r["aux_layer_ids"] == [2, 18, 33]
    assert r["hidden_state_bytes_per_token"] == 4 * 2880 * 2  # ~23 KB per token in bf16
    assert r["offline_disk_bytes"] == r["hidden_state_bytes_per_token"] * r["expected_tokens"]
    assert r["draft_parameters"]["lm_head"] == 32000 * 2880
    assert r["rope"]["rope_scaling"]["rope_type"] == "yarn"  # the draft copies the target's YaRN


def test_dry_run_rejects_out_of_range_layers(tmp_path):
    cfg = target_config("gptoss20b")
    cfg.save_pretrained(tmp_path)
    recipe = load_recipe(RECIPES / "gptoss20b.yaml", ["data.aux_layer_ids=[2, 18, 33]"])
    with pytest.raises(ValueError, match="out of range for a target with 24"):
        dry_run(recipe, tmp_path / "config.json")


def test_launcher_configs_parse_with_accelerate():
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted((RECIPES / "accelerate").glob("*.yaml"))
    assert len(files) >= 4
    for f in files:
        cfg = load_config_from_file(str(f))
        assert cfg.num_processes >= 1


def llama_config_file(tmp_path):
    cfg = target_config("llama3_1_8b")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    return tmp_path / "config.json"


def test_dry_run_reports_the_fsdp_launcher_and_per_gpu_memory(tmp_path):
    r = dry_run(load_recipe(RECIPES / "llama3_1_8b_medusa.yaml"), llama_config_file(tmp_path))
    launch, mem, gpu = r["launcher"], r["memory_bytes"], r["memory_bytes_per_gpu"]
    assert launch["path"].endswith("recipes/accelerate/fsdp_8gpu.yaml")
    assert (launch["distributed_type"], launch["num_processes"], launch["mixed_precision"]) == ("FSDP", 8, "bf16")
    assert launch["wrap_classes"] == ["MedusaBlock"]
    # FSDP shards weights, gradients and AdamW state over the 8 ranks
    assert gpu["draft_weights_fp32"] == mem["draft_weights_fp32"] // 8
    assert gpu["adamw_state_fp32"] == mem["adamw_state_fp32"] // 8
    # the root unit (the 3 lm_heads, 128256 x 4096 each) is gathered whole in bf16
    assert gpu["fsdp_gathered_root"] == 3 * 128256 * 4096 * 2
    assert "FSDP2 units: MedusaBlock, root" in format_report(r)


def test_dry_run_zero2_shards_optimizer_state_and_gradients_only(tmp_path):
    r = dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml"), llama_config_file(tmp_path),
                RECIPES / "accelerate/multinode_2x8.yaml")
    mem, gpu = r["memory_bytes"], r["memory_bytes_per_gpu"]
    assert r["launcher"]["zero_stage"] == 2 and r["launcher"]["num_processes"] == 16
    assert gpu["draft_weights_fp32"] == mem["draft_weights_fp32"]
    assert gpu["gradients_fp32"] == mem["gradients_fp32"] // 16
    assert gpu["adamw_state_fp32"] == mem["adamw_state_fp32"] // 16


def test_dry_run_refuses_a_launcher_that_does_not_fit(tmp_path):
    bad = tmp_path / "fsdp_eagle.yaml"
    bad.write_text((RECIPES / "accelerate/fsdp_8gpu.yaml").read_text().replace(
        "  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_transformer_layer_cls_to_wrap: Eagle3DecoderLayer\n"))
    recipe = load_recipe(RECIPES / "llama3_1_8b_mlp_speculator.yaml", [f"launcher={bad}"])
    with pytest.raises(ValueError, match="fsdp_transformer_layer_cls_to_wrap: Eagle3DecoderLayer is not a block of "
                                         "MLPSpeculator"):
        dry_run(recipe, llama_config_file(tmp_path))
