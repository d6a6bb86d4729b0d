"""Data-parallel training: 2 CPU processes (gloo) match one process with the equivalent
global batch. On CPU the processes are started by torchrun (accelerate's own launcher needs
MPI for multi-CPU); ``ACCELERATE_USE_CPU=1`` makes the Accelerator join them over gloo."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from draftsmith.train.checkpoint import find_checkpoints

from helpers.data_parallel import RTOL, assert_same_losses, assert_same_weights, launch, prepare_twin_runs, recipe_lr

pytestmark = pytest.mark.integration  # torchrun / accelerate launch of two training processes


def test_two_processes_match_one_process_with_the_global_batch(tiny_target, tmp_path):
    recipe_path = prepare_twin_runs(tiny_target, tmp_path)
    launch(recipe_path, tmp_path / "one", processes=1, batch_size=4)
    launch(recipe_path, tmp_path / "two", processes=2, batch_size=2)
    assert_same_losses(tmp_path / "one", tmp_path / "two", RTOL)
    w1 = load_file(str(find_checkpoints(tmp_path / "one" / "checkpoints")[-1] / "model.safetensors"))
    w2 = load_file(str(find_checkpoints(tmp_path / "two" / "checkpoints")[-1] / "model.safetensors"))
    assert_same_weights(w1, w2, lr=recipe_lr(recipe_path))
