"""What the DeepSpeed and FSDP launcher tests share: a sharded run is trained beside a
one-process run of the same global batch, resumed from a mid-run checkpoint, and exported
from its consolidated ``model.safetensors``; the FSDP2 environment and a DeepSpeed launcher."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.eval.export import export
from draftsmith.train.checkpoint import read_draft
from draftsmith.train.checkpoint import find_checkpoints

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
    state = read_draft(ckpt).state
    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= exported.keys()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"]


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
