"""Online hidden states (target run by the trainer) train exactly like offline shards."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file
import torch

from draftsmith.data_prep.prepare import prepare
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

pytestmark = pytest.mark.integration  # trains the tiny target end to end


def test_online_and_offline_give_the_same_batches_losses_and_weights(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    offline = tiny_recipe(tiny_target, prompts, max_steps=3, batch_size=3)
    offline.data.hidden_states_dtype = "float32"  # bit-comparable with the online fp32 target
    run_off = tmp_path / "offline"
    prepare(offline, run_off)
    fit(offline, Eagle3Method(offline, run_off), run_off, progress=False)

    online = offline.model_copy(deep=True)
    online.data.hidden_states_mode = "online"
    run_on = tmp_path / "online"
    shutil.copytree(run_off / "data", run_on / "data", ignore=shutil.ignore_patterns("hidden_states"))
    fit(online, Eagle3Method(online, run_on), run_on, progress=False)
    assert not (run_on / "data" / "hidden_states").exists()

    m_off = [json.loads(x) for x in (run_off / "metrics.jsonl").read_text().splitlines()]
    m_on = [json.loads(x) for x in (run_on / "metrics.jsonl").read_text().splitlines()]
    assert len(m_off) == len(m_on) == 3
    for a, b in zip(m_off, m_on):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, a["loss"])
        assert a["acc_0"] == b["acc_0"]
    w_off = load_file(str(find_checkpoints(run_off / "checkpoints")[-1] / "model.safetensors"))
    w_on = load_file(str(find_checkpoints(run_on / "checkpoints")[-1] / "model.safetensors"))
    for k in w_off:
        torch.testing.assert_close(w_on[k], w_off[k], rtol=1e-4, atol=1e-5)
