"""One rank of a 2-process CPU run killed under DeepSpeed ZeRO-2 (``accelerate launch``) and FSDP2
(``torchrun``), then resumed: shared by ``tests/test_launcher_kills.py`` and
``scripts/fault_report.py``.

The job is launched as ``tests/test_deepspeed.py`` and ``tests/test_fsdp.py`` launch it, with
:data:`KILLER` as the entry script in place of ``train/eagle3.py``: the same training with one
rank signalling itself at a chosen point (``SIGKILL``, or ``SIGSTOP`` for a rank that hangs):

- ``step N``: as the victim enters the backward of its N-th micro-batch (steps 1..N-1 done; the
  other rank goes on into the gradient reduction: ZeRO-2's over DeepSpeed's own process group,
  FSDP2's reduce-scatter);
- ``save N``: in the victim's N-th checkpoint save, right after accelerate's ``save_state``
  wrote its part of ``.tmp-step-K`` (rank 1: its ZeRO optimizer partition / FSDP shards and RNG
  state), before the consolidated weights, ``train_state.json`` and the rename.

It writes the wall time of the signal to a file first, so the seconds from the kill to the
launcher's exit are measured. The schedule (:data:`SCHEDULE`): 8 sequences, batch 1 per
process, 4 optimizer steps per epoch, 8 steps, a checkpoint every 3 (all kept).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.faults import curve_diff, max_param_diff, read_metrics
from helpers.sharded_runs import FSDP_ENV, checkpoint_weights, deepspeed_launcher

from draftsmith.train.checkpoint import find_checkpoints

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the checkout

LAUNCHERS = ("deepspeed", "fsdp")
COLLECTIVE_TIMEOUT_S = 60  # train.collective_timeout_s here (20 s: on a loaded machine a rank started late fails init)
AGENT_GRACE_S = 30  # torchrun's elastic agent: SIGTERM to the other workers, SIGKILL 30 s later
SCHEDULE = ["--set", "train.batch_size=1", "--set", "train.grad_accum_steps=1", "--set", "train.max_steps=8",
            "--set", "train.checkpoint_every=3", "--set", "train.keep_checkpoints=3", "--set", "train.log_every=1",
            "--set", f"train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"]
# kill point -> (where, victim rank, N): rank 0 (the main process) dies in step 6 (epoch 2 of 4-step
# epochs: mid-epoch); rank 1 dies in the step-6 save, leaving rank 0 to finish (or not) the checkpoint
KILL_POINTS = {"mid-epoch": ("step", 0, 6), "mid-checkpoint": ("save", 1, 2)}
DESCRIBED = {"mid-epoch": "mid-epoch: rank 0 entering step 6's backward (epoch 2)",
             "mid-checkpoint": "mid-checkpoint: rank 1 writing step-6 (its save_state done)"}
JOB_TIMEOUT_S = 900  # a job still running after this is a hang: its process group is killed

KILLER = '''
import os, signal, sys, time

import accelerate

from draftsmith.cli.train import launch
from draftsmith.models.eagle3.training import Eagle3Method

where, victim, n, sig, stamp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(signal, sys.argv[4]), sys.argv[5]
calls = {"step": 0, "save": 0}


def hit(kind):
    calls[kind] += 1
    if kind == where and calls[kind] == n and int(os.environ.get("RANK", "0")) == victim:
        with open(stamp, "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), sig)


backward = accelerate.Accelerator.backward
def maybe_die_then_backward(self, *a, **k):
    hit("step")
    return backward(self, *a, **k)
accelerate.Accelerator.backward = maybe_die_then_backward

save_state = accelerate.Accelerator.save_state
def save_state_then_maybe_die(self, *a, **k):
    out = save_state(self, *a, **k)
    hit("save")
    return out
accelerate.Accelerator.save_state = save_state_then_maybe_die

sys.exit(launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=sys.argv[6:]))
'''

_ports = itertools.count(29850)


@dataclass
class Job:
    """A finished launch: exit code, its log, and when it exited (``time.time()``)."""

    returncode: int
    log: str
    exited_at: float


def launch(launcher: str, script: Path, args: list[str], work: Path, name: str) -> Job:
    """Run ``script args`` on 2 CPU processes under ``launcher`` (``deepspeed``: accelerate launch
    with a ZeRO-2 config; ``fsdp``: torchrun with what ``accelerate launch`` exports for FSDP2) until
    it exits; output goes to ``work/name.log``. A job that outlives :data:`JOB_TIMEOUT_S` is killed
    (whole process group) and reported as a hang (``TimeoutError``)."""
    port = next(_ports)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "deepspeed":
        (work / f"{name}-launcher").mkdir(parents=True, exist_ok=True)
        config = deepspeed_launcher(work / f"{name}-launcher", processes=2, port=port)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("ACCELERATE_USE_CPU", None)  # accelerate skips DeepSpeed when told to use the CPU
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
        env.update(FSDP_ENV)
    log_path = work / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*cmd, str(script), *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{launcher} job {name} still running after {JOB_TIMEOUT_S} s: a hang "
                               f"(log: {log_path})") from None
    return Job(proc.returncode, log_path.read_text(), time.time())


def train_args(recipe_path: Path, run: Path, *extra: str) -> list[str]:
    return [str(recipe_path), "--run-dir", str(run), *SCHEDULE, *extra]


def fresh_run(data: Path, run: Path) -> Path:
    """A run directory holding a copy of the prepared ``data``."""
    shutil.copytree(data, run / "data")
    return run


def reference(launcher: str, recipe_path: Path, data: Path, work: Path) -> Path:
    """The uninterrupted run of :data:`SCHEDULE` under ``launcher``."""
    run = fresh_run(data, work / f"{launcher}-ref")
    job = launch(launcher, REPO / "train" / "eagle3.py", train_args(recipe_path, run), work, f"{launcher}-ref")
    assert job.returncode == 0, job.log[-4000:]
    return run


@dataclass
class Killed:
    """What one kill left: the job's exit, the steps it logged, the checkpoints on disk."""

    launcher: str
    point: str
    signal: str
    run: Path
    job: Job
    seconds_to_exit: float
    last_logged_step: int
    complete: list[str]  # checkpoint directories find_checkpoints lists
    partial: list[str]  # .tmp-* directories


