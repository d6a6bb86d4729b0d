"""accelerate launcher configs against recipes and draft models: checked in-process, no
processes launched, no GPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from draftsmith.recipe import load_recipe
from draftsmith.train.launchers import LauncherError, check_runtime, draft_model_class, validate_launcher

from helpers.recipes import RECIPES as SHIPPED

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
LAUNCHERS = sorted((RECIPES / "accelerate").glob("*.yaml"))
WITH_LAUNCHER = [p for p in SHIPPED if yaml.safe_load(p.read_text()).get("launcher")]  # read, not loaded, to collect
METHODS = ["eagle3", "medusa", "mlp_speculator"]


def write_launcher(tmp_path: Path, base: str, edit) -> Path:
    """A copy of ``recipes/accelerate/<base>.yaml`` changed by ``edit(tree)``."""
    tree = yaml.safe_load((RECIPES / "accelerate" / f"{base}.yaml").read_text())
    edit(tree)
    path = tmp_path / f"{base}_edited.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_shipped_recipes_name_launchers():
    assert len(WITH_LAUNCHER) >= 5


@pytest.mark.parametrize("path", WITH_LAUNCHER, ids=lambda p: p.stem)
def test_shipped_recipe_validates_with_its_launcher(path, shipped_recipes):
    recipe = shipped_recipes[path.stem]
    report = validate_launcher(recipe, recipe.launcher)
    assert report.path.resolve() == (ROOT / recipe.launcher).resolve()
    assert report.gradient_clipping == recipe.train.max_grad_norm
    assert report.mixed_precision == "bf16"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.stem)
def test_every_shipped_launcher_fits_every_draft_method(launcher, method):
    recipe = load_recipe(None, [f"draft.method={method}"])
    validate_launcher(recipe, launcher)


@pytest.mark.parametrize("method, blocks", [("eagle3", ["Eagle3DecoderLayer"]), ("medusa", ["MedusaBlock"]),
                                            ("mlp_speculator", [])])
def test_fsdp_launcher_wraps_the_models_own_blocks(method, blocks):
    report = validate_launcher(load_recipe(None, [f"draft.method={method}"]), RECIPES / "accelerate/fsdp_8gpu.yaml")
    assert report.wrap_classes == blocks and report.wrap_source == "model _no_split_modules"
    assert report.sharded == ("weights", "gradients", "optimizer state")


def tiny_models():
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.model import Eagle3DraftModel
    from draftsmith.models.medusa.model import MedusaConfig, MedusaModel
    from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig

    eagle = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, vocab_size=64, draft_vocab_size=32, aux_layer_ids=[0, 1, 2])
    return {
        "eagle3": (Eagle3DraftModel(eagle), ["layers.0"]),
        "medusa": (MedusaModel(MedusaConfig(hidden_size=16, vocab_size=64, num_heads=2)), ["blocks.0", "blocks.1"]),
        "mlp_speculator": (MLPSpeculator(MLPSpeculatorConfig(emb_dim=16, inner_dim=16, vocab_size=64, n_predict=3,
                                                             tie_weights=True)), []),
    }


@pytest.mark.parametrize("method", METHODS)
def test_accelerate_fsdp2_policy_picks_the_blocks_from_no_split_modules(method):
    """What fsdp_8gpu.yaml (TRANSFORMER_BASED_WRAP, no class named) makes accelerate wrap below the root."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    model, units = tiny_models()[method]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [name for name, module in model.named_modules() if policy(module)] == units
    assert draft_model_class(method) is type(model)


def test_wrap_class_the_model_lacks_names_file_key_and_blocks(tmp_path):
    path = write_launcher(tmp_path, "fsdp_8gpu",
                          lambda t: t["fsdp_config"].update(fsdp_transformer_layer_cls_to_wrap="Eagle3DecoderLayer"))
    with pytest.raises(LauncherError) as err:
        validate_launcher(load_recipe(None, ["draft.method=medusa"]), path)
    msg = str(err.value)
    assert str(path) in msg and "fsdp_config.fsdp_transformer_layer_cls_to_wrap" in msg
    assert "Eagle3DecoderLayer is not a block of MedusaModel" in msg and "['MedusaBlock']" in msg


