"""FSDP2 on CPU: 2 processes (gloo) sharding the draft with accelerate's FSDP2 path train like one
process with the equivalent global batch (tests/integration/test_data_parallel.py), write a consolidated
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

import pytest

from helpers.data_parallel import RTOL, assert_same_losses, assert_same_weights, launch, prepare_twin_runs, recipe_lr
from helpers.sharded_runs import (
    FSDP_ENV,
    SCHEDULE,
    assert_exact,
    assert_export_matches_checkpoint,
    checkpoint_weights,
    interrupted_copy,
)


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
    from draftsmith.models.mlp_speculator.recipe import MLPSpeculatorDraftConfig
    from helpers.recipes import tiny_recipe

    recipe = tiny_recipe(tiny_target, prompts, **train)
    recipe.draft = MLPSpeculatorDraftConfig(n_predict=3, inner_dim=64, tie_weights=True)
    return recipe


@pytest.mark.integration
@pytest.mark.parametrize("method, make_recipe", [("medusa", _medusa), ("mlp_speculator", _tied_mlp_speculator)])
def test_fsdp2_trains_and_exports_the_head_methods(tiny_target, tmp_path, method, make_recipe):
    # the wrap unit comes from each model (Medusa: its head blocks; MLP speculator: the root, its
    # stages share tensors when tied), so the same launcher serves every method
    from draftsmith.eval.export import export

    recipe_path = prepare_twin_runs(tiny_target, tmp_path, make_recipe)
    launch(recipe_path, tmp_path / "one", processes=1, batch_size=4, port_base=29620, module=True)
    two = tmp_path / "two"
    launch(recipe_path, two, processes=2, batch_size=2, extra_env=FSDP_ENV, port_base=29620, module=True)
    ckpt = two / "checkpoints" / "step-4"
    assert json.loads((ckpt / "train_state.json").read_text())["distributed_type"] == "FSDP"
    assert_same_losses(tmp_path / "one", two, RTOL)
    assert_same_weights(checkpoint_weights(tmp_path / "one"), checkpoint_weights(two), lr=recipe_lr(recipe_path))
    out = export(ckpt, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
