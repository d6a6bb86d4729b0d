"""The target's own MTP layer fine-tuned end to end on a tiny DeepSeek-V3 (MLA + MoE, one shipped
MTP layer) and a tiny Qwen3-Next (hybrid linear / full attention, MoE): prepare -> train
(draft.method mtp, two unrolled steps) -> export -> reload; the warm start is the shipped layer; a
target without MTP layers is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.export import export
from draftsmith.models.mtp.config import MTPConfig
from draftsmith.models.mtp.format import load_mtp, mtp_weight_shapes
from draftsmith.models.mtp.model import MTPDraftModel
from draftsmith.models.mtp.recipe import MTPDraftConfig
from draftsmith.models.mtp.weights import load_mtp_state, read_target_mtp
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.method_base import MethodSetupError
from helpers.mtp_targets import build_tiny_deepseek_v3
from helpers.recipes import tiny_recipe, write_prompts


def mtp_recipe(target, where, **draft):
    recipe = tiny_recipe(target, write_prompts(where / "prompts.jsonl"), max_steps=20, lr=3e-3)
    recipe.draft = MTPDraftConfig(**draft)
    recipe.data.aux_layer_ids = [0, 1, 2]  # the tiny target has 3 decoder layers
    return recipe


def train_mtp(target, where):
    """``where/run``: ``target``'s MTP layer prepared and trained 20 steps, 2 TTT steps."""
    from draftsmith.data_prep.prepare import prepare
    from draftsmith.models.mtp.training import MTPMethod
    from draftsmith.train.trainer import fit

    recipe = mtp_recipe(target, where, ttt_steps=2)
    prepare(recipe, where / "run")
    fit(recipe, MTPMethod(recipe, where / "run"), where / "run", progress=False)
    return where / "run"


def assert_reloads_bit_for_bit(ckpt, export_dir):
    """The export loaded back as a draft holds the checkpoint's tensors exactly."""
    state = load_file(str(ckpt / "model.safetensors"))
    reloaded = load_mtp(export_dir).state_dict()
    for k, v in state.items():
        torch.testing.assert_close(reloaded[k], v, rtol=0, atol=0)


@pytest.fixture(scope="module")
def mtp_trained(tmp_path_factory):
    """``(target dir, run dir)``: the tiny DeepSeek-V3's MTP layer trained 20 steps, 2 TTT steps."""
    root = tmp_path_factory.mktemp("mtp_run")
    target = build_tiny_deepseek_v3(root / "target")
    return target, train_mtp(target, root)


@pytest.mark.integration
def test_training_starts_from_the_shipped_layer_and_the_loss_goes_down(mtp_trained):
    target, run = mtp_trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"loss_0", "loss_1", "acc_0", "acc_1"} <= set(metrics[0])
    assert metrics[-1]["loss"] < 0.6 * metrics[0]["loss"]
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"]
    # the trained weights are the MTP layer's, moved away from the shipped ones the warm start loaded
    cfg = MTPConfig("deepseek_v3", json.loads((target / "config.json").read_text()))
    shipped = MTPDraftModel(cfg)
    load_mtp_state(shipped, read_target_mtp(target, cfg))
    trained = load_file(str(find_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))
    assert set(trained) == {k for k in shipped.state_dict() if k.startswith("mtp.")}
    assert not torch.equal(trained["mtp.eh_proj.weight"], shipped.state_dict()["mtp.eh_proj.weight"])


@pytest.mark.integration
def test_export_is_the_target_config_and_the_shipped_names(mtp_trained, tmp_path):
    target, run = mtp_trained
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    out = export(ckpt, tmp_path / "mtp", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    shipped = json.loads((target / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("torch_dtype", "draftsmith")} == \
        {k: v for k, v in shipped.items() if k != "torch_dtype"}
    assert config["draftsmith"]["method"] == "mtp" and config["draftsmith"]["ttt_steps"] == 2
    weights = load_file(str(out / "model.safetensors"))
    cfg = MTPConfig("deepseek_v3", shipped)
    assert {k: tuple(v.shape) for k, v in weights.items()} == mtp_weight_shapes(cfg)
    assert all(k.startswith("model.layers.3.") for k in weights)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in weights  # per expert, as shipped
    assert "model.layers.3.shared_head.head.weight" not in weights  # vLLM shares the target's
    assert_reloads_bit_for_bit(ckpt, out)


@pytest.mark.integration
def test_a_target_without_mtp_layers_is_one_line(tmp_path):
    from draftsmith.data_prep.prepare import prepare
    from draftsmith.models.mtp.training import MTPMethod

    target = build_tiny_deepseek_v3(tmp_path / "target", with_mtp=False)
    recipe = mtp_recipe(target, tmp_path)
    prepare(recipe, tmp_path / "run", ["target"])
    with pytest.raises(MethodSetupError) as err:
        MTPMethod(recipe, tmp_path / "run")
    message = str(err.value)
    assert "\n" not in message
    assert "num_nextn_predict_layers" in message and "deepseek_v3" in message and "eagle3" in message


@pytest.mark.integration
def test_a_qwen3_next_mtp_layer_trains_exports_and_reloads(tmp_path):
    """Qwen3-Next end to end (Gated DeltaNet + full attention, MoE with a gated shared expert, its
    MTP layer shipped under ``mtp.*``): prepare through transformers, 20 steps from the shipped
    layer, export under the shipped names, reload bit for bit."""
    from helpers.mtp_targets import build_tiny_qwen3_next

    target = build_tiny_qwen3_next(tmp_path / "target")
    run = train_mtp(target, tmp_path)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.6 * metrics[0]["loss"]
    shipped = json.loads((target / "config.json").read_text())
    cfg = MTPConfig("qwen3_next", shipped)
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    out = export(ckpt, tmp_path / "mtp", dtype="float32")
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == mtp_weight_shapes(cfg)
    assert all(k.startswith("mtp.") for k in weights)
    before = read_target_mtp(target, cfg)
    assert any(not torch.equal(weights[k], before[k]) for k in weights if k in before)  # trained, not shipped
    assert_reloads_bit_for_bit(ckpt, out)