def test_wrap_class_the_model_has_is_accepted(tmp_path):
    path = write_launcher(tmp_path, "fsdp_8gpu",
                          lambda t: t["fsdp_config"].update(fsdp_transformer_layer_cls_to_wrap="Eagle3DecoderLayer"))
    report = validate_launcher(load_recipe(None), path)
    assert report.wrap_classes == ["Eagle3DecoderLayer"] and report.wrap_source == "launcher"


@pytest.mark.parametrize("base", ["deepspeed_zero2_8gpu", "multinode_2x8"])
def test_contradicting_deepspeed_gradient_clipping_names_file_and_key(tmp_path, base):
    path = write_launcher(tmp_path, base, lambda t: t["deepspeed_config"].update(gradient_clipping=1.0))
    with pytest.raises(LauncherError) as err:
        validate_launcher(load_recipe(None, ["train.max_grad_norm=0.5"]), path)
    msg = str(err.value)
    assert str(path) in msg and "deepspeed_config.gradient_clipping: 1.0" in msg and "train.max_grad_norm=0.5" in msg


def test_deepspeed_gradient_clipping_equal_to_the_recipe_is_accepted(tmp_path):
    path = write_launcher(tmp_path, "deepspeed_zero2_8gpu",
                          lambda t: t["deepspeed_config"].update(gradient_clipping=0.5))
    assert validate_launcher(load_recipe(None, ["train.max_grad_norm=0.5"]), path).zero_stage == 2


def test_clipping_in_a_deepspeed_json_file_is_checked(tmp_path):
    (tmp_path / "ds.json").write_text('{"gradient_clipping": 2.0, "zero_optimization": {"stage": 2}}')

    def edit(t):
        t["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json")}

    with pytest.raises(LauncherError, match=r"deepspeed_config_file .*ds\.json\): gradient_clipping: 2\.0"):
        validate_launcher(load_recipe(None), write_launcher(tmp_path, "deepspeed_zero2_8gpu", edit))


def test_zero_stage_of_a_deepspeed_json_file_is_reported(tmp_path):
    (tmp_path / "ds.json").write_text('{"gradient_clipping": "auto", "zero_optimization": {"stage": 1}}')

    def edit(t):
        t["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json")}

    report = validate_launcher(load_recipe(None), write_launcher(tmp_path, "deepspeed_zero2_8gpu", edit))
    assert report.zero_stage == 1 and report.sharded == ("optimizer state",)


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_mixed_precision_other_than_bf16_is_refused(tmp_path, precision):
    path = write_launcher(tmp_path, "fsdp_8gpu", lambda t: t.update(mixed_precision=precision))
    with pytest.raises(LauncherError, match=f"mixed_precision: {precision} is not supported; use bf16"):
        validate_launcher(load_recipe(None), path)


def test_fsdp1_is_refused(tmp_path):
    path = write_launcher(tmp_path, "fsdp_8gpu", lambda t: t["fsdp_config"].pop("fsdp_version"))
    with pytest.raises(LauncherError, match=r"fsdp_config\.fsdp_version: 1 \(the default\) is FSDP1"):
        validate_launcher(load_recipe(None), path)


def test_zero3_is_refused(tmp_path):
    path = write_launcher(tmp_path, "deepspeed_zero2_8gpu", lambda t: t["deepspeed_config"].update(zero_stage=3))
    with pytest.raises(LauncherError, match=r"deepspeed_config\.zero_stage: 3 is not supported"):
        validate_launcher(load_recipe(None), path)


def test_processes_not_divisible_by_machines_are_refused(tmp_path):
    path = write_launcher(tmp_path, "multinode_2x8", lambda t: t.update(num_processes=15))
    with pytest.raises(LauncherError, match="num_processes: 15 is not divisible by num_machines=2"):
        validate_launcher(load_recipe(None), path)


def test_unsupported_distributed_type_is_refused(tmp_path):
    path = write_launcher(tmp_path, "single_gpu", lambda t: t.update(distributed_type="MEGATRON_LM"))
    with pytest.raises(LauncherError, match="distributed_type: MEGATRON_LM is not supported"):
        validate_launcher(load_recipe(None), path)


