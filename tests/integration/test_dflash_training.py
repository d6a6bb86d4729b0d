"""DFlash end to end on the tiny target: the training launch module lowers the loss, the export
decodes losslessly, and a mask token found in the data stops training at start."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.eval.acceptance import check_draft_matches_target
from draftsmith.models.dflash.proposer import dflash_proposer
from draftsmith.eval.export import export

from helpers.recipes import dflash_recipe, train_with_launch_module


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    where = tmp_path_factory.mktemp("dflash_run")
    recipe, path = dflash_recipe(tiny_target, where)
    run = where / "run"
    train_with_launch_module(path, run)
    return recipe, run


@pytest.mark.integration
def test_training_through_the_cli_lowers_the_loss(trained):
    recipe, run = trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) >= 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert "acceptance_length" in metrics[-1] and metrics[-1]["acceptance_length"] >= 1.0


@pytest.mark.integration
def test_export_of_the_trained_draft_decodes_losslessly(trained, tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.eval.spec_decode import SpecCounters, Target, plain_generate, speculative_generate
    from draftsmith.train.checkpoint import find_checkpoints

    recipe, run = trained
    out = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "export")
    check_draft_matches_target(out, tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    proposer = dflash_proposer(out, model)
    target = Target(model, proposer.aux_layer_ids)
    counters = SpecCounters(3)
    for prompt in ["Write a haiku about autumn.", "What is the capital of Italy?"]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = plain_generate(target, ids, max_new_tokens=32)
        spec = speculative_generate(target, proposer, ids, k=3, max_new_tokens=32, counters=counters)
        assert spec == plain
    assert counters.drafts > 0


@pytest.mark.integration
def test_a_mask_token_that_occurs_in_the_data_stops_training_at_start(trained):
    from draftsmith.train.mask_token import MaskTokenError
    from draftsmith.models.dflash.training import DFlashMethod

    recipe, run = trained
    from draftsmith.layout import DataPaths, read_tokenized

    occurring = int(read_tokenized(DataPaths(run / "data"))[0]["input_ids"][-1])
    bad = recipe.model_copy(deep=True)
    bad.draft.mask_token_id = occurring
    with pytest.raises(MaskTokenError, match=f"mask_token_id={occurring} occurs"):
        DFlashMethod(bad, run)