def kill_one_rank(launcher: str, point: str, recipe_path: Path, data: Path, work: Path, sig: str = "SIGKILL") -> Killed:
    """Launch the run with :data:`KILLER` set to ``point`` (:data:`KILL_POINTS`) and wait for the job to end."""
    where, victim, n = KILL_POINTS[point]
    name = f"{launcher}-{point}-{sig.lower()}"
    run = fresh_run(data, work / name)
    killer, stamp = work / "killer.py", work / f"{name}.killed_at"
    killer.write_text(KILLER)
    job = launch(launcher, killer, [where, str(victim), str(n), sig, str(stamp), *train_args(recipe_path, run)],
                 work, name)
    assert stamp.is_file(), f"the {point} kill point was never reached:\n{job.log[-4000:]}"
    ckpt_dir = run / "checkpoints"
    return Killed(launcher, point, sig, run, job, job.exited_at - float(stamp.read_text()),
                  max((m["step"] for m in read_metrics(run) if "loss" in m), default=0),
                  [p.name for p in find_checkpoints(ckpt_dir)],
                  sorted(p.name for p in ckpt_dir.glob(".tmp-*")) if ckpt_dir.is_dir() else [])


def resume(killed: Killed, recipe_path: Path, work: Path) -> Job:
    """``--resume`` the killed run under its launcher with the real entry script."""
    return launch(killed.launcher, REPO / "train" / "eagle3.py", train_args(recipe_path, killed.run, "--resume"),
                  work, f"{killed.run.name}-resume")


def resumed_from(job: Job) -> str | None:
    """The checkpoint directory named by the trainer's 'resumed from' log line."""
    for line in job.log.splitlines():
        if "resumed from " in line:
            return Path(line.split("resumed from ", 1)[1].split(" at step")[0]).name
    return None


def kill_row(killed: Killed, resumed: Job, ref: Path) -> dict:
    """The fault-report row of one kill and its resume."""
    kept = killed.complete[-1] if killed.complete else None
    kept_step = int(kept.split("-")[1]) if kept else 0
    return {"launcher": killed.launcher, "kill": f"{killed.signal} {DESCRIBED[killed.point]}",
            "exit": killed.job.returncode, "seconds_to_exit": killed.seconds_to_exit,
            "left": f"{', '.join(killed.complete) or 'no checkpoint'}"
                    f"{'; partial ' + ', '.join(killed.partial) if killed.partial else ''}",
            "resumed_from": resumed_from(resumed), "steps_lost": killed.last_logged_step - kept_step,
            "param_diff": max_param_diff(checkpoint_weights(killed.run), checkpoint_weights(ref)),
            "curve_diff": curve_diff(read_metrics(killed.run), read_metrics(ref))}


def launcher_kill_rows(recipe_path: Path, data: Path, work: Path) -> list[dict]:
    """Every launcher x kill point: reference, kill, resume; one :func:`kill_row` each."""
    rows = []
    for launcher in LAUNCHERS:
        ref = reference(launcher, recipe_path, data, work)
        for point in KILL_POINTS:
            killed = kill_one_rank(launcher, point, recipe_path, data, work)
            rows.append(kill_row(killed, resume(killed, recipe_path, work), ref))
    return rows


def format_kill_table(rows: list[dict]) -> str:
    head = ("| launcher (2 CPU processes) | kill point | job exit code | seconds kill -> exit | left on disk | resumed from "
            "| steps lost | max abs param diff vs uninterrupted | max abs metrics.jsonl diff |")
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        out.append(f"| {r['launcher']} | {r['kill']} | {r['exit']} | {r['seconds_to_exit']:.1f} | {r['left']} "
                   f"| {r['resumed_from']} | {r['steps_lost']} | {r['param_diff']:.3g} | {r['curve_diff']:.3g} |")
    return "\n".join(out)

