"""What the data-parallel, DeepSpeed and FSDP launcher tests share: a sharded run is trained
(torchrun or accelerate launch of CPU processes over gloo) beside a one-process run of the same
global batch, resumed from a mid-run checkpoint, and exported from its consolidated
``model.safetensors``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export, read_checkpoint
from draftsmith.recipe import dump_recipe
from draftsmith.train.checkpoint import find_checkpoints

from helpers import REPO
from helpers.recipes import PROMPTS, tiny_recipe
from helpers.tiny import write_jsonl

# 4 optimizer steps, a checkpoint after step 2 (and the final one at 4), both kept
SCHEDULE = ["--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=2"]


def checkpoint_weights(run: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    ckpts = find_checkpoints(run / "checkpoints")
    ckpt = ckpts[-1] if step is None else next(c for c in ckpts if c.name == f"step-{step}")
    return load_file(str(ckpt / "model.safetensors"))


def interrupted_copy(run: Path, copy: Path, step: int) -> Path:
    """``copy`` = ``run`` as a run killed right after its step-``step`` checkpoint would have left
    it: later checkpoints removed (``metrics.jsonl`` keeps later lines; resume must drop them)."""
    shutil.copytree(run, copy)
    for ckpt in find_checkpoints(copy / "checkpoints"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return copy


def assert_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    """Same tensors, equal within ``tol`` (identical processes on CPU fp32 are deterministic)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert a[k].shape == b[k].shape, k
        if a[k].is_floating_point():
            assert float((a[k].double() - b[k].double()).abs().max()) <= tol, k
        else:
            assert torch.equal(a[k], b[k]), k


def assert_export_matches_checkpoint(run: Path, out: Path) -> None:
    """The run's last checkpoint exports, and the export holds exactly its trained tensors."""
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    export(ckpt, out)
    _, _, state = read_checkpoint(ckpt)
    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= exported.keys()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"]


# Tolerance: the two runs see the same global batches and the loss is normalised by the
# global token count, so they differ only by float reduction order (gloo all-reduce).
RTOL = 1e-4


def launch(recipe_path: Path, run: Path, processes: int, batch_size: int,
           extra_env: dict[str, str] | None = None, port_base: int = 29500, extra_args: list[str] = (),
           script: str = "eagle3.py") -> None:
    """Train ``recipe_path`` into ``run`` with ``processes`` torchrun CPU processes (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
           "--master_port", str(port_base + processes),
           str(REPO / "train" / script), str(recipe_path), "--run-dir", str(run),
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


FSDP_ENV = {
    "ACCELERATE_USE_CPU": "1",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "false",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
}


def deepspeed_launcher(tmp_path: Path, processes: int, port: int = 29710, **ds: object) -> Path:
    """An accelerate launcher YAML for ZeRO-2 on ``processes`` CPU processes (rendezvous on
    ``port``); ``ds`` adds keys to its DeepSpeed JSON."""
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, **ds}
    ds_json = tmp_path / "ds_zero2.json"
    ds_json.write_text(json.dumps(config))
    yaml = tmp_path / "deepspeed.yaml"
    yaml.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  deepspeed_config_file: {ds_json}\n  zero3_init_flag: false\n"
        f"num_machines: 1\nnum_processes: {processes}\nmachine_rank: 0\nmain_process_port: {port}\nuse_cpu: false\n")
    return yaml
