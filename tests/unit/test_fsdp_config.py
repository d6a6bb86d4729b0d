"""Precision and sharding settings of the launchers: CPU training stays fp32, the GPU launcher
configs ask for bf16, FSDP2 with bf16 reduces gradients in fp32 and keeps the launcher's reshard."""

from __future__ import annotations
from pathlib import Path

import pytest

from helpers.sharded_runs import FSDP_ENV


REPO = Path(__file__).resolve().parents[2]


def test_cpu_training_stays_fp32_whatever_the_launcher_asks(monkeypatch):
    import torch

    from draftsmith.train.distributed import cpu_mixed_precision

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `mixed_precision: bf16` exports
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert cpu_mixed_precision() == "no"
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert cpu_mixed_precision() == "no"
    # with a GPU the launcher config decides (None: accelerate reads ACCELERATE_MIXED_PRECISION)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert cpu_mixed_precision() is None


@pytest.mark.parametrize("name", ["single_gpu", "ddp_8gpu", "fsdp_8gpu", "deepspeed_zero2_8gpu", "multinode_2x8"])
def test_gpu_launcher_configs_ask_for_bf16(name):
    import yaml

    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / f"{name}.yaml").read_text())
    assert cfg["mixed_precision"] == "bf16" and not cfg.get("use_cpu", False)


def test_fsdp2_with_bf16_reduces_gradients_in_fp32_and_keeps_the_launchers_reshard(monkeypatch):
    """accelerate 1.15 would build MixedPrecisionPolicy(reduce_dtype=bf16) from ``mixed_precision:
    bf16``; the plugin draftsmith passes keeps fp32 gradient reduction, and the other settings still
    come from the launcher's FSDP_* environment (fsdp_8gpu.yaml: no reshard after forward)."""
    import torch

    from draftsmith.train.distributed import distributed_kwargs

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # a GPU run
    for key, value in {**FSDP_ENV, "ACCELERATE_MIXED_PRECISION": "bf16"}.items():
        if key != "ACCELERATE_USE_CPU":
            monkeypatch.setenv(key, value)
    kwargs = distributed_kwargs()
    plugin = kwargs["fsdp_plugin"]
    plugin.set_mixed_precision("bf16")  # what accelerate's state does with the launcher's mixed_precision
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert plugin.reshard_after_forward is False and plugin.fsdp_version == 2
    ddp = kwargs["kwargs_handlers"][0]
    assert ddp.to_kwargs() == {"broadcast_buffers": False}
    # on CPU (fp32) or without FSDP nothing but the DDP setting is passed
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert set(distributed_kwargs()) == {"kwargs_handlers"}


def test_shipped_fsdp_launcher_does_not_reshard_after_forward():
    import yaml

    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / "fsdp_8gpu.yaml").read_text())
    assert cfg["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert FSDP_ENV["FSDP_RESHARD_AFTER_FORWARD"] == "false"  # the test runs what the launcher exports
