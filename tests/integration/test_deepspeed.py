"""DeepSpeed ZeRO-2 on CPU: 2 processes under ``accelerate launch`` (gloo, ``DS_ACCELERATOR=cpu``)
train like one process with the global batch, checkpoint a consolidated ``model.safetensors``
beside DeepSpeed's own partitions, resume exactly, and export.

The launcher config is the user's: ``distributed_type: DEEPSPEED`` with a DeepSpeed JSON that
leaves micro-batch, accumulation and clipping to the recipe (``"auto"``), as the shipped
``recipes/accelerate/deepspeed_zero2_8gpu.yaml`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.data_parallel import RTOL, assert_same_losses, assert_same_weights, launch, prepare_twin_runs, recipe_lr
from helpers.sharded_runs import (
    SCHEDULE,
    assert_exact,
    assert_export_matches_checkpoint,
    checkpoint_weights,
    deepspeed_launcher,
    interrupted_copy,
)

pytestmark = pytest.mark.integration  # accelerate launch of DeepSpeed training

REPO = Path(__file__).resolve().parents[2]


def accelerate_launch(config: Path, recipe_path: Path, run: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           str(REPO / "train" / "eagle3.py"), str(recipe_path), "--run-dir", str(run), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.pop("ACCELERATE_USE_CPU", None)  # accelerate skips DeepSpeed when told to use the CPU
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def test_zero2_two_processes_train_checkpoint_resume_and_export_like_one_process(tiny_target, tmp_path):
    recipe_path = prepare_twin_runs(tiny_target, tmp_path)
    launch(recipe_path, tmp_path / "one", processes=1, batch_size=4, port_base=29700)
    config = deepspeed_launcher(tmp_path, processes=2)
    accelerate_launch(config, recipe_path, tmp_path / "two", "--set", "train.batch_size=2", *SCHEDULE)

    two = tmp_path / "two"
    ckpt = two / "checkpoints" / "step-4"
    assert (ckpt / "pytorch_model").is_dir(), "DeepSpeed's own resume state"
    # every rank's RNG state is inside the finished checkpoint (the rename waits for all ranks)
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert json.loads((ckpt / "train_state.json").read_text())["distributed_type"] == "DEEPSPEED"
    assert json.loads((ckpt / "train_state.json").read_text())["num_processes"] == 2
    # one process with batch 4 == two ZeRO-2 processes with batch 2 (data sharded, gradients averaged)
    assert_same_losses(tmp_path / "one", two, RTOL)
    assert_same_weights(checkpoint_weights(tmp_path / "one"), checkpoint_weights(two), lr=recipe_lr(recipe_path))

    resumed = interrupted_copy(two, tmp_path / "resumed", step=2)
    accelerate_launch(config, recipe_path, resumed, "--set", "train.batch_size=2", *SCHEDULE, "--resume")
    assert_exact(checkpoint_weights(resumed), checkpoint_weights(two))
    assert_same_losses(resumed, two, rtol=1e-6)

    assert_export_matches_checkpoint(two, tmp_path / "export")


def test_a_deepspeed_checkpoint_is_refused_by_another_launcher(tiny_target, tmp_path):
    recipe_path = prepare_twin_runs(tiny_target, tmp_path)
    config = deepspeed_launcher(tmp_path, processes=2)
    accelerate_launch(config, recipe_path, tmp_path / "one", "--set", "train.batch_size=2", "--set", "train.max_steps=2")
    plain = subprocess.run([sys.executable, str(REPO / "train" / "eagle3.py"), str(recipe_path), "--run-dir",
                            str(tmp_path / "one"), "--resume", "--set", "train.max_steps=4"],
                           capture_output=True, text=True, env=dict(os.environ, ACCELERATE_USE_CPU="1"), timeout=600)
    assert plain.returncode != 0
    assert "train_state.json: distributed_type=DEEPSPEED" in plain.stderr and "this run uses NO" in plain.stderr


@pytest.mark.parametrize("key, value, recipe_key", [("gradient_clipping", 1.0, "train.max_grad_norm"),
                                                    ("train_micro_batch_size_per_gpu", 3, "train.batch_size")])
def test_a_deepspeed_config_that_contradicts_the_recipe_is_refused(tiny_target, tmp_path, key, value, recipe_key):
    recipe_path = prepare_twin_runs(tiny_target, tmp_path)
    config = deepspeed_launcher(tmp_path, processes=1, **{key: value})
    proc = accelerate_launch(config, recipe_path, tmp_path / "one", "--set", "train.batch_size=2", check=False)
    assert proc.returncode != 0
    assert f"{key}={value}" in proc.stderr and recipe_key in proc.stderr and "ds_zero2.json" in proc.stderr
