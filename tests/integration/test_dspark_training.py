"""DSpark end to end on the tiny target through the training launch module (``python -m draftsmith.train``):
the loss falls, the checkpoint exports to the ``Qwen3DSparkModel`` layout for this target, and the
reference decoder's DSpark proposer decodes exactly like plain greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.eval.acceptance import check_draft_matches_target
from draftsmith.eval.export import export
from draftsmith.models.dspark.recipe import DSparkDraftConfig

from helpers.recipes import dflash_recipe, train_with_launch_module

@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    where = tmp_path_factory.mktemp("dspark_run")
    recipe, path = dflash_recipe(tiny_target, where, section=DSparkDraftConfig, markov_rank=8)
    run = where / "run"
    train_with_launch_module(path, run)
    return recipe, run


@pytest.mark.integration
def test_training_through_the_entry_script_lowers_the_loss(trained):
    recipe, run = trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) >= 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert {"acc_3", "alpha", "acceptance_length"} <= set(metrics[-1])


@pytest.mark.integration
def test_export_fits_the_target_and_decodes_like_plain_greedy(trained, tiny_target, tmp_path):
    from draftsmith.target import load_target
    from draftsmith.eval.spec_decode import evaluate, load_draft
    from draftsmith.train.checkpoint import find_checkpoints

    recipe, run = trained
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    assert json.loads((ckpt / "draft_config.json").read_text())["method"] == "dspark"
    out = export(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
    check_draft_matches_target(out, tiny_target)
    model, tok = load_target(tiny_target, torch.float32)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for p in ("Write a haiku about autumn.", "What is the capital of Italy?")]
    r = evaluate(model, tok, load_draft(out, model), prompts, k=4, max_new_tokens=32, progress=False)
    assert r["identical_to_plain"] == 2 and r["counters"]["drafts"] > 0
