"""Data-parallel training on CPU: a tiny run prepared twice, trained by torchrun processes (gloo)
and compared with one process on the equivalent global batch (losses, weights)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from draftsmith.data_prep.prepare import prepare
from draftsmith.recipe import dump_recipe

from helpers import REPO
from helpers.recipes import PROMPTS, tiny_recipe
from helpers.tiny import write_jsonl

# Tolerance: the two runs see the same global batches and the loss is normalised by the
# global token count, so they differ only by float reduction order (gloo all-reduce).
RTOL = 1e-4


def launch(recipe_path: Path, run: Path, processes: int, batch_size: int,
           extra_env: dict[str, str] | None = None, port_base: int = 29500, extra_args: list[str] = (),
           module: bool = False) -> None:
    """Train ``recipe_path`` into ``run`` with ``processes`` torchrun CPU processes (gloo), through
    ``train/eagle3.py`` (an EAGLE-3 recipe) or with ``module`` the launch module of every method
    (``torchrun -m draftsmith.train``)."""
    entry = ["-m", "draftsmith.train"] if module else [str(REPO / "train" / "eagle3.py")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
           "--master_port", str(port_base + processes),
           *entry, str(recipe_path), "--run-dir", str(run),
           "--set", f"train.batch_size={batch_size}", *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", **(extra_env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def prepare_twin_runs(tiny_target: Path, tmp_path: Path, make_recipe=None) -> Path:
    """Prepare one tiny run under ``tmp_path/one``, copy its data to ``tmp_path/two``; returns the
    recipe file both are trained from (4 steps, fp32 shards). ``make_recipe(tiny_target, prompts,
    **train)`` builds another method's recipe (default EAGLE-3)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = (make_recipe or tiny_recipe)(tiny_target, prompts, max_steps=4)
    recipe.data.hidden_states_dtype = "float32"
    prepare(recipe, tmp_path / "one")
    shutil.copytree(tmp_path / "one" / "data", tmp_path / "two" / "data")
    recipe_path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    return recipe_path


def assert_same_losses(one: Path, two: Path, rtol: float) -> None:
    """Both runs logged 4 steps whose losses agree within ``rtol``."""
    def losses(run):
        return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) <= rtol * abs(x), (a, b)


def recipe_lr(recipe_path: Path) -> float:
    from draftsmith.recipe import load_recipe

    return load_recipe(recipe_path).train.lr


def assert_same_weights(w1: dict, w2: dict, lr: float) -> None:
    """The two runs' final weights agree.

    AdamW divides each gradient by the root of its running second moment, so a weight whose
    gradient is close to zero moves by an amount that is sensitive to the last bits of that
    gradient: reduction order alone (gloo all-reduce vs one process) can change its step by a
    visible fraction of ``lr``. So: almost every element (99.9%) agrees to rtol 1e-3 / atol 1e-5,
    and every element agrees to 5% of one step's size (``0.05 * lr``). A wrong gradient scale or a
    missed all-reduce moves most elements by the order of ``lr`` and fails both.
    """
    for k in w1:
        assert w2[k].shape == w1[k].shape, k
        if not w1[k].is_floating_point():  # the vocab maps (d2t, t2d) are not trained
            assert torch.equal(w2[k], w1[k]), k
            continue
        diff = (w2[k] - w1[k]).abs()
        close = diff <= 1e-5 + 1e-3 * w1[k].abs()
        assert close.float().mean().item() >= 0.999, (k, int((~close).sum()), w1[k].numel())
        assert diff.max().item() <= 0.05 * lr, (k, diff.max().item(), lr)
