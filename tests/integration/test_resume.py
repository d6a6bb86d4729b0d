"""Exact resume: a training run killed with SIGKILL at a random step and resumed with --resume
ends with the same parameters and the same metrics.jsonl as an uninterrupted run; a crash in
the middle of a checkpoint save leaves the previous checkpoint usable.

Tolerance: CPU fp32 in identical processes is deterministic, so parameters and logged
losses are compared exactly (max |diff| == 0); ``TOL`` (1e-6) is allowed only as slack for
platforms whose kernels are not bitwise reproducible.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith import __version__
from draftsmith.train.checkpoint import CheckpointError, find_checkpoints, truncate_metrics
from draftsmith.train.trainer import fit

from helpers.faults import (
    FAULT_TRAIN,
    FaultyEagle3,
    final_params,
    max_param_diff,
    read_metrics,
    train_cmd,
    wait_for_step,
)

pytestmark = pytest.mark.integration  # kills and resumes train/eagle3.py processes

TOL = 1e-6
TRAIN = FAULT_TRAIN  # batch 2 x accumulation 2 on 8 sequences, checkpoint every 3, log every 2
MAX_STEPS = TRAIN["max_steps"]


def new_run(prepared, root: Path, **train) -> tuple[object, Path]:
    recipe, run, _ = prepared
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run / "data", root / "data")
    recipe = recipe.model_copy(deep=True)
    for k, v in {**TRAIN, **train}.items():
        setattr(recipe.train, k, v)
    return recipe, root


def assert_same_curve(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want], "logged steps differ (duplicates or gaps)"
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            if k != "tokens_per_s":  # wall-clock
                assert g[k] == pytest.approx(w[k], rel=TOL, abs=TOL), (g["step"], k)


def test_sigkill_at_a_random_step_then_resume_equals_an_uninterrupted_run(prepared, tmp_path):
    kill_step = random.Random(1234).randrange(4, MAX_STEPS - 8, 2)  # logged steps are even
    recipe, ref = new_run(prepared, tmp_path / "ref")
    done = subprocess.run(train_cmd(recipe, ref), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    _, run = new_run(prepared, tmp_path / "killed")
    proc = subprocess.Popen(train_cmd(recipe, run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = wait_for_step(run, kill_step, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    ckpt_step = json.loads((find_checkpoints(run / "checkpoints")[-1] / "train_state.json").read_text())["step"]
    assert ckpt_step < MAX_STEPS and ckpt_step <= seen

    resumed = subprocess.run(train_cmd(recipe, run, "--resume"), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step-{ckpt_step}'}" in resumed.stderr

    assert_same_curve(read_metrics(run), read_metrics(ref))
    diff = max_param_diff(final_params(run), final_params(ref))
    assert diff <= TOL, f"max |param diff| {diff} after SIGKILL at step {seen} and resume from {ckpt_step}"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_crash_mid_checkpoint_keeps_the_previous_one_and_resume_is_exact(prepared, tmp_path, optimizer):
    """muon: both optimizers (AdamW and Muon, its momentum) and both schedules are restored."""
    if optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    recipe, ref = new_run(prepared, tmp_path / "ref", max_steps=12, optimizer=optimizer)
    fit(recipe, Eagle3Method(recipe, ref), ref, progress=False)

    _, run = new_run(prepared, tmp_path / "crashed", max_steps=12, optimizer=optimizer)
    with pytest.raises(OSError, match="injected crash"):
        fit(recipe, FaultyEagle3(recipe, run, crash_on_save=2), run, progress=False)  # saves at 3, 6
    ckpt_dir = run / "checkpoints"
    assert (ckpt_dir / ".tmp-step-6" / "model.safetensors").is_file()  # the half-written save
    assert [p.name for p in find_checkpoints(ckpt_dir)] == ["step-3"]

    result = fit(recipe, Eagle3Method(recipe, run), run, resume=True, progress=False)
    assert result.steps == 12
    assert not (ckpt_dir / ".tmp-step-6").exists()
    assert_same_curve(read_metrics(run), read_metrics(ref))
    assert max_param_diff(final_params(run), final_params(ref)) <= TOL
    if optimizer == "muon":
        assert (find_checkpoints(ckpt_dir)[-1] / "optimizer_1.bin").is_file()  # Muon's state, beside AdamW's


def test_resume_without_a_complete_checkpoint_is_an_error(prepared, tmp_path):
    recipe, run = new_run(prepared, tmp_path / "run")
    (run / "checkpoints" / ".tmp-step-3").mkdir(parents=True)
    (run / "checkpoints" / "step-3").mkdir()  # renamed but without train_state.json: not complete
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        fit(recipe, Eagle3Method(recipe, run), run, resume=True, progress=False)


def test_checkpoint_holds_no_pickled_custom_object(prepared, tmp_path):
    """accelerate unpickles custom objects with weights_only=False; the run position is JSON."""
    recipe, run = new_run(prepared, tmp_path / "run", max_steps=4)
    fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    ckpt = run / "checkpoints" / "step-3"  # between the logged steps 2 and 4
    assert not list(ckpt.glob("custom_checkpoint_*.pkl"))
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["step"] == 3 and not state["finished"] and state["window"]["loss"][1] == 2  # (sum, count): 2 micro-batches
    # every torch.load accelerate does on resume works with weights_only=True
    for name in ("optimizer.bin", "scheduler.bin"):
        assert torch.load(ckpt / name, weights_only=True)
    from accelerate.utils import load as accelerate_load

    rng = accelerate_load(ckpt / "random_states_0.pkl")  # weights_only=True with numpy allow-list
    assert {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(rng)


def test_metrics_after_the_checkpoint_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    assert truncate_metrics(path, 5) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert truncate_metrics(path, 5) == 0


class OpensAFileWhenUnpickled:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):  # what a malicious pickle does: call anything at load time
        return (open, (str(self.path), "w"))


def test_a_checkpoint_of_draftsmith_before_0_2_0_is_refused_in_one_line_without_unpickling(prepared, tmp_path):
    """Checkpoints of draftsmith < 0.2.0 record no version in ``train_state.json``, and the oldest
    hold ``custom_checkpoint_0.pkl``, which accelerate would load with weights_only=False: resume
    refuses them before loading anything."""
    recipe, run = new_run(prepared, tmp_path / "run", max_steps=3)
    fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state.pop("version") == __version__
    (ckpt / "train_state.json").write_text(json.dumps(state))
    marker = tmp_path / "unpickled"
    torch.save({"step": OpensAFileWhenUnpickled(marker)}, ckpt / "custom_checkpoint_0.pkl")
    recipe.train.max_steps = 5
    with pytest.raises(CheckpointError) as err:
        fit(recipe, Eagle3Method(recipe, run), run, resume=True, progress=False)
    assert str(err.value).startswith(f"{ckpt}: written by a draftsmith before 0.2.0") and "\n" not in str(err.value)
    assert not marker.exists()
