"""The whole EAGLE-3 pipeline on a tiny random Llama target: prepare -> train -> export -> reload."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.layout import ExportError
from draftsmith.models.eagle3.format import expected_weight_shapes
from draftsmith.train.checkpoint import read_draft
from draftsmith.layout import DataPaths, read_tokenized
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.recipes import PROMPTS
from helpers.tiny import TINY_AUX

pytestmark = pytest.mark.integration  # prepare -> train -> export on the tiny target


def test_prepare_writes_every_stage(prepared):
    recipe, run, summary = prepared
    data = run / "data"
    info = json.loads((data / "target.json").read_text())
    assert info["aux_layer_ids"] == TINY_AUX
    regen = [json.loads(line) for line in (data / "regen.jsonl").read_text().splitlines()]
    assert len(regen) == len(PROMPTS) and all(r["messages"][-1]["role"] == "assistant" for r in regen)
    assert sorted({r["temperature"] for r in regen}) == [0.0, 0.7]
    vocab = load_file(str(data / "vocab.safetensors"))
    assert vocab["d2t"].shape == (128,) and vocab["t2d"].shape == (512,) and int(vocab["t2d"].sum()) == 128
    assert summary["hidden_states"]["tokens"] == sum(
        len(ids) for ids in read_tokenized(DataPaths(data))["input_ids"])


def test_regeneration_cache_skips_finished_rows(prepared):
    recipe, run, _ = prepared
    before = (run / "data" / "regen.jsonl").read_text()
    prepare(recipe, run, ["regenerate"])  # nothing left to generate: no engine is built
    assert (run / "data" / "regen.jsonl").read_text() == before


def test_train_loss_goes_down_then_export_reloads(prepared, tmp_path):
    recipe, run, _ = prepared
    result = fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    assert result.steps == 25
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # all sequences fit one batch, so every step sees the same fixed batch
    assert metrics[-1]["loss"] < 0.7 * metrics[0]["loss"]
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"]

    ckpt = find_checkpoints(run / "checkpoints")[-1]
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "recipe.yaml",
                 "run_meta.json", "train_state.json", "draft_config.json"):
        assert (ckpt / name).is_file(), name

    out = export(ckpt, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"] and cfg["speculators_model_type"] == "eagle3"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert sc["verifier"]["name_or_path"] == str(recipe.target.name_or_path)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == TINY_AUX
    assert cfg["norm_before_residual"] is True and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 128 and cfg["target_hidden_size"] == 128
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 512

    draft = read_draft(ckpt)
    dcfg, state = draft.config, draft.state
    weights = load_file(str(out / "model.safetensors"))
    shapes = expected_weight_shapes(dcfg)
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool

    # the exported weights rebuild the trained draft exactly
    model = Eagle3DraftModel(dcfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not missing
    for k, v in state.items():
        torch.testing.assert_close(model.state_dict()[k], v)

    legacy = export(ckpt, tmp_path / "legacy", legacy=True)
    lw = load_file(str(legacy / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in lw and not any(k.startswith("layers.") for k in lw)
    lcfg = json.loads((legacy / "config.json").read_text())
    assert lcfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert lcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TINY_AUX


def test_resume_continues_from_last_checkpoint(prepared, tmp_path):
    recipe, run, _ = prepared
    import shutil

    run2 = tmp_path / "run2"
    shutil.copytree(run / "data", run2 / "data")
    r3 = recipe.model_copy(deep=True)
    r3.train.max_steps = 3
    fit(r3, Eagle3Method(r3, run2), run2, progress=False)
    r5 = recipe.model_copy(deep=True)
    r5.train.max_steps = 5
    result = fit(r5, Eagle3Method(r5, run2), run2, resume=True, progress=False)
    assert result.steps == 5
    assert json.loads((find_checkpoints(run2 / "checkpoints")[-1] / "train_state.json").read_text())["step"] == 5


def test_export_refuses_incomplete_checkpoint(tmp_path):
    (tmp_path / "draft_config.json").write_text(json.dumps({"method": "medusa"}))
    with pytest.raises(ExportError, match="model.safetensors missing"):
        export(tmp_path, tmp_path / "out")
