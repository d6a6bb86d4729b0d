"""IBM MLP speculator: formula and layout, tied weights, prepare -> train (stage 1, then
stage 2 on target generations, also from packed rows) -> export -> reload with identical logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.models.mlp_speculator.format import load_mlp_speculator
from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.train.data import collate
from draftsmith.models.mlp_speculator.training import MLPSpeculatorMethod, sequences
from draftsmith.train.packing import collate_packed
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, mlp_recipe


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("mlp_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    prepare(mlp_recipe(tiny_target, prompts), run)
    return prompts, run


@pytest.mark.integration
def test_stage1_loss_goes_down_then_export_reproduces_logits(tiny_target, prepared, tmp_path):
    prompts, data_run = prepared
    run = tmp_path / "run"
    shutil.copytree(data_run / "data", run / "data")
    recipe = mlp_recipe(tiny_target, prompts, tie_weights=True, scale_input=True)
    fit(recipe, MLPSpeculatorMethod(recipe, run), run, progress=False)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"loss_0", "loss_1", "loss_2", "acc_0", "acc_2"} <= set(metrics[0])
    assert all(m["stage"] == 1.0 for m in metrics)
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]  # same fixed batch at every step

    ckpt = find_checkpoints(run / "checkpoints")[-1]
    out = export(ckpt, tmp_path / "mlp")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MLPSpeculatorPreTrainedModel"] and cfg["model_type"] == "mlp_speculator"
    assert (cfg["emb_dim"], cfg["inner_dim"], cfg["vocab_size"], cfg["n_predict"]) == (128, 64, 512, 3)
    assert cfg["tie_weights"] is True and cfg["scale_input"] is True and len(cfg["top_k_tokens_per_head"]) == 3
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(f"speculator.{p}.{i}.{w}" for i in range(3)
                                     for p, w in [("emb", "weight"), ("proj", "weight"), ("head", "weight"),
                                                  ("ln", "weight"), ("ln", "bias")])
    torch.testing.assert_close(weights["speculator.emb.2.weight"], weights["speculator.emb.0.weight"])

    trained = MLPSpeculator(MLPSpeculatorConfig(**json.loads((ckpt / "draft_config.json").read_text())["config"]))
    trained.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    reloaded = load_mlp_speculator(out)
    torch.manual_seed(1)
    state, ids = torch.randn(2, 6, 128), torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(state, ids), trained(state, ids), rtol=0, atol=0)


@pytest.mark.integration
def test_stage2_trains_on_sequences_the_target_generates(tiny_target, prepared, tmp_path):
    prompts, data_run = prepared
    run = tmp_path / "run"
    shutil.copytree(data_run / "data", run / "data")
    recipe = mlp_recipe(tiny_target, prompts, stage2_start_step=2, stage2_new_tokens=8)
    recipe.train.max_steps = 4
    method = MLPSpeculatorMethod(recipe, run)
    calls = []
    generate = method.target.generate

    def spy(**kwargs):
        out = generate(**kwargs)
        calls.append((kwargs["input_ids"].shape, out.shape))
        return out

    method.target.generate = spy
    fit(recipe, method, run, progress=False)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in metrics] == [1.0, 1.0, 2.0, 2.0]
    assert len(calls) == 2  # one generation per stage-2 batch
    for (B, P), (B2, L) in calls:
        assert B2 == B and P < L <= P + 8
    assert all(0 < m["stage2_generated_tokens"] <= 8 * 8 for m in metrics[2:])


@pytest.mark.integration
def test_tied_weights_survive_a_resume_exactly(tiny_target, prepared, tmp_path):
    # accelerate's checkpoint stores a tied tensor once; after resuming, the stages must still
    # share one tensor and the run must end where the uninterrupted run ended.
    prompts, prepared_run = prepared
    recipe = mlp_recipe(tiny_target, prompts, tie_weights=True)
    recipe.train.max_steps, recipe.train.checkpoint_every, recipe.train.keep_checkpoints = 6, 3, 3
    runs = {}
    for name in ("full", "resumed"):
        run = tmp_path / name
        run.mkdir()
        shutil.copytree(prepared_run / "data", run / "data")
        runs[name] = run
    fit(recipe, MLPSpeculatorMethod(recipe, runs["full"]), runs["full"], progress=False)
    shutil.copytree(runs["full"] / "checkpoints" / "step-3", runs["resumed"] / "checkpoints" / "step-3")
    shutil.copy(runs["full"] / "metrics.jsonl", runs["resumed"] / "metrics.jsonl")
    method = MLPSpeculatorMethod(recipe, runs["resumed"])
    fit(recipe, method, runs["resumed"], resume=True, progress=False)
    full = load_file(str(runs["full"] / "checkpoints" / "step-6" / "model.safetensors"))
    resumed = load_file(str(runs["resumed"] / "checkpoints" / "step-6" / "model.safetensors"))
    assert full.keys() == resumed.keys()
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=0, atol=0, msg=k)
    # The ties held through the resume. accelerate saves a tensor shared by several stages once,
    # so the resumed run's last checkpoint holds only each group's first tensor: a stage untied
    # on resume would be saved under its own name. Its export writes every stage, all equal to
    # the group's first tensor (one shared update reached all stages), which moved from step 3.
    start = load_file(str(runs["resumed"] / "checkpoints" / "step-3" / "model.safetensors"))
    exported = load_file(str(export(runs["resumed"] / "checkpoints" / "step-6", tmp_path / "export") / "model.safetensors"))
    tied = [(f"{p}.{i}.{w}", f"{p}.{0 if p != 'proj' else 1}.{w}") for p, w, first in
            [("emb", "weight", 1), ("head", "weight", 1), ("ln", "weight", 1), ("ln", "bias", 1), ("proj", "weight", 2)]
            for i in range(first, 3)]
    assert not {key for key, _ in tied} & resumed.keys(), "a tied stage was saved as its own tensor"
    for key, first in tied:
        torch.testing.assert_close(exported["speculator." + key], exported["speculator." + first], rtol=0, atol=0,
                                   msg=f"export: {key} differs from {first}")
        assert not torch.equal(exported["speculator." + key], start[first]), f"{key} not trained after the resume"
    logged = {name: [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}  # timing differs
                     for line in (run / "metrics.jsonl").read_text().splitlines()] for name, run in runs.items()}
    assert len(logged["full"]) == 6 and logged["resumed"] == logged["full"]


# stage 2 on packed rows (train.packing): every packed document's prompt is continued


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
