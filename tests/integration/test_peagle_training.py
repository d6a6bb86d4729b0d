"""P-EAGLE end to end on the tiny target: the loss falls and the export decodes losslessly, a mask
token found in the data is refused, and the training launch module trains with gradient checkpointing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from draftsmith.eval.acceptance import check_draft_matches_target
from draftsmith.models.peagle.proposer import PEagleProposer
from draftsmith.train.mask_token import MaskTokenError


@pytest.mark.integration
def test_training_loss_falls_then_export_decodes_losslessly(peagle_run, tiny_target, tmp_path):
    from draftsmith.target import load_target
    from draftsmith.eval.export import export
    from draftsmith.eval.spec_decode import SpecCounters, Target, load_draft, plain_generate, speculative_generate
    from draftsmith.train.checkpoint import find_checkpoints
    from draftsmith.models.peagle.training import PEagleMethod
    from draftsmith.train.trainer import fit

    recipe, run = peagle_run
    method = PEagleMethod(recipe, run)
    assert method.config.mask_token_id not in {0, method.config.vocab_size}  # chosen automatically, never 0
    result = fit(recipe, method, run, progress=False)
    assert result.steps == 30
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.7 * metrics[0]["loss"]
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"] and "acc_2" in metrics[-1] and "expected_al" in metrics[-1]

    ckpt = find_checkpoints(run / "checkpoints")[-1]
    meta = json.loads((ckpt / "draft_config.json").read_text())
    assert meta["method"] == "peagle" and meta["config"]["num_depths"] == 3
    out = export(ckpt, tmp_path / "draft")  # the registry's exporter for the checkpoint's method
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == method.config.mask_token_id
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    check_draft_matches_target(out, tiny_target)
    from helpers.tiny import build_tiny_target
    from draftsmith.eval.acceptance import DraftMismatchError

    with pytest.raises(DraftMismatchError, match="vocab_size"):
        check_draft_matches_target(out, build_tiny_target(tmp_path / "other", vocab_size=640))

    model, tok = load_target(tiny_target, torch.float32)
    proposer = load_draft(out, model)
    assert isinstance(proposer, PEagleProposer)
    target, plain = Target(model, proposer.aux_layer_ids), Target(model)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for p in ("Write a haiku about autumn.", "What is the capital of Italy?")]
    counters = SpecCounters(3)
    for p in prompts:
        spec = speculative_generate(target, proposer, p, k=3, max_new_tokens=24, counters=counters)
        assert spec == plain_generate(plain, p, max_new_tokens=24)
    assert counters.drafts > 0 and counters.accepted_tokens > 0  # the trained draft is accepted sometimes


@pytest.mark.integration
def test_mask_token_that_occurs_in_the_data_is_refused_by_the_method(peagle_run):
    from draftsmith.layout import DataPaths, read_tokenized
    from draftsmith.models.peagle.training import PEagleMethod

    recipe, run = peagle_run
    ids = np.concatenate([np.asarray(r) for r in read_tokenized(DataPaths(run / "data"))["input_ids"]])
    used = int(np.bincount(ids).argmax())
    bad = recipe.model_copy(deep=True)
    bad.draft.mask_token_id = used
    with pytest.raises(MaskTokenError, match=rf"draft.mask_token_id={used} occurs \d+ times in .*tokenized"):
        PEagleMethod(bad, run)


@pytest.mark.integration
def test_entry_script_trains_with_gradient_checkpointing(peagle_run, tmp_path):
    import shutil
    import subprocess
    import sys

    from draftsmith.recipe import dump_recipe
    from draftsmith.train.checkpoint import find_checkpoints

    recipe, run = peagle_run
    shutil.copytree(run / "data", tmp_path / "run" / "data")
    dump_recipe(recipe, tmp_path / "peagle.yaml")
    done = subprocess.run([sys.executable, "-m", "draftsmith.train", str(tmp_path / "peagle.yaml"), "--run-dir", str(tmp_path / "run"),
                           "--no-prepare", "--set", "train.max_steps=2", "--set", "draft.gradient_checkpointing=true"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [c.name for c in find_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-2"]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(last["loss"]) and last["loss"] > 0
