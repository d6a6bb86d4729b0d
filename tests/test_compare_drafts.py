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
from draftsmith.data_prep.target import load_target
from draftsmith.eval.compare_drafts import RunError, compare, count_parameters, find_export, main, markdown_table
from draftsmith.eval.export import export
from draftsmith.eval.spec_decode import Proposal, Proposer, evaluate, prompt_token_ids
from draftsmith.recipe import MedusaDraftConfig, RecipeError, load_recipe
from draftsmith.train.method_eagle3 import Eagle3Method
from draftsmith.train.method_medusa import MedusaMethod
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


def test_frozen_lm_head_needs_the_target_init():
    with pytest.raises(RecipeError, match="freeze_lm_head needs draft.init_lm_head_from_target"):
        load_recipe(Path(__file__).parents[1] / "recipes" / "smollm2_135m.yaml", ["draft.init_lm_head_from_target=false", "draft.freeze_lm_head=true"])


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


def hf_greedy_lengths(target, prompts, max_prompts, max_new_tokens):
    """Tokens each prompt gets from ``transformers``' greedy ``generate`` (stop token included)."""
    model, tokenizer = load_target(target, dtype=torch.float32, device="cpu")
    lengths = []
    for ids in prompt_token_ids(tokenizer, str(prompts), max_prompts):
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
        lengths.append(out.shape[1] - len(ids))
    return lengths


class ScriptedProposer(Proposer):
    """A hand-built draft that knows the target's greedy continuation ``seqs[prompt]`` and
    drafts its next ``right`` tokens correctly, then wrong ones (the greedy token + 1)."""

    aux_layer_ids = None
    max_k = None

    def __init__(self, seqs: list[list[int]], prompt_lengths: list[int], right: int, vocab_size: int):
        self.model = torch.nn.Identity()
        self.seqs, self.prompt_lengths, self.right, self.vocab_size = seqs, prompt_lengths, right, vocab_size
        self.prompt, self.seen = -1, 0

    def reset(self) -> None:
        self.prompt, self.seen = self.prompt + 1, 0

    def propose(self, states, next_tokens, k, temperature, generator) -> Proposal:
        self.seen += len(next_tokens)
        done = self.seen - self.prompt_lengths[self.prompt] + 1  # tokens generated, pending one included
        want = self.seqs[self.prompt][done: done + k]
        return Proposal(torch.tensor([t if i < self.right else (t + 1) % self.vocab_size for i, t in enumerate(want)]))


@pytest.fixture
def one_thread():
    """Tiny matmuls on one thread: more only contend on a shared machine (60 s instead of 0.6 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("right", [0, 1, 3])
def test_counters_match_hand_counted_rounds_of_a_scripted_draft(tiny_target, right, tmp_path, one_thread):
    # A draft right on its first `right` tokens of each round and wrong after: every round
    # accepts exactly `right` and emits right + 1 tokens, so with N new tokens per prompt
    # (no stop token reached) a prompt takes R = ceil((N - 1) / (right + 1)) rounds after the
    # first token: drafts = P R, accepted = P R right, AL = 1 + right, per position R or 0.
    k, n_new, p = 3, 10, 3
    model, tokenizer = load_target(tiny_target, dtype=torch.float32, device="cpu")
    prompts = prompt_token_ids(tokenizer, str(write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": q} for q in PROMPTS[:p]])))
    seqs = []
    for ids in prompts:  # the target's greedy tokens, budget + k so the last round's drafts are known
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n_new + k + 1,
                             pad_token_id=tokenizer.pad_token_id)
        seqs.append(out[0, len(ids):].tolist())
    assert all(len(s) == n_new + k + 1 for s in seqs), "the target stopped early: pick other prompts"
    proposer = ScriptedProposer(seqs, [len(i) for i in prompts], right, model.config.vocab_size)
    r = evaluate(model, tokenizer, proposer, prompts, k=k, temperature=0.0, max_new_tokens=n_new)
    rounds = math.ceil((n_new - 1) / (right + 1))
    assert r["counters"] == {"drafts": p * rounds, "draft_tokens": p * rounds * k, "accepted_tokens": p * rounds * right,
                             "per_pos": [p * rounds if i < right else 0 for i in range(k)]}
    assert r["mean_acceptance_length"] == 1 + right
    assert r["outputs"] == [s[:n_new] for s in seqs]


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
