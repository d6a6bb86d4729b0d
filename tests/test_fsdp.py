"""FSDP on CPU: 2 processes (gloo) with accelerate's FSDP plugin should match one process with
the equivalent global batch, as plain data parallelism does (tests/test_data_parallel.py).

The processes are started by torchrun as in test_data_parallel; ``ACCELERATE_USE_FSDP`` and
the ``FSDP_*`` variables are what ``accelerate launch --config_file recipes/accelerate/fsdp_8gpu.yaml``
exports from the launcher config, here with ``ACCELERATE_USE_CPU=1``.

Found with accelerate 1.15 / torch 2.13 (CPU): accelerate never selects FSDP on CPU. Its
``AcceleratorState`` turns ``ACCELERATE_USE_FSDP`` (or an explicit ``fsdp_plugin``) into
``DistributedType.FSDP`` only for GPU-like multi-device types; with ``ACCELERATE_USE_CPU`` the
state is ``MULTI_CPU`` and ``prepare`` wraps the draft in DistributedDataParallel -- no error,
no sharding. (``accelerate launch`` with ``distributed_type: FSDP`` + ``use_cpu: true`` skips
the FSDP launcher as well.) torch's own ``fully_shard`` does run on CPU with gloo, but using it
would put a distributed branch in the trainer. The comparison therefore skips, naming the
distributed type accelerate chose, until accelerate routes FSDP on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_data_parallel import assert_same_losses, launch, prepare_twin_runs

REPO = Path(__file__).resolve().parent.parent
# Same global batches and global-token normalisation as the single process: the runs differ by
# float reduction order (sharded all-gather / reduce-scatter over gloo) only.
RTOL = 1e-4

FSDP_ENV = {
    "ACCELERATE_USE_CPU": "1",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "Eagle3DecoderLayer",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
}


PROBE = """
from accelerate import Accelerator
import accelerate
acc = Accelerator()
if acc.is_main_process:
    print("DISTRIBUTED_TYPE", acc.state.distributed_type.value, accelerate.__version__)
"""


def accelerate_distributed_type(tmp_path: Path) -> tuple[str, str]:
    """``(distributed type, accelerate version)`` accelerate picks for 2 CPU processes under FSDP_ENV."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29610", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **FSDP_ENV),
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DISTRIBUTED_TYPE"))
    _, dtype, version = line.split()
    return dtype, version


def test_fsdp_two_processes_match_one_process_with_the_global_batch(tiny_target, tmp_path):
    dtype, version = accelerate_distributed_type(tmp_path)
    if dtype != "FSDP":
        pytest.skip(f"accelerate {version} does not run FSDP on CPU: with ACCELERATE_USE_CPU=1 and "
                    f"ACCELERATE_USE_FSDP=true it chose {dtype} (DistributedDataParallel, no sharding)")
    recipe_path = prepare_twin_runs(tiny_target, tmp_path)
    launch(recipe_path, tmp_path / "one", processes=1, batch_size=4, port_base=29600)
    launch(recipe_path, tmp_path / "two", processes=2, batch_size=2, extra_env=FSDP_ENV, port_base=29600)
    assert_same_losses(tmp_path / "one", tmp_path / "two", RTOL)


def test_cpu_training_stays_fp32_whatever_the_launcher_asks(monkeypatch):
    import torch

    from draftsmith.train.trainer import cpu_mixed_precision

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `mixed_precision: bf16` exports
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert cpu_mixed_precision() == "no"
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert cpu_mixed_precision() == "no"
    # with a GPU the launcher config decides (None: accelerate reads ACCELERATE_MIXED_PRECISION)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert cpu_mixed_precision() is None


@pytest.mark.parametrize("name", ["single_gpu", "fsdp_8gpu", "deepspeed_zero2_8gpu", "multinode_2x8"])
def test_gpu_launcher_configs_ask_for_bf16(name):
    import yaml

    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / f"{name}.yaml").read_text())
    assert cfg["mixed_precision"] == "bf16" and not cfg.get("use_cpu", False)