def test_all_problems_are_listed_at_once(tmp_path):
    def edit(t):
        t.update(mixed_precision="fp16")
        t["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "Nope"

    with pytest.raises(LauncherError) as err:
        validate_launcher(load_recipe(None), write_launcher(tmp_path, "fsdp_8gpu", edit))
    assert "mixed_precision: fp16" in str(err.value) and "Nope is not a block of Eagle3DraftModel" in str(err.value)


def test_missing_launcher_file_is_an_error():
    with pytest.raises(LauncherError, match="launcher: recipes/accelerate/none.yaml not found"):
        validate_launcher(load_recipe(None), "recipes/accelerate/none.yaml")


def fake_accelerator(distributed_type: str, num_processes: int = 1, deepspeed_plugin=None, fsdp_version: int = 2):
    """The attributes of ``accelerate.Accelerator`` that :func:`check_runtime` reads."""
    state = SimpleNamespace(deepspeed_plugin=deepspeed_plugin, fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version))
    return SimpleNamespace(distributed_type=SimpleNamespace(value=distributed_type), num_processes=num_processes,
                           state=state)


@pytest.fixture
def launcher_env(monkeypatch):
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE", "ACCELERATE_GRADIENT_CLIPPING",
                 "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_runtime_refuses_fsdp_asked_but_multi_cpu_got(launcher_env):
    launcher_env.setenv("ACCELERATE_USE_FSDP", "true")
    launcher_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(LauncherError, match="ACCELERATE_USE_FSDP=true: the launcher asked for FSDP but accelerate "
                                            "chose MULTI_CPU with 2 process"):
        check_runtime(fake_accelerator("MULTI_CPU", 2), load_recipe(None))


def test_runtime_refuses_deepspeed_asked_but_no_got(launcher_env):
    launcher_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(LauncherError, match="asked for DEEPSPEED but accelerate chose NO"):
        check_runtime(fake_accelerator("NO"), load_recipe(None))


def test_runtime_refuses_ranks_that_do_not_see_each_other(launcher_env):
    launcher_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(LauncherError, match="WORLD_SIZE=2: the launcher started 2 processes but accelerate sees 1"):
        check_runtime(fake_accelerator("NO", 1), load_recipe(None))


def test_runtime_refuses_fsdp1(launcher_env):
    launcher_env.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(LauncherError, match="FSDP_VERSION=1: FSDP1 is not supported"):
        check_runtime(fake_accelerator("FSDP", 1, fsdp_version=1), load_recipe(None))


def test_runtime_accepts_what_was_asked(launcher_env):
    check_runtime(fake_accelerator("NO"), load_recipe(None))
    launcher_env.setenv("WORLD_SIZE", "2")
    check_runtime(fake_accelerator("MULTI_CPU", 2), load_recipe(None))
    launcher_env.setenv("ACCELERATE_USE_FSDP", "true")
    check_runtime(fake_accelerator("FSDP", 2), load_recipe(None))


def test_runtime_fills_auto_deepspeed_values_from_the_recipe(launcher_env):
    from accelerate.utils import DeepSpeedPlugin

    launcher_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    plugin = DeepSpeedPlugin(zero_stage=2)  # what deepspeed_zero2_8gpu.yaml gives: every value "auto"
    check_runtime(fake_accelerator("DEEPSPEED", 1, plugin),
                  load_recipe(None, ["train.max_grad_norm=0.3", "train.grad_accum_steps=4", "train.batch_size=2"]))
    ds = plugin.deepspeed_config
    assert ds["gradient_clipping"] == 0.3
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert plugin.gradient_clipping == 0.3


def test_runtime_refuses_contradicting_deepspeed_clipping(launcher_env):
    from accelerate.utils import DeepSpeedPlugin

    launcher_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    # what `accelerate launch` exports for a launcher with deepspeed_config.gradient_clipping: 1.0
    launcher_env.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    plugin = DeepSpeedPlugin(zero_stage=2)
    with pytest.raises(LauncherError, match=r"gradient_clipping=1\.0 \(ACCELERATE_GRADIENT_CLIPPING\) contradicts "
                                            r"the recipe's train\.max_grad_norm=0\.5"):
        check_runtime(fake_accelerator("DEEPSPEED", 1, plugin), load_recipe(None, ["train.max_grad_norm=0.5"]))


def test_runtime_refuses_zero3(launcher_env):
    from accelerate.utils import DeepSpeedPlugin

    launcher_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(LauncherError, match="ZeRO-3 is not supported"):
        check_runtime(fake_accelerator("DEEPSPEED", 1, DeepSpeedPlugin(zero_stage=3)), load_recipe(None))
