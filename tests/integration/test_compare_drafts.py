"""eval/compare_drafts.py on the tiny target: an EAGLE-3 draft (lm_head frozen) and Medusa heads
trained on the same prepared data, exported, and measured side by side by the reference decoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.target import load_target
from draftsmith.cli.compare import main
from draftsmith.eval.compare_drafts import RunError, compare, count_parameters, find_export, markdown_table
from draftsmith.eval.export import export
from draftsmith.eval.spec_decode import prompt_token_ids
from draftsmith.models.medusa.recipe import MedusaDraftConfig
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.models.medusa.training import MedusaMethod
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe


@pytest.fixture(scope="module")
def runs(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    prompts = write_jsonl(root / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    eagle = tiny_recipe(tiny_target, prompts, max_steps=6)
    eagle.draft.freeze_lm_head = True
    prepare(eagle, root / "eagle3")
    fit(eagle, Eagle3Method(eagle, root / "eagle3"), root / "eagle3", progress=False)
    export(find_checkpoints(root / "eagle3" / "checkpoints")[-1], root / "eagle3" / "export" / "eagle3")

    medusa = tiny_recipe(tiny_target, prompts, max_steps=6)
    medusa.draft = MedusaDraftConfig(num_heads=3, num_layers=1)
    (root / "medusa").mkdir()
    (root / "medusa" / "data").symlink_to(root / "eagle3" / "data")  # the same prepared data
    fit(medusa, MedusaMethod(medusa, root / "medusa"), root / "medusa", progress=False)
    export(find_checkpoints(root / "medusa" / "checkpoints")[-1], root / "medusa" / "export")
    return root, eagle


@pytest.mark.integration
def test_frozen_lm_head_stays_at_the_target_rows(runs):
    root, recipe = runs
    method = Eagle3Method(recipe, root / "eagle3")
    exported = load_file(str(root / "eagle3" / "export" / "eagle3" / "model.safetensors"))
    torch.testing.assert_close(exported["lm_head.weight"].float(), method.target_head.weight, rtol=0, atol=0)
    params = count_parameters(root / "eagle3" / "export" / "eagle3", root / "eagle3")
    assert params["parameters"] - params["trained_parameters"] == exported["lm_head.weight"].numel()


@pytest.mark.integration
def test_compare_measures_every_draft_at_every_temperature(runs, tiny_target):
    root, _ = runs
    k, temps = 3, [0.0, 1.0]
    res = compare(str(tiny_target), [root / "eagle3", root / "medusa"], str(root / "prompts.jsonl"), 3, k, temps,
                  max_new_tokens=10, progress=lambda _: None)
    assert set(res["drafts"]) == {"eagle3", "medusa"} and res["num_prompts"] == 3
    g = sum(hf_greedy_lengths(tiny_target, root / "prompts.jsonl", 3, 10))
    for name, d in res["drafts"].items():
        state = json.loads((find_checkpoints(root / name / "checkpoints")[-1] / "train_state.json").read_text())
        assert d["train_tokens"] == state["tokens"] > 0 and d["steps"] == 6
        assert d["train_seconds"] == state["train_seconds"] > 0
        tensors = load_file(str(Path(d["export"]) / "model.safetensors"))
        assert d["parameters"] == sum(v.numel() for n, v in tensors.items() if n not in ("d2t", "t2d"))
        for t in temps:
            r = d["acceptance"][str(t)]
            c = r["counters"]
            assert r["num_prompts"] == 3 and len(r["per_position_acceptance"]) == k
            assert 1.0 <= r["mean_acceptance_length"] <= k + 1 and r["speedup"] > 0
        # Against transformers' own greedy generate: at T=0 speculative decoding emits exactly
        # the target's greedy tokens, and a round of n accepted drafts emits n + 1 of them after
        # the first token, overshooting the budget or stop by at most k in a prompt's last round:
        # G - P <= accepted + drafts <= G - P + k P (G tokens over P prompts).
        c = d["acceptance"]["0.0"]["counters"]
        assert d["acceptance"]["0.0"]["output_tokens"] == res["plain"]["0.0"]["output_tokens"] == g
        assert g - 3 <= c["accepted_tokens"] + c["drafts"] <= g - 3 + k * 3, (c, g)
    table = markdown_table(res).splitlines()
    assert len(table) == 2 + 2 * len(temps)
    assert any(line.startswith("| medusa | 1 |") for line in table)
    e = res["drafts"]["eagle3"]  # the last column: training tokens over the loop's wall time
    assert next(line for line in table if line.startswith("| eagle3 |")).endswith(
        f"| {e['train_tokens'] / e['train_seconds']:,.0f} |")


def hf_greedy_lengths(target, prompts, max_prompts, max_new_tokens):
    """Tokens each prompt gets from ``transformers``' greedy ``generate`` (stop token included)."""
    model, tokenizer = load_target(target, dtype=torch.float32, device="cpu")
    lengths = []
    for ids in prompt_token_ids(tokenizer, str(prompts), max_prompts):
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
        lengths.append(out.shape[1] - len(ids))
    return lengths


@pytest.mark.integration
def test_greedy_drafting_at_t0_accepts_the_same_as_t0_probabilistic(runs, tiny_target):
    # At T=0 the draft sampling mode must not matter (both take the argmax).
    root, _ = runs
    a = compare(str(tiny_target), [root / "eagle3"], str(root / "prompts.jsonl"), 2, 2, [0.0], 8,
                draft_sampling="greedy", progress=lambda _: None)
    b = compare(str(tiny_target), [root / "eagle3"], str(root / "prompts.jsonl"), 2, 2, [0.0], 8,
                draft_sampling="probabilistic", progress=lambda _: None)
    assert a["drafts"]["eagle3"]["acceptance"]["0.0"]["counters"] == b["drafts"]["eagle3"]["acceptance"]["0.0"]["counters"]


@pytest.mark.integration
def test_a_run_without_export_is_named(runs, tmp_path, capsys):
    root, _ = runs
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(RunError, match=str(tmp_path / "export")):
        find_export(tmp_path)
    assert main(["--target", "unused", "--run", str(tmp_path)]) == 1
    assert "draftsmith export" in capsys.readouterr().err


@pytest.mark.integration
def test_cli_writes_json_and_markdown(runs, tiny_target, tmp_path):
    root, _ = runs
    out = tmp_path / "cmp.json"
    assert main(["--target", str(tiny_target), "--run", str(root / "medusa"), "--prompts", str(root / "prompts.jsonl"),
                 "--max-prompts", "1", "--max-new-tokens", "6", "--temperatures", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    al = res["drafts"]["medusa"]["acceptance"]["0.0"]["mean_acceptance_length"]
    assert math.isfinite(al) and f"{al:.3f}" in out.with_suffix(".md").read_text()
