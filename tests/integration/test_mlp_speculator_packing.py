"""The MLP speculator's stage 2 on packed rows (train.packing): the target continues every packed
document's prompt, exactly as it continues the same sequences in a padded batch, and a packed run
trains through stage 1 and stage 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftsmith.data_prep.prepare import prepare
from draftsmith.train.data import collate
from draftsmith.train.method_mlp_speculator import MLPSpeculatorMethod, sequences
from draftsmith.train.packing import collate_packed
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, mlp_recipe


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("mlp_packed_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    prepare(mlp_recipe(tiny_target, prompts), run)
    return prompts, run


def test_sequences_of_packed_rows_are_their_documents():
    ids = torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 8, 0, 0, 0]])
    docs = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, -1, -1, -1]])
    att = (docs >= 0).long()
    got = sequences({"input_ids": ids, "loss_mask": att, "attention_mask": att, "document_ids": docs})
    assert got[0].tolist() == [[1, 2, 0], [3, 4, 5], [6, 7, 8]]
    assert got[2].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]


@pytest.mark.integration
def test_stage2_generates_from_every_packed_document_as_from_the_padded_batch(tiny_target, prepared, tmp_path):
    prompts, data_run = prepared
    run = tmp_path / "run"
    shutil.copytree(data_run / "data", run / "data")
    recipe = mlp_recipe(tiny_target, prompts, stage2_start_step=0, stage2_new_tokens=6, stage2_temperature=0.0)
    method = MLPSpeculatorMethod(recipe, run)
    data = method.dataset()
    items = [data[i] for i in range(3)]
    packed = method.generate_batch(collate_packed([[items[0], items[1]], [items[2]]]))
    padded = method.generate_batch(collate(items))
    assert packed["input_ids"].shape[0] == 3  # one generated row per document
    for key in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(packed[key], padded[key]), key
    torch.testing.assert_close(packed["final_hidden_states"], padded["final_hidden_states"], rtol=0, atol=0)
    assert int(packed["loss_mask"].sum()) > 0


@pytest.mark.integration
def test_a_packed_run_trains_through_both_stages(tiny_target, prepared, tmp_path):
    prompts, data_run = prepared
    run = tmp_path / "run"
    shutil.copytree(data_run / "data", run / "data")
    recipe = mlp_recipe(tiny_target, prompts, stage2_start_step=2, stage2_new_tokens=8)
    recipe.train.packing, recipe.train.max_steps = True, 4
    fit(recipe, MLPSpeculatorMethod(recipe, run), run, progress=False)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in metrics] == [1.0, 1.0, 2.0, 2.0]
    assert all(m["stage2_generated_tokens"] > 0 for m in metrics[2:])
