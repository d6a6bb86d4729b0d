"""Every launcher killed (issue 30): one of 2 CPU processes under DeepSpeed ZeRO-2 (``accelerate
launch``) and under FSDP2 (``torchrun``) is killed with SIGKILL mid-epoch and during a checkpoint
write; the job ends without hanging, and ``--resume`` continues from the last complete checkpoint
to the same parameters as an uninterrupted run. A rank that hangs instead (SIGSTOP) ends the job
after ``train.collective_timeout_s``.

How a job ends when a rank dies (measured here): the survivor's next collective fails at once
(gloo: "Connection reset by peer"), and torchrun's elastic agent, which both launchers run,
sends SIGTERM to the workers left and exits non-zero. A rank that hangs keeps its sockets open:
the survivor then waits the process-group timeout, fails, and the agent kills the hung rank
(SIGTERM, then SIGKILL after its 30 s grace). The kill points and the schedule are in
``tests/launcher_kills.py`` (shared with ``scripts/fault_report.py``).

Tolerance: the resumed and the uninterrupted run are the same processes on CPU fp32, so their
final ``model.safetensors`` and ``metrics.jsonl`` are compared exactly (max |diff| == 0).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from helpers.faults import curve_diff, max_param_diff, read_metrics
from helpers.launcher_kills import (
    AGENT_GRACE_S,
    COLLECTIVE_TIMEOUT_S,
    KILL_POINTS,
    LAUNCHERS,
    kill_one_rank,
    reference,
    resume,
    resumed_from,
)
from helpers.recipes import PROMPTS, tiny_recipe
from helpers.sharded_runs import checkpoint_weights
from helpers.tiny import write_jsonl

from draftsmith.train.checkpoint import find_checkpoints

# seconds from the kill to the job's exit: a dead rank is noticed by the survivor's next collective
# and by the agent (0.1 s polls), far within the collective timeout; slack for a loaded 2-core machine
KILL_EXIT_BOUND_S = COLLECTIVE_TIMEOUT_S
# a hung rank: the survivor waits the timeout, then the agent's SIGTERM -> SIGKILL grace for the hung one
HANG_EXIT_BOUND_S = COLLECTIVE_TIMEOUT_S + AGENT_GRACE_S + 20


@pytest.fixture(scope="module")
def kills(tiny_target, tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(work dir, recipe file, prepared data)`` shared by every launch of this module."""
    from draftsmith.data_prep.prepare import prepare
    from draftsmith.recipe import dump_recipe

    work = tmp_path_factory.mktemp("launcher_kills")
    prompts = write_jsonl(work / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts)
    recipe.data.hidden_states_dtype = "float32"
    prepare(recipe, work / "prepared")
    dump_recipe(recipe, work / "recipe.yaml")
    return work, work / "recipe.yaml", work / "prepared" / "data"


@pytest.fixture(scope="module")
def references(kills):
    """The uninterrupted run of each launcher, trained once for the module on first use."""
    runs: dict[str, Path] = {}

    def get(launcher: str) -> Path:
        if launcher not in runs:
            runs[launcher] = reference(launcher, kills[1], kills[2], kills[0])
        return runs[launcher]

    return get


@pytest.mark.integration
@pytest.mark.parametrize("point", list(KILL_POINTS))
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigkill_of_one_rank_ends_the_job_and_resume_equals_an_uninterrupted_run(kills, references, launcher, point):
    work, recipe_path, data = kills
    ref = references(launcher)
    killed = kill_one_rank(launcher, point, recipe_path, data, work)

    # the job ends, non-zero, well within the collective timeout
    assert killed.job.returncode != 0, killed.job.log[-3000:]
    assert killed.seconds_to_exit <= KILL_EXIT_BOUND_S, (killed.seconds_to_exit, killed.job.log[-3000:])
    # what the kill left: step-3 complete; killed in step 6 (mid-epoch 2) or while writing step-6
    assert killed.complete == ["step-3"]
    if point == "mid-epoch":
        assert killed.last_logged_step == 5 and killed.partial == []
    else:
        assert killed.last_logged_step == 6 and killed.partial == [".tmp-step-6"]
        partial = killed.run / "checkpoints" / ".tmp-step-6"
        assert not (partial / "train_state.json").exists(), "the half-written checkpoint must not look complete"
    # the previous checkpoint is untouched: the same weights as the uninterrupted run's step-3
    assert max_param_diff(checkpoint_weights(killed.run, 3), checkpoint_weights(ref, 3)) == 0

    resumed = resume(killed, recipe_path, work)
    assert resumed.returncode == 0, resumed.log[-4000:]
    assert resumed_from(resumed) == "step-3"
    ckpt_dir = killed.run / "checkpoints"
    assert not list(ckpt_dir.glob(".tmp-*")), "the partial save is removed on resume"
    assert [p.name for p in find_checkpoints(ckpt_dir)] == ["step-3", "step-6", "step-8"]
    assert max_param_diff(checkpoint_weights(killed.run), checkpoint_weights(ref)) == 0
    assert curve_diff(read_metrics(killed.run), read_metrics(ref)) == 0


@pytest.mark.integration
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_that_hangs_ends_the_job_after_the_collective_timeout(kills, launcher):
    """SIGSTOP: the rank stays alive and holds its sockets, so nothing fails until the survivor's
    collective times out (without ``train.collective_timeout_s``: 30 min on gloo). Under DeepSpeed
    this needs the timeout on DeepSpeed's own group too (``set_default_collective_timeout``)."""
    work, recipe_path, data = kills
    hung = kill_one_rank(launcher, "mid-epoch", recipe_path, data, work, sig="SIGSTOP")
    assert hung.job.returncode != 0
    assert COLLECTIVE_TIMEOUT_S - 1 <= hung.seconds_to_exit <= HANG_EXIT_BOUND_S, (hung.seconds_to_exit,
                                                                                 hung.job.log[-3000:])
    assert "Timed out" in hung.job.log, hung.job.log[-3000:]  # the survivor's gloo collective
    assert hung.complete == ["step-3"]


def test_collective_timeout_reaches_the_process_group_and_later_groups(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    from draftsmith.recipe import load_recipe
    from draftsmith.train.distributed import process_group_kwargs, set_default_collective_timeout

    assert load_recipe(None, ["train.collective_timeout_s=45"]).train.collective_timeout_s == 45
    assert load_recipe(None, []).train.collective_timeout_s is None
    assert process_group_kwargs(None, gloo=False) is None
    assert process_group_kwargs(None, gloo=True).to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=1800)}
    assert process_group_kwargs(45, gloo=True).to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=45)}
    assert process_group_kwargs(45, gloo=False).to_kwargs() == {"timeout": timedelta(seconds=45)}  # GPU: NCCL
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", getattr(c10d, "default_pg_nccl_timeout", None))
    set_default_collective_timeout(None)
    assert c10d._get_default_timeout("gloo") == timedelta(minutes=30)
    set_default_collective_timeout(45)
    assert c10d._get_default_timeout("gloo") == timedelta(seconds=45)  # DeepSpeed's new_group() inherits it
