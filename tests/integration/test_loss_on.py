"""``train.loss_on: all`` on the tiny target's prepared EAGLE-3 run: training batches predict every
real token (prompt and template positions too, against the target's distribution there), the
validation batches and the default stay on data prep's assistant-only loss mask."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftsmith.train.data import BatchCollator, collate
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit

pytestmark = pytest.mark.integration


def test_loss_on_all_trains_prompt_positions(prepared):
    recipe, run, _ = prepared
    method = Eagle3Method(recipe, run)
    items = [method.dataset()[i] for i in range(4)]
    assistant = BatchCollator(collate, method.batch_plan())(items)
    everything = BatchCollator(collate, method.batch_plan(), loss_on_all=True)(items)
    assert torch.equal(everything["loss_mask"], assistant["attention_mask"])
    prompt = (assistant["attention_mask"] == 1) & (assistant["loss_mask"] == 0)
    assert prompt.any()  # the data has prompt tokens the default does not train
    assert torch.equal(assistant["loss_mask"], collate(items)["loss_mask"])  # the default is data prep's mask

    torch.manual_seed(0)
    model = method.build_model()
    loss_assistant, _ = method.compute_loss(model, assistant)
    loss_all, _ = method.compute_loss(model, everything)
    assert torch.isfinite(loss_all) and loss_all.item() != loss_assistant.item()


def test_loss_on_all_trains_a_run_and_validation_is_unchanged(prepared, tmp_path):
    recipe, run, _ = prepared
    curves, vals = [], []
    for name, loss_on in (("assistant", "assistant"), ("all", "all")):
        r = recipe.model_copy(deep=True)
        r.train.max_steps, r.train.loss_on = 4, loss_on
        r.data.validation_fraction, r.train.eval_every = 0.25, 4
        root = tmp_path / name
        root.mkdir()
        shutil.copytree(run / "data", root / "data")
        fit(r, Eagle3Method(r, root), root, progress=False)
        rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
        curves.append([row["loss"] for row in rows if "loss" in row])
        vals.append([row for row in rows if "val_loss" in row])
    assert curves[0] and curves[1] and curves[0][0] != curves[1][0]  # step 1's loss sees more tokens
    # the same held-out conversations, simulated from their assistant tokens in both runs (chains
    # start at trained positions: had validation read every token, the second run would count more)
    assert vals[0] and vals[1]
    assert [v["val_chains"] for v in vals[0]] == [v["val_chains"] for v in vals[1]]
