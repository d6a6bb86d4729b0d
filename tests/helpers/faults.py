"""Fault injectors and run helpers shared by the resume tests and ``scripts/fault_report.py``.

``FaultyEagle3`` injects NaN losses and a crash in the middle of a checkpoint save;
``PREP_KILLER`` is a script that SIGKILLs data preparation at a chosen point. The rest read a
run directory (``metrics.jsonl``, the last checkpoint) and compare runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.recipe import Recipe, dump_recipe
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.models.eagle3.training import Eagle3Method

from helpers import REPO

# 8 tiny sequences, batch 2, accumulation 2 -> 2 optimizer steps per epoch: resumes land at
# epoch starts and mid-epoch; checkpoints every 3 steps, metrics every 2 (a checkpoint falls
# between two logged steps and carries the metrics window not yet logged).
FAULT_TRAIN = {"max_steps": 24, "batch_size": 2, "grad_accum_steps": 2, "checkpoint_every": 3,
               "log_every": 2, "keep_checkpoints": 2, "warmup_ratio": 0.1}

# Run as a script: draftsmith prepare's main in a child that SIGKILLs itself at a chosen point, so a
# test or this report never races the target: ``shard N`` dies after the N-th hidden-state
# shard's temp file is written and before its atomic rename; ``regenerate N`` dies when the
# N-th regeneration batch starts (the earlier batches are flushed to the cache).
PREP_KILLER = '''
import os, signal, sys
from draftsmith.cli.prepare import main
from draftsmith.data_prep import chat_engines, shards as hs

where, n = sys.argv[1], int(sys.argv[2])
calls = [0]

def hit():
    calls[0] += 1
    if calls[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)

if where == "shard":
    rename = os.replace
    def maybe_die_then_rename(src, dst, *a, **k):
        if os.path.basename(dst).startswith("shard-"):  # the shard is written and fsynced, not yet published
            hit()
        rename(src, dst, *a, **k)
    hs.os.replace = maybe_die_then_rename
else:
    gen = chat_engines.TransformersChatEngine.generate
    def maybe_die_then_generate(self, *a, **k):
        hit()
        return gen(self, *a, **k)
    chat_engines.TransformersChatEngine.generate = maybe_die_then_generate
sys.exit(main(sys.argv[3:]))
'''


class FaultyEagle3(Eagle3Method):
    """EAGLE-3 with injected faults: a NaN loss on the listed micro-batch calls (0-based), and/or
    an exception in the ``crash_on_save``-th checkpoint save, after accelerate wrote the weights
    into ``.tmp-step-N`` and before the rename that publishes it."""

    def __init__(self, recipe: Recipe, run_dir: Path, nan_calls: tuple[int, ...] = (), crash_on_save: int = 0):
        super().__init__(recipe, run_dir)
        self.nan_calls, self.crash_on_save = set(nan_calls), crash_on_save
        self.calls = self.saves = 0

    def compute_loss(self, model, batch):
        loss, metrics = super().compute_loss(model, batch)
        if self.calls in self.nan_calls:
            loss = loss * float("nan")
        self.calls += 1
        return loss, metrics

    def checkpoint_extras(self, directory: Path) -> None:
        self.saves += 1
        if self.saves == self.crash_on_save:
            raise OSError(f"injected crash while writing {directory}")
        super().checkpoint_extras(directory)


def train_cmd(recipe: Recipe, run: Path, *extra: str) -> list[str]:
    """``python train/eagle3.py`` on ``recipe`` (written into ``run``)."""
    path = run / "recipe.in.yaml"
    run.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, path)
    return [sys.executable, str(REPO / "train" / "eagle3.py"), str(path), "--run-dir", str(run), *extra]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.is_file() else []


def final_params(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(find_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))


def checkpoint_step(run: Path) -> int:
    return json.loads((find_checkpoints(run / "checkpoints")[-1] / "train_state.json").read_text())["step"]


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over the floating-point tensors of two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def curve_diff(got: list[dict], want: list[dict]) -> float:
    """max |diff| over every logged metric except wall-clock throughput; inf when the logged
    steps differ (a duplicate or a gap)."""
    if [m["step"] for m in got] != [m["step"] for m in want]:
        return float("inf")
    return max((abs(g[k] - w[k]) for g, w in zip(got, want) for k in w if k != "tokens_per_s"), default=0.0)


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> int:
    """Poll ``metrics.jsonl`` until it shows ``step`` or later; returns the last step seen.

    Raises:
        RuntimeError: the process exited first. TimeoutError: ``step`` not reached in time.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"training exited (code {proc.returncode}) before step {step}")
        lines = read_metrics(run)
        if lines and lines[-1]["step"] >= step:
            return lines[-1]["step"]
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached in {timeout}s")
