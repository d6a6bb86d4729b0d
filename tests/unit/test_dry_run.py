"""Every shipped recipe passes the dry run against its target's config (shipped under recipes/targets/, no
hub); the per-GPU estimate, its refusal above the device memory and the bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.methods import registered_methods
from draftsmith.recipe import load_recipe
from draftsmith.target import bundled_target_config
from draftsmith.train.dry_run import check_fits, dry_run, format_report

from helpers.recipes import RECIPES as SHIPPED

RECIPES = Path(__file__).parents[2] / "recipes"


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
TARGET_LAYERS = {"gptoss120b": 36, "gptoss20b": 24, "llama3_1_8b": 32, "qwen3_8b": 36, "smollm2_135m": 30,
                 "qwen3_30b_a3b": 48, "qwen3_235b_a22b": 94, "qwen3_next_80b": 48, "deepseek_v3": 61, "gemma4_26b_a4b": 30}


def target_of(path: Path) -> str:
    """The target part of a recipe name (<target>_<method>.yaml and the EAGLE-3.1 variants
    <target>_eagle31.yaml share their target's config)."""
    target = path.stem.removesuffix("_eagle31")
    for method in registered_methods():
        target = target.removesuffix(f"_{method}")
    return target


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_passes_dry_run(path, shipped_recipes):
    """Offline: the GPU recipes' targets are read from recipes/targets/, SmolLM2 is embedded."""
    recipe = shipped_recipes[path.stem]
    report = dry_run(recipe)
    target = target_of(path)
    n = TARGET_LAYERS[target]
    assert report["target_layers"] == n
    # every shipped recipe uses vLLM's default layers (2, N//2, N-3), named or not
    assert report["aux_layer_ids"] == [2, n // 2, n - 3]
    assert report["aux_layer_ids_are_vllm_default"]
    assert report["draft_trainable_parameters"] > 0
    assert "aux layer ids" in format_report(report) and "per-GPU memory" in format_report(report)
    # the recipe's launcher (when it names one) was validated and is reported
    assert (report["launcher"] is None) == (recipe.launcher is None)
    if target != "smollm2_135m":  # a GPU recipe: its bundled config, and it fits one 80 GB GPU
        assert report["target_config"].endswith(f"recipes/targets/{recipe.target.name_or_path}/config.json")
        check_fits(report, 80)
        assert report["estimate"]["per_gpu_bytes"] < 78 * 2**30


@pytest.mark.parametrize("name", ["gptoss120b", "gptoss20b", "llama3_1_8b", "qwen3_8b"])
def test_bundled_target_configs_have_the_published_geometry(name):
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    path = bundled_target_config(recipe.target.name_or_path)
    assert path is not None and path.is_relative_to(RECIPES / "targets")
    shipped = json.loads(path.read_text())
    published = target_config(name).to_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size"):
        assert shipped[key] == published[key], key
    assert shipped["architectures"] == [type(target_config(name)).__name__.replace("Config", "ForCausalLM")]


def test_gptoss120b_dry_run_figures(tmp_path):
    cfg = target_config("gptoss120b")
    cfg.save_pretrained(tmp_path)
    r = dry_run(load_recipe(RECIPES / "gptoss120b.yaml"), tmp_path / "config.json")
    assert r["target_layers"] == 36 and r["aux_layer_ids"] == [2, 18, 33]
    # row-scaled fp8: 1 byte per state value, a float32 scale per aux layer and the final state,
    # an int32 token id and a uint8 loss mask
    assert r["hidden_state_bytes_per_token"] == 4 * 2880 * 1 + 4 * 4 + 4 + 1
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
    """A copy of the shipped Llama-3.1-8B-Instruct config (--target-config given explicitly)."""
    path = tmp_path / "config.json"
    path.write_text((RECIPES / "targets/meta-llama/Llama-3.1-8B-Instruct/config.json").read_text())
    return path


def test_dry_run_reports_the_fsdp_launcher_and_per_gpu_memory(tmp_path):
    r = dry_run(load_recipe(RECIPES / "llama3_1_8b_medusa.yaml"), llama_config_file(tmp_path))
    launch, est, gpu = r["launcher"], r["estimate"], r["memory_bytes_per_gpu"]
    assert launch["path"].endswith("recipes/accelerate/fsdp_8gpu.yaml")
    assert (launch["distributed_type"], launch["num_processes"], launch["mixed_precision"]) == ("FSDP", 8, "bf16")
    assert launch["wrap_classes"] == ["MedusaBlock"]
    N = r["draft_trainable_parameters"]
    # FSDP shards fp32 weights, gradients and AdamW state over the 8 ranks (bf16 autocast path)
    assert est["precision"] == "amp-bf16"
    assert (gpu["weights"], gpu["gradients"], gpu["optimizer_state"]) == (4 * N // 8, 4 * N // 8, 8 * N // 8)
    # the fused loss (a GPU's default) frees each head's bf16 lm_head copy after its call and holds its
    # bf16 gradients (128256 x 4096, and the rows') to backward; the chunked loss keeps the copies instead
    rows = 8 * 2048
    assert est["activations"]["head_weight_copies"] == 0
    assert est["activations"]["fused_loss_gradients"] == 3 * (128256 + rows) * 4096 * 2
    chunked = dry_run(load_recipe(RECIPES / "llama3_1_8b_medusa.yaml", ["train.fused_loss=false"]),
                      llama_config_file(tmp_path))["estimate"]
    assert chunked["activations"]["head_weight_copies"] == 3 * 128256 * 4096 * 2
    assert gpu["total"] == est["per_gpu_bytes"] == max(est["forward_backward_bytes"], est["optimizer_bytes"])
    assert "FSDP2 units: MedusaBlock, root" in format_report(r)


def test_dry_run_zero2_shards_optimizer_state_and_gradients_only(tmp_path):
    r = dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml"), llama_config_file(tmp_path),
                RECIPES / "accelerate/multinode_2x8.yaml")
    state = r["estimate"]["state"]
    N = r["draft_trainable_parameters"]
    assert r["launcher"]["zero_stage"] == 2 and r["launcher"]["num_processes"] == 16
    assert r["estimate"]["precision"] == "bf16"  # DeepSpeed casts the weights; fp32 masters in its optimizer
    assert state["weights"] == 2 * N + 4 * N // 16
    assert state["gradients"] == 2 * N // 16 + 4 * N // 16
    assert state["optimizer_state"] == 8 * N // 16 and state["optimizer_shards"] == 16


def test_dry_run_memory_terms_follow_their_dtypes(tmp_path):
    """The frozen embedding, the teacher head and (on a GPU) the teacher logits in the target's
    dtype, the hidden states in data.hidden_states_dtype."""
    cfg = llama_config_file(tmp_path)
    bf16 = dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml", ["data.hidden_states_dtype=bfloat16"]), cfg)["estimate"]
    fp32 = dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml", ["target.dtype=float32",
                                                              "data.hidden_states_dtype=float32"]), cfg)["estimate"]
    assert bf16["frozen"]["frozen_embedding"] == 128256 * 4096 * 2 and fp32["frozen"]["frozen_embedding"] == 128256 * 4096 * 4
    assert bf16["frozen"]["teacher_head"] == 32000 * 4096 * 2
    assert bf16["activations"]["teacher"] == 4 * 2048 * 32000 * 2 and fp32["activations"]["teacher"] == 4 * 2048 * 32000 * 4
    assert fp32["batch"] - bf16["batch"] == 4 * 2048 * 4 * 4096 * 2
    # longer sequences and gradient checkpointing move the estimate the way they move memory
    longer = dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml", ["data.max_length=4096"]), cfg)["estimate"]
    ckpt = dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml", ["draft.gradient_checkpointing=true"]), cfg)["estimate"]
    assert longer["per_gpu_bytes"] > 1.8 * (bf16["per_gpu_bytes"] - sum(bf16["state"].values()) // 2)
    assert ckpt["activations"]["layers"] < bf16["activations"]["layers"] / 2


def test_dry_run_refuses_a_config_without_a_geometry_key(tmp_path):
    cfg = json.loads((RECIPES / "targets/meta-llama/Llama-3.1-8B-Instruct/config.json").read_text())
    del cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_attention_heads missing"):
        dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml"), tmp_path / "config.json")


def test_dry_run_refuses_a_length_beyond_the_target():
    with pytest.raises(ValueError, match=r"data.max_length=65536 exceeds the target's max_position_embeddings=40960"):
        dry_run(load_recipe(RECIPES / "qwen3_8b.yaml", ["data.max_length=65536"]))


def test_train_dry_run_refuses_a_step_beyond_device_memory(tmp_path, capsys, monkeypatch):
    """Exit 2, one line naming the three keys that reduce it; nothing written."""
    from draftsmith.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    recipe = str(RECIPES / "llama3_1_8b.yaml")
    rc = cli_main(["train", recipe, "--dry-run", "--set", "train.batch_size=64"])
    err = [line for line in capsys.readouterr().err.splitlines() if " INFO " not in line]
    assert rc == 2 and len(err) == 1
    for key in ("train.batch_size=64", "data.max_length=2048", "draft.gradient_checkpointing", "80 GiB"):
        assert key in err[0]
    assert list(tmp_path.iterdir()) == []
    # a smaller device: the shipped recipe itself is refused; the default 80 GiB passes it
    assert cli_main(["train", recipe, "--dry-run", "--device-memory-gib", "8"]) == 2
    assert cli_main(["train", recipe, "--dry-run"]) == 0
    assert "per-GPU memory" in capsys.readouterr().out


def test_dry_run_refuses_a_launcher_that_does_not_fit(tmp_path):
    bad = tmp_path / "fsdp_eagle.yaml"
    bad.write_text((RECIPES / "accelerate/fsdp_8gpu.yaml").read_text().replace(
        "  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_transformer_layer_cls_to_wrap: Eagle3DecoderLayer\n"))
    recipe = load_recipe(RECIPES / "llama3_1_8b_mlp_speculator.yaml", [f"launcher={bad}"])
    with pytest.raises(ValueError, match="fsdp_transformer_layer_cls_to_wrap: Eagle3DecoderLayer is not a block of "
                                         "MLPSpeculator"):
        dry_run(recipe, llama_config_file(tmp_path))


# ---------------------------------------------------------------------------------------------
# the fused loss: counted for every method whose step runs it, decided as the step decides

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TINY_SETS = ["data.draft_vocab_size=256", "data.aux_layer_ids=[1,2,3]", "train.batch_size=2", "data.max_length=32"]
# the methods whose loss runs through chunked_distill (the fused loss's one caller); DSpark and XPress
# compute their own chunked losses
FUSED_METHODS = {"eagle3", "medusa", "mlp_speculator", "dflash", "dflash2", "peagle"}


def tiny_recipe(method: str, setting: str, *more: str):
    from benchmarks.memory import bench_recipe

    name = "smollm2_135m" if method == "eagle3" else f"smollm2_135m_{method}"
    sets = TINY_SETS + [f"train.fused_loss={setting}", *more]
    if method in ("dflash", "dflash2", "dspark", "xpress"):
        sets += ["draft.num_anchors=8", "draft.block_size=4"]
    if method in ("dflash2", "xpress"):  # full-vocab drafts
        sets += ["data.draft_vocab_size=512"]
    return bench_recipe(load_recipe(RECIPES / f"{name}.yaml", sets), 2, 32)


@pytest.mark.parametrize("method, setting", [(m, "auto") for m in sorted(
    ["eagle3", "medusa", "mlp_speculator", "dflash", "dflash2", "peagle", "dspark", "xpress"])]
    + [("eagle3", "false"), ("dflash", "false"), ("peagle", "false")])
def test_the_estimate_counts_the_fused_loss_where_the_step_runs_it(method, setting, monkeypatch):
    """The fake GPU step of ``draftsmith bench memory`` (the device check answering as CUDA does; the
    fused kernel shape-only) runs the method's real loss: the estimate counts the fused loss's held
    gradients exactly for the methods whose step ran the kernel, and its peak stays near the
    measured one. The deprecated process-wide setting says the opposite of the recipe's: the
    methods pass their own."""
    from benchmarks.memory import Precision, measure_step
    from draftsmith.train import losses
    from draftsmith.train.dry_run import estimate_inputs, memory_estimate

    assert method in registered_methods()
    monkeypatch.setattr(losses, "FUSED_LOSS", setting == "false")
    r = tiny_recipe(method, setting)
    measured = measure_step(r, TINY, None, Precision.of(None, "fp32"), device="fake")
    est = memory_estimate(r, *estimate_inputs(r, TINY), None, "fp32")
    want = "fused" if setting == "auto" and method in FUSED_METHODS else "chunked"
    assert measured.extra["loss_path"] == want
    assert est["loss_path"] == want
    assert 0.8 <= est["per_gpu_bytes"] / measured.per_gpu_bytes <= 1.25


def test_the_dry_run_decides_the_fused_loss_by_the_steps_predicate(monkeypatch):
    """``train.fused_loss``, a loss kind the kernel lacks, a method that keeps DFlash's loss or not:
    the estimate follows :func:`~draftsmith.train.losses.uses_fused_loss`, whatever this machine's Triton."""
    from draftsmith.train import fused_loss as fl
    from draftsmith.train.dry_run import estimate_inputs, memory_estimate

    def path(method, setting="auto"):
        r = tiny_recipe(method, setting)
        return memory_estimate(r, *estimate_inputs(r, TINY), None, "amp-bf16")["loss_path"]

    monkeypatch.setattr(fl, "triton", None)
    for method in ("eagle3", "dflash", "dflash2", "peagle", "medusa", "mlp_speculator"):
        assert path(method) == "fused", method
        assert path(method, "false") == "chunked", method
    for method in ("dspark", "xpress"):
        assert path(method) == "chunked", method
    monkeypatch.setattr(fl, "KINDS", {k: v for k, v in fl.KINDS.items() if k != "forward_kl"})
    assert path("dflash") == "chunked"  # draft.loss forward_kl: no kernel for it
    assert path("medusa") == "fused"  # the heads' cross-entropy: any draft.loss
