"""Medusa heads trained on the tiny target: the loss goes down, the export reloads, the export CLI
dispatches on the method and refuses a checkpoint of another target."""

from __future__ import annotations
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.export import export
from draftsmith.layout import ExportError
from draftsmith.models.medusa.format import load_medusa, medusa_weight_shapes
from draftsmith.models.medusa.model import MedusaConfig
from draftsmith.train.checkpoint import find_checkpoints


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_loss_goes_down_and_export_reloads(medusa_trained, tmp_path):
    recipe, run = medusa_trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 20
    assert {"loss_0", "loss_1", "loss_2", "acc_0", "acc_1", "acc_2"} <= set(metrics[0])
    # every step sees the same fixed batch (8 sequences, batch 8)
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"]

    ckpt = find_checkpoints(run / "checkpoints")[-1]
    out = export(ckpt, tmp_path / "medusa")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_hidden_layers"]) == (128, 512, 3, 1)
    assert cfg["truncated_vocab_size"] is None and cfg["medusa_fc_bias"] is True
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == medusa_weight_shapes(MedusaConfig(128, 512, 3, 1))

    trained_state = load_file(str(ckpt / "model.safetensors"))
    model = load_medusa(out)
    for k, v in trained_state.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)


@pytest.mark.integration
def test_export_cli_dispatches_on_method(medusa_trained, tmp_path):
    _, run = medusa_trained
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli.export", str(run), str(tmp_path / "cli")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["model_type"] == "medusa"


@pytest.mark.integration
def test_export_refuses_checkpoint_for_another_target(medusa_trained, tmp_path):
    import shutil

    _, run = medusa_trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(find_checkpoints(run / "checkpoints")[-1], ckpt)
    meta = json.loads((ckpt / "draft_config.json").read_text())
    meta["target"]["vocab_size"] = 640
    (ckpt / "draft_config.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match="vocab_size"):
        export(ckpt, tmp_path / "out")
