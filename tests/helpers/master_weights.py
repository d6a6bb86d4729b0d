"""One process (world size 1) of the training set-up the GPU recipes configure, on the CPU, and a
report of the dtypes it trains with (tests/integration/test_master_weights.py runs one per case).

``python -m helpers.master_weights CASE RUN_DIR RECIPE_YAML OUT_JSON [--optimizer muon] [--cast-draft-bf16]``

- The launcher's environment is the one ``accelerate launch --config_file`` exports for the
  shipped launcher YAML of the case (accelerate's own launch code builds it), with
  ``DS_ACCELERATOR=cpu`` and one process (``WORLD_SIZE=1``; accelerate and DeepSpeed start the
  process group as they do for any CPU run).
- draftsmith keeps a CPU run in fp32 whatever the launcher asks (``cpu_mixed_precision``,
  bf16 being slower there); that one rule is switched off here, so the launcher's bf16 runs as
  it does on a GPU. Everything else is the real :class:`~draftsmith.train.trainer.Trainer`:
  ``setup()`` (build_accelerator, the method's draft, build_optimizers, ``accelerator.prepare``)
  and one ``train_step`` with an optimizer step.
- ``--cast-draft-bf16``: the method's draft is cast to bf16 before the optimizer is built (the
  bug the test must catch).

The report: the dtypes the draft's linear layers computed in, the master parameters' and the
optimizer moments' dtypes, and how many master elements took an update smaller than half their
bf16 spacing (lost in bf16 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = {"autocast": "single_gpu.yaml", "deepspeed": "deepspeed_zero2_8gpu.yaml", "fsdp2": "fsdp_8gpu.yaml"}


def launcher_env(yaml_name: str) -> dict[str, str]:
    """The environment ``accelerate launch --config_file recipes/accelerate/<yaml_name>`` gives
    its processes, for one process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(REPO / "recipes" / "accelerate" / yaml_name), "--num_processes", "1", "x.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    keep = ("ACCELERATE_", "FSDP_")
    return {k: v for k, v in env.items() if k.startswith(keep)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance from each fp32 value to the next bf16 value above it (its bf16 ulp)."""
    b = x.bfloat16()
    return (torch.nextafter(b, torch.full_like(b, float("inf"))).float() - b.float()).abs()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def masters_and_moments(trainer) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The tensors the optimizers update (the masters) and their state, whatever wraps them:
    DeepSpeed ZeRO's fp32 partitions, or the prepared optimizers' own parameters."""
    engine = trainer.engine
    if engine is not None:
        zero = engine.optimizer
        masters = list(getattr(zero, "single_partition_of_fp32_groups", None)
                       or getattr(zero, "fp32_groups_flat_partition", None) or [])
        inner = zero.optimizer
        return masters, [inner.state.get(p, {}) for p in masters]
    masters, states = [], []
    for opt in trainer.optimizers:
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            for p in group["params"]:
                masters.append(p)
                states.append(inner.state.get(p, {}))
    return masters, states


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(LAUNCHERS))
    p.add_argument("run_dir", type=Path)
    p.add_argument("recipe", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--optimizer", default=None)
    p.add_argument("--cast-draft-bf16", action="store_true")
    args = p.parse_args(argv)

    os.environ.pop("ACCELERATE_USE_CPU", None)
    os.environ.update(launcher_env(LAUNCHERS[args.case]))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    import draftsmith.train.distributed as distributed
    from draftsmith.methods import get_method
    from draftsmith.recipe import load_recipe
    from draftsmith.train.trainer import Trainer

    distributed.cpu_mixed_precision = lambda: None  # the GPU rule: the launcher's mixed precision
    overrides = ["train.warmup_ratio=0.0", "train.max_steps=1", "train.batch_size=2", "train.grad_accum_steps=1"]
    if args.optimizer:
        overrides.append(f"train.optimizer={args.optimizer}")
    recipe = load_recipe(args.recipe, overrides)
    method = get_method(recipe.draft.method).training_method(recipe, args.run_dir)
    if args.cast_draft_bf16:
        build = method.build_model
        method.build_model = lambda: build().to(torch.bfloat16)
    trainer = Trainer(recipe, method, args.run_dir, progress=False)
    trainer.setup()

    compute: set[str] = set()
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, o: compute.add(str(o.dtype).removeprefix("torch.")))
    masters, _ = masters_and_moments(trainer)
    before = [local(m).detach().float().clone() for m in masters]
    batch = next(iter(trainer.loader))
    stepped = trainer.train_step(batch)
    masters, states = masters_and_moments(trainer)
    moments: dict[str, set[str]] = {}
    for state in states:
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in state:
                moments.setdefault(key, set()).add(str(local(state[key]).dtype).removeprefix("torch."))
    changed = small = 0
    for m, b in zip(masters, before):
        delta = (local(m).detach().float() - b).abs()
        changed += int((delta > 0).sum())
        small += int(((delta > 0) & (delta < bf16_spacing(b) / 2)).sum())
    module_dtypes = {str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters()}
    report = {
        "case": args.case, "distributed_type": trainer.accelerator.distributed_type.value,
        "mixed_precision": trainer.accelerator.mixed_precision, "stepped": bool(stepped),
        "optimizers": [type(getattr(o, "optimizer", o)).__name__ for o in trainer.optimizers],
        "compute_dtypes": sorted(compute), "module_param_dtypes": sorted(module_dtypes),
        "master_dtypes": sorted({str(local(m).dtype).removeprefix("torch.") for m in masters}),
        "master_count": len(masters), "moment_dtypes": {k: sorted(v) for k, v in moments.items()},
        "masters_changed": changed, "updates_below_half_bf16_spacing": small,
        "fsdp_mixed_precision_policy": str(getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None),
                                                   "mixed_precision_policy", None)),
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
