"""``draftsmith compare``'s pieces that need no training: a frozen lm_head needs the target init,
and the acceptance counters match hand-counted rounds of a scripted draft."""

from __future__ import annotations
import math
from pathlib import Path

import pytest
import torch
from draftsmith.target import load_target
from draftsmith.eval.spec_decode import Proposal, Proposer, evaluate, prompt_token_ids
from draftsmith.recipe import RecipeError, load_recipe

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS


def test_frozen_lm_head_needs_the_target_init():
    with pytest.raises(RecipeError, match="freeze_lm_head needs draft.init_lm_head_from_target"):
        load_recipe(Path(__file__).parents[2] / "recipes" / "smollm2_135m.yaml", ["draft.init_lm_head_from_target=false", "draft.freeze_lm_head=true"])


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
