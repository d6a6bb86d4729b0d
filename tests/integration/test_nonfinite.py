"""A step whose loss or gradient is not finite never reaches the weights, under every launcher.

The trainer's guard (``train/components/nonfinite.py``: ``NonFiniteGuard``) is a pre-step hook of the fused
AdamW: a flag made of the accumulation window's losses (noted before each backward), the gradient
norm and, under DeepSpeed, the gradients the optimizer is about to apply, all-reduced (max) over
ranks, becomes the optimizer's ``found_inf``; the step then leaves parameters and optimizer state
untouched on every rank, without a host sync. Under DeepSpeed the step runs inside
``accelerator.backward`` (accelerate's ``DeepSpeedEngineWrapper`` calls ``engine.step()`` at the
accumulation boundary), so a check after backward comes too late. The trainer of commit 617318e
fails the one-process, DDP and both DeepSpeed runs below: it checked the boundary micro-batch's
loss only, on each rank alone (DDP ranks then diverge), and under DeepSpeed after the step was
applied, while logging "update skipped".

The injected fault is ``loss + nan`` on ONE rank's micro-batch, the first of the accumulation
window (not the boundary): the loss is NaN while the gradients stay finite, so nothing but the
loss flag can catch it, every other rank sees a finite loss, and a check of the boundary
micro-batch's loss alone misses it. Each run checkpoints every step; the step-1 and step-2
checkpoints (the NaN is in step 2) must hold identical weights (and optimizer state where it is
a plain file), step 3 must train again, and ``nonfinite_skipped`` must count the step.

DeepSpeed's own overflow check covers fp32 (and fp16) but not bf16 without
``check_grad_overflow``; bf16 does not run on CPU, so the gradient part of the guard is
checked directly (``test_guard_skips_nonfinite_gradients_on_the_device``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.recipe import dump_recipe
from draftsmith.train.checkpoint import find_checkpoints

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

REPO = Path(__file__).resolve().parents[2]

# micro-batch call (per process, 0-based) whose loss is NaN: batch 2 x accumulation 2 -> calls 2
# and 3 make optimizer step 2; call 2 is the first of the window
NAN_CALL, NAN_STEP = 2, 2
TRAIN = ["--set", "train.max_steps=3", "--set", "train.grad_accum_steps=2", "--set", "train.checkpoint_every=1",
         "--set", "train.keep_checkpoints=5", "--set", "train.log_every=1", "--set", "train.batch_size=2"]

# the entry script of the launched runs: EAGLE-3 whose loss is NaN on one rank's micro-batch
NAN_SCRIPT = '''
import os, sys

from draftsmith.cli.train import launch
from draftsmith.models.eagle3.training import Eagle3Method


class NaNLoss(Eagle3Method):
    calls = 0

    def compute_loss(self, model, batch):
        loss, metrics = super().compute_loss(model, batch)
        if self.calls == int(os.environ["NAN_CALL"]) and self.accelerator.process_index == int(os.environ["NAN_RANK"]):
            loss = loss + float("nan")  # NaN loss, finite gradients
        self.calls += 1
        return loss, metrics


sys.exit(launch(method=NaNLoss, script="nan_eagle3.py", doc="EAGLE-3 with an injected NaN loss", argv=sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def prepared_data(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """``(recipe file, prepared run dir)``: the tiny EAGLE-3 run's data, prepared once."""
    root = tmp_path_factory.mktemp("nonfinite")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=3)
    recipe.data.hidden_states_dtype = "float32"
    prepare(recipe, root / "prepared")
    path = root / "recipe.yaml"
    dump_recipe(recipe, path)
    return path, root / "prepared"


def new_run(prepared_data, run: Path) -> Path:
    shutil.copytree(prepared_data[1] / "data", run / "data")
    return run


def launch_nan_run(prepared_data, run: Path, launcher: list[str], env: dict[str, str | None], nan_rank: int,
                   nan_call: int = NAN_CALL) -> None:
    """``launcher`` runs :data:`NAN_SCRIPT` on the tiny run with ``env`` (a value None unsets)."""
    script = run.parent / "nan_eagle3.py"
    script.write_text(NAN_SCRIPT)
    cmd = [sys.executable, *launcher, str(script), str(prepared_data[0]), "--run-dir", str(run), *TRAIN]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NAN_CALL": str(nan_call), "NAN_RANK": str(nan_rank), **env}
    env = {k: v for k, v in env.items() if v is not None}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


def checkpoint(run: Path, step: int) -> Path:
    return next(c for c in find_checkpoints(run / "checkpoints") if c.name == f"step-{step}")


