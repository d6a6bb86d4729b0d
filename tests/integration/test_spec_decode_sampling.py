"""Sampled speculative decoding follows the target's distribution (a statistical test over many
draws, for EAGLE-3 and MLP speculator drafts, greedy and probabilistic proposals)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from draftsmith.eval.spec_decode import SpecCounters, Target, speculative_generate

from helpers.drafts import random_proposer, strengthen_attention


def exact_distribution(model, prompt: list[int], n_tokens: int) -> torch.Tensor:
    """Joint target distribution ``(V,)*n_tokens`` of the first tokens at T=1, by enumeration."""
    V = model.config.vocab_size
    joint = torch.ones(())
    prefixes = torch.tensor([prompt])  # (V**i, len + i)
    for _ in range(n_tokens):
        with torch.no_grad():
            p = torch.softmax(model(prefixes).logits[:, -1].double(), -1)  # (V**i, V)
        joint = (joint.reshape(-1, 1) * p).reshape(*([V] * (prefixes.shape[1] - len(prompt) + 1)))
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes))[:, None]], 1)
    return joint


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double), stat / 2))


@pytest.mark.parametrize("kind,draft_sampling", [("eagle3", "probabilistic"), ("mlp_speculator", "probabilistic"),
                                                  ("eagle3", "greedy")])
@pytest.mark.integration
def test_sampled_tokens_follow_the_target_distribution(kind, draft_sampling):
    # Small vocab so the exact joint law of the first 4 tokens is enumerable (12**3 prefixes).
    torch.manual_seed(0)
    V = 12
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # context-dependent, moderately peaked next-token laws
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(8.0)
    strengthen_attention(model)
    prompt = [1, 5, 7]
    exact = exact_distribution(model, prompt, 4)  # (V, V, V, V)
    proposer = random_proposer(kind, model, [0, 1, 2], draft_vocab_size=8)  # EAGLE-3: q is 0 on 4 tokens
    proposer.draft_sampling = draft_sampling  # greedy: one-hot q, vLLM's default draft_sample_method
    target = Target(model, proposer.aux_layer_ids)
    gen = torch.Generator().manual_seed(1234)
    counters = SpecCounters(2)
    counts = torch.zeros(V, V, V, V)
    n_samples = 600  # ~15 ms each on the tiny target
    for _ in range(n_samples):
        # x1 comes from the prefill, x2..x3 from the first round's drafts or corrections, and
        # x4 is that round's bonus token when both drafts are accepted
        out = speculative_generate(target, proposer, prompt, k=2, temperature=1.0, max_new_tokens=4,
                                   generator=gen, counters=counters)
        counts[tuple(out)] += 1
    rejected = counters.draft_tokens - counters.accepted_tokens
    # both branches of rejection sampling ran many times (measured: 30-60% of ~2,400 drafts
    # accepted when sampling from q; 155 of 3,402 with greedy drafts of this random draft)
    assert counters.accepted_tokens > 100 and rejected > 100
    alpha = 1e-3  # fixed seed: deterministic; a correct sampler fails this 0.1% of seeds
    for i in range(4):  # marginal of each x_i
        others = tuple(j for j in range(4) if j != i)
        assert chi_square_p_value(counts.sum(others), exact.sum(others)) > alpha, f"x{i + 1}"
    assert chi_square_p_value(counts.sum((2, 3)), exact.sum((2, 3))) > alpha  # joint (x1, x2)
    assert chi_square_p_value(counts.sum((0, 1)), exact.sum((0, 1))) > alpha  # joint (x3, x4)
