"""IBM MLP speculator: formula and layout, tied weights, prepare -> train (stage 1, then
stage 2 on target generations) -> export -> reload with identical logits."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.eval.export_heads import load_mlp_speculator
from draftsmith.models.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.train.method_mlp_speculator import MLPSpeculatorMethod
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, mlp_recipe


def test_weight_names_shapes_and_forward_shape():
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=16, inner_dim=24, vocab_size=40, n_predict=3))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["proj.0.weight"] == (24, 16) and shapes["proj.2.weight"] == (24, 24)
    assert shapes["emb.1.weight"] == (40, 24) and shapes["head.2.weight"] == (40, 24)
    assert shapes["ln.0.weight"] == shapes["ln.0.bias"] == (24,)
    assert len(shapes) == 3 * 5
    out = model(torch.randn(2, 5, 16), torch.randint(0, 40, (2, 8)))
    assert out.shape == (3, 2, 5, 40)
    with pytest.raises(ValueError, match="T \\+ n_predict"):
        model(torch.randn(2, 5, 16), torch.randint(0, 40, (2, 7)))


def test_stage_zero_follows_the_published_formula():
    torch.manual_seed(0)
    cfg = MLPSpeculatorConfig(emb_dim=8, inner_dim=12, vocab_size=20, n_predict=4)
    model = MLPSpeculator(cfg)
    state, ids = torch.randn(1, 3, 8), torch.randint(0, 20, (1, 3))
    state_w = 0.5 ** (0.5 / 4)
    emb_w = math.sqrt((1 - state_w**2) * 12 / 2)
    s = state @ model.proj[0].weight.T + (emb_w / state_w) * model.emb[0].weight[ids]
    s = s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * model.ln[0].weight + model.ln[0].bias
    s = F.gelu(s)
    new_state, logits = model.stage(0, state, ids)
    torch.testing.assert_close(new_state, s)
    torch.testing.assert_close(logits, s @ model.head[0].weight.T)


def test_forward_is_teacher_forced_chain_of_stages():
    torch.manual_seed(0)
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=8, inner_dim=8, vocab_size=20, n_predict=3, scale_input=True))
    state, ids = torch.randn(2, 4, 8), torch.randint(0, 20, (2, 7))
    out = model(state, ids)
    s = state
    for i in range(3):  # stage i at t reads x_{t+1+i}
        s, logits = model.stage(i, s, ids[:, 1 + i : 5 + i])
        torch.testing.assert_close(out[i], logits)


def test_forward_with_head_fn_hands_each_stage_its_state_and_head():
    # training computes the loss inside forward (chunked, tests/test_head_loss_chunked.py): head_fn
    # gets stage i's state rows and head[i] instead of the (P, B, T, V) logits
    torch.manual_seed(0)
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=8, inner_dim=12, vocab_size=20, n_predict=3, tie_weights=True))
    state, ids = torch.randn(2, 4, 8), torch.randint(0, 20, (2, 7))
    seen = model(state, ids, head_fn=lambda i, rows, head: (i, rows, head))
    logits = model(state, ids)
    assert [i for i, _, _ in seen] == [0, 1, 2]
    for i, rows, head in seen:
        assert head is model.head[i] and rows.shape == (8, 12)
        torch.testing.assert_close(head(rows), logits[i].flatten(0, 1))


def test_tie_weights_share_stages_like_fms_extras():
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=8, inner_dim=12, vocab_size=20, n_predict=4, tie_weights=True))
    assert all(model.emb[i].weight is model.emb[0].weight for i in range(4))
    assert all(model.head[i].weight is model.head[0].weight for i in range(4))
    assert all(model.ln[i].bias is model.ln[0].bias for i in range(4))
    assert model.proj[1].weight is not model.proj[0].weight
    assert all(model.proj[i].weight is model.proj[1].weight for i in range(2, 4))
    n = sum(p.numel() for p in model.parameters())
    assert n == 20 * 12 + 8 * 12 + 12 * 12 + 20 * 12 + 2 * 12
    with pytest.raises(RecipeError, match="tie_weights needs n_predict >= 2"):
        load_recipe(None, ["draft.method=mlp_speculator", "draft.tie_weights=true",
                           "draft.n_predict=1"])


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("mlp_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    prepare(mlp_recipe(tiny_target, prompts), run)
    return prompts, run


@pytest.mark.integration
def test_stage1_loss_goes_down_then_export_reproduces_logits(tiny_target, prepared, tmp_path):
    import shutil

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
    import shutil

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
    import shutil

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
