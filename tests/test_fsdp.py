"""FSDP2 on CPU: 2 processes (gloo) sharding the draft with accelerate's FSDP2 path train like one
process with the equivalent global batch (tests/test_data_parallel.py), write a consolidated
``model.safetensors`` beside the sharded (torch.distributed.checkpoint) state, resume exactly and
export.

The processes are started by torchrun; ``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables are
what ``accelerate launch --config_file recipes/accelerate/fsdp_8gpu.yaml`` exports from the
launcher config (no wrap class: it comes from the model's ``_no_split_modules``). accelerate
1.15 never selects FSDP on CPU by itself (it falls back to DDP); ``train/distributed.py`` routes
it to accelerate's FSDP2 path over gloo, and the test checks that the checkpoint was written
under FSDP, so a silent fallback fails it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.sharded_runs import (
    FSDP_ENV,
    RTOL,
    SCHEDULE,
    assert_exact,
    assert_export_matches_checkpoint,
    assert_same_losses,
    assert_same_weights,
    checkpoint_weights,
    interrupted_copy,
    launch,
    prepare_twin_runs,
    recipe_lr,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_fsdp2_two_processes_train_checkpoint_resume_and_export_like_one_process(tiny_target, tmp_path):
    recipe_path = prepare_twin_runs(tiny_target, tmp_path)
    launch(recipe_path, tmp_path / "one", processes=1, batch_size=4, port_base=29600)
    two = tmp_path / "two"
    launch(recipe_path, two, processes=2, batch_size=2, extra_env=FSDP_ENV, port_base=29600, extra_args=SCHEDULE)

    ckpt = two / "checkpoints" / "step-4"
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["distributed_type"] == "FSDP" and state["num_processes"] == 2
    assert (ckpt / "pytorch_model_fsdp_0").is_dir(), "the sharded resume state"
    assert_same_losses(tmp_path / "one", two, RTOL)
    assert_same_weights(checkpoint_weights(tmp_path / "one"), checkpoint_weights(two), lr=recipe_lr(recipe_path))

    resumed = interrupted_copy(two, tmp_path / "resumed", step=2)
    launch(recipe_path, resumed, processes=2, batch_size=2, extra_env=FSDP_ENV, port_base=29600,
           extra_args=[*SCHEDULE, "--resume"])
    assert_exact(checkpoint_weights(resumed), checkpoint_weights(two))
    assert_same_losses(resumed, two, rtol=1e-6)

    assert_export_matches_checkpoint(two, tmp_path / "export")


def _medusa(tiny_target, prompts, **train):
    from helpers.recipes import medusa_recipe

    return medusa_recipe(tiny_target, prompts, **train)


def _tied_mlp_speculator(tiny_target, prompts, **train):
    from draftsmith.recipe import MLPSpeculatorDraftConfig
    from helpers.recipes import tiny_recipe

    recipe = tiny_recipe(tiny_target, prompts, **train)
    recipe.draft = MLPSpeculatorDraftConfig(n_predict=3, inner_dim=64, tie_weights=True)
    return recipe


@pytest.mark.integration
@pytest.mark.parametrize("method, make_recipe", [("medusa", _medusa), ("mlp_speculator", _tied_mlp_speculator)])
def test_fsdp2_trains_and_exports_the_head_methods(tiny_target, tmp_path, method, make_recipe):
    # the wrap unit comes from each model (Medusa: its head blocks; MLP speculator: the root, its
    # stages share tensors when tied), so the same launcher serves every method
    from draftsmith.eval.export_heads import export_head_draft

    recipe_path = prepare_twin_runs(tiny_target, tmp_path, make_recipe)
    launch(recipe_path, tmp_path / "one", processes=1, batch_size=4, port_base=29620, script=f"{method}.py")
    two = tmp_path / "two"
    launch(recipe_path, two, processes=2, batch_size=2, extra_env=FSDP_ENV, port_base=29620, script=f"{method}.py")
    ckpt = two / "checkpoints" / "step-4"
    assert json.loads((ckpt / "train_state.json").read_text())["distributed_type"] == "FSDP"
    assert_same_losses(tmp_path / "one", two, RTOL)
    assert_same_weights(checkpoint_weights(tmp_path / "one"), checkpoint_weights(two), lr=recipe_lr(recipe_path))
    out = export_head_draft(ckpt, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_cpu_training_stays_fp32_whatever_the_launcher_asks(monkeypatch):
    import torch

    from draftsmith.train.distributed import cpu_mixed_precision

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `mixed_precision: bf16` exports
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert cpu_mixed_precision() == "no"
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert cpu_mixed_precision() == "no"
    # with a GPU the launcher config decides (None: accelerate reads ACCELERATE_MIXED_PRECISION)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert cpu_mixed_precision() is None


@pytest.mark.parametrize("name", ["single_gpu", "ddp_8gpu", "fsdp_8gpu", "deepspeed_zero2_8gpu", "multinode_2x8"])
def test_gpu_launcher_configs_ask_for_bf16(name):
    import yaml

    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / f"{name}.yaml").read_text())
    assert cfg["mixed_precision"] == "bf16" and not cfg.get("use_cpu", False)


def test_fsdp2_with_bf16_reduces_gradients_in_fp32_and_keeps_the_launchers_reshard(monkeypatch):
    """accelerate 1.15 would build MixedPrecisionPolicy(reduce_dtype=bf16) from ``mixed_precision:
    bf16``; the plugin draftsmith passes keeps fp32 gradient reduction, and the other settings still
    come from the launcher's FSDP_* environment (fsdp_8gpu.yaml: no reshard after forward)."""
    import torch

    from draftsmith.train.distributed import distributed_kwargs

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # a GPU run
    for key, value in {**FSDP_ENV, "ACCELERATE_MIXED_PRECISION": "bf16"}.items():
        if key != "ACCELERATE_USE_CPU":
            monkeypatch.setenv(key, value)
    kwargs = distributed_kwargs()
    plugin = kwargs["fsdp_plugin"]
    plugin.set_mixed_precision("bf16")  # what accelerate's state does with the launcher's mixed_precision
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert plugin.reshard_after_forward is False and plugin.fsdp_version == 2
    ddp = kwargs["kwargs_handlers"][0]
    assert ddp.to_kwargs() == {"broadcast_buffers": False}
    # on CPU (fp32) or without FSDP nothing but the DDP setting is passed
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert set(distributed_kwargs()) == {"kwargs_handlers"}


def test_shipped_fsdp_launcher_does_not_reshard_after_forward():
    import yaml

    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / "fsdp_8gpu.yaml").read_text())
    assert cfg["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert FSDP_ENV["FSDP_RESHARD_AFTER_FORWARD"] == "false"  # the test runs what the launcher exports
