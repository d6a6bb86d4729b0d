"""The MTP export's ``config.json`` states the dtype its weights are stored in, under both keys
transformers reads (``dtype`` since transformers 5, which wins over ``torch_dtype``)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from helpers.mtp_targets import build_tiny_qwen3_next, export_changed_mtp


def test_a_bf16_export_of_a_float32_target_reads_as_bf16(tmp_path):
    from transformers import AutoConfig

    target = build_tiny_qwen3_next(tmp_path / "target")
    assert json.loads((target / "config.json").read_text())["dtype"] == "float32"  # as transformers 5 saves it
    _, out = export_changed_mtp(target, tmp_path, "bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"], config["mtp_num_hidden_layers"]) == ("bfloat16", "bfloat16", 1)
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
