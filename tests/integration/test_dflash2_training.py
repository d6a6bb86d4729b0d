"""DFlash2 end to end on the tiny target: ``python -m draftsmith.train`` lowers both terms of the loss and the
export decodes losslessly with the reference decoder."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.eval.acceptance import check_draft_matches_target
from draftsmith.models.dflash2.proposer import DFlash2Proposer, dflash2_proposer
from draftsmith.eval.export import export

from helpers.recipes import dflash2_recipe, train_with_launch_module

@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    where = tmp_path_factory.mktemp("dflash2_run")
    recipe, path = dflash2_recipe(tiny_target, where)
    run = where / "run"
    train_with_launch_module(path, run)
    return recipe, run


@pytest.mark.integration
def test_training_through_the_cli_lowers_both_terms(trained):
    _, run = trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in metrics if "selector_loss" in m]
    assert len(rows) >= 30
    for key in ("loss", "dflash_loss", "selector_loss"):
        first, last = sum(m[key] for m in rows[:5]) / 5, sum(m[key] for m in rows[-5:]) / 5
        assert last < 0.8 * first, (key, first, last)
    assert 0.0 <= rows[-1]["selector_coverage"] <= 1.0 and 0.0 <= rows[-1]["selector_acc"] <= 1.0


@pytest.mark.integration
def test_export_of_the_trained_draft_decodes_losslessly(trained, tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.eval.spec_decode import SpecCounters, Target, plain_generate, speculative_generate
    from draftsmith.train.checkpoint import find_checkpoints

    _, run = trained
    out = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash2"
    check_draft_matches_target(out, tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    proposer = dflash2_proposer(out, model)
    assert isinstance(proposer, DFlash2Proposer)
    target = Target(model, proposer.aux_layer_ids)
    counters = SpecCounters(3)
    for prompt in ["Write a haiku about autumn.", "What is the capital of Italy?"]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = plain_generate(target, ids, max_new_tokens=32)
        assert speculative_generate(target, proposer, ids, k=3, max_new_tokens=32, counters=counters) == plain
    assert counters.drafts > 0 and counters.accepted_tokens > 0