def assert_step_skipped(run: Path) -> None:
    """Weights equal across the NaN step, changed by the next one; the skip counted."""
    before, skipped, after = (load_file(str(checkpoint(run, s) / "model.safetensors"))
                              for s in (NAN_STEP - 1, NAN_STEP, NAN_STEP + 1))
    trained = [k for k, t in before.items() if t.is_floating_point() and not torch.equal(t, after[k])]
    assert trained, "the step after the skipped one changed nothing: the test does not train"
    changed = [k for k in trained if not torch.equal(before[k], skipped[k])]
    assert not changed, f"the NaN step changed {changed}"
    state = json.loads((checkpoint(run, NAN_STEP) / "train_state.json").read_text())
    assert state["nonfinite_skipped"] == 1 and state["nonfinite_in_a_row"] == 1, state
    final = json.loads((checkpoint(run, NAN_STEP + 1) / "train_state.json").read_text())
    assert final["nonfinite_skipped"] == 1 and final["nonfinite_in_a_row"] == 0, final
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3] and logged[1]["nonfinite_skipped"] == 1


def assert_same_optimizer_state(a: Path, b: Path) -> None:
    sa, sb = (torch.load(p / "optimizer.bin", weights_only=True)["state"] for p in (a, b))
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        for name, t in sa[i].items():
            assert torch.equal(t, sb[i][name]), (i, name)


# ------------------------------------------------------------------------------------------
# The guard alone (no process group)


# ------------------------------------------------------------------------------------------
# Whole runs under each launcher


@pytest.mark.integration
def test_one_process_skips_a_nan_loss_of_a_non_boundary_micro_batch(prepared_data, tmp_path):
    from draftsmith.recipe import load_recipe
    from draftsmith.models.eagle3.training import Eagle3Method
    from draftsmith.train.trainer import fit

    class NaNLoss(Eagle3Method):
        calls = 0

        def compute_loss(self, model, batch):
            loss, metrics = super().compute_loss(model, batch)
            if self.calls == NAN_CALL:
                loss = loss + float("nan")
            self.calls += 1
            return loss, metrics

    run = new_run(prepared_data, tmp_path / "run")
    recipe = load_recipe(prepared_data[0], [a for a in TRAIN if a != "--set"])
    fit(recipe, NaNLoss(recipe, run), run, progress=False)
    assert_step_skipped(run)
    assert_same_optimizer_state(checkpoint(run, NAN_STEP - 1), checkpoint(run, NAN_STEP))


@pytest.mark.integration
def test_ddp_skips_a_nan_loss_on_one_rank_on_every_rank(prepared_data, tmp_path):
    run = new_run(prepared_data, tmp_path / "run")
    launch_nan_run(prepared_data, run, ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29811"],
                   {"ACCELERATE_USE_CPU": "1"}, nan_rank=1)
    assert json.loads((checkpoint(run, 1) / "train_state.json").read_text())["num_processes"] == 2
    assert_step_skipped(run)
    assert_same_optimizer_state(checkpoint(run, NAN_STEP - 1), checkpoint(run, NAN_STEP))


@pytest.mark.integration
def test_fsdp2_skips_a_nan_loss_on_one_rank_on_every_rank(prepared_data, tmp_path):
    from helpers.sharded_runs import FSDP_ENV

    run = new_run(prepared_data, tmp_path / "run")
    launch_nan_run(prepared_data, run, ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29821"],
                   FSDP_ENV, nan_rank=1)
    assert json.loads((checkpoint(run, 1) / "train_state.json").read_text())["distributed_type"] == "FSDP"
    assert_step_skipped(run)


@pytest.mark.integration
@pytest.mark.parametrize("nan_call", [NAN_CALL, NAN_CALL + 1], ids=["first-micro-batch", "boundary-micro-batch"])
def test_deepspeed_zero2_skips_a_nan_loss_on_one_rank_on_every_rank(prepared_data, tmp_path, nan_call):
    """The step DeepSpeed runs inside ``accelerator.backward`` is skipped: weights, the fp32
    master partitions and Adam moments of every rank unchanged. A NaN in the boundary
    micro-batch is what a check after ``accelerator.backward`` sees too late."""
    from helpers.sharded_runs import deepspeed_launcher

    run = new_run(prepared_data, tmp_path / "run")
    config = deepspeed_launcher(tmp_path, processes=2, port=29831)
    # ACCELERATE_USE_CPU unset: accelerate skips DeepSpeed when told to use the CPU
    launch_nan_run(prepared_data, run, ["-m", "accelerate.commands.launch", "--config_file", str(config)],
                   {"DS_ACCELERATOR": "cpu", "ACCELERATE_USE_CPU": None}, nan_rank=1, nan_call=nan_call)
    assert json.loads((checkpoint(run, 1) / "train_state.json").read_text())["distributed_type"] == "DEEPSPEED"
    assert_step_skipped(run)
    for rank in (0, 1):
        a, b = (torch.load(checkpoint(run, s) / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                           weights_only=False)["optimizer_state_dict"] for s in (NAN_STEP - 1, NAN_STEP))
        assert a["single_partition_of_fp32_groups"] and a["base_optimizer_state"]["state"]
        for part_a, part_b in zip(a["single_partition_of_fp32_groups"], b["single_partition_of_fp32_groups"]):
            assert torch.equal(part_a, part_b), f"rank {rank}: fp32 master weights changed by the NaN step"
        for i, moments in a["base_optimizer_state"]["state"].items():
            for name, t in moments.items():
                assert torch.equal(t, b["base_optimizer_state"]["state"][i][name]), (rank, i, name)
