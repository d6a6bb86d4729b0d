"""vLLM's rejection sampler on this machine's kernels, with the draft's probabilities
(``draft_sample_method: probabilistic``, what ``draftsmith acceptance --draft-sampling
probabilistic`` and the exports' serving configs ask for at T > 0) and without them (``greedy``,
vLLM's default: the drafted token verified as a one-hot q).

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) is lossless: the first emitted token
is distributed as the target's p whatever q drafted it, and the draft token is accepted with
probability ``sum min(p, q)`` (probabilistic) or ``p(d)`` (greedy). Both are checked on 40,000
requests against their exact values, in a fresh process through vLLM's plugin loading and the CPU
kernel overrides (the path an engine worker takes)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

_IN_VLLM = r"""
import json, sys, torch
from vllm.plugins import load_general_plugins
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import rejection_sample
load_general_plugins()
current_platform.register_triton_kernel_overrides()

mode = sys.argv[1]
n, V = 40000, 6
p = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
q = torch.tensor([0.30, 0.20, 0.05, 0.05, 0.30, 0.10])
gen = torch.Generator().manual_seed(0)
if mode == "probabilistic":
    draft = torch.multinomial(q.expand(n, V), 1, replacement=True, generator=gen)[:, 0]
    draft_probs = q.expand(n, V).contiguous()
else:  # greedy: the argmax of q, verified as one-hot
    draft = torch.full((n,), int(q.argmax()), dtype=torch.long)
    draft_probs = None
meta = SamplingMetadata(temperature=torch.ones(n), all_greedy=False, all_random=True, top_p=None, top_k=None,
                        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
                        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
                        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
torch.manual_seed(1)
out = rejection_sample(draft.to(torch.int32), [1] * n, 1, torch.arange(1, n + 1, dtype=torch.int32), draft_probs,
                       p.log().expand(n, V).contiguous(), torch.full((n, 1), V - 1, dtype=torch.int32), meta)
first = out[:, 0].long()
print(json.dumps({"accepted": float((first == draft).float().mean()),
                  "first": torch.bincount(first, minlength=V).div(n).tolist()}))
"""

P = [0.05, 0.40, 0.10, 0.25, 0.15, 0.05]
Q = [0.30, 0.20, 0.05, 0.05, 0.30, 0.10]
N = 40000


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _IN_VLLM, mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
@pytest.mark.parametrize("mode", ["probabilistic", "greedy"])
def test_vllm_rejection_sampler_is_lossless_and_accepts_as_the_rule_says(mode):
    got = _run(mode)
    want_accept = sum(min(a, b) for a, b in zip(P, Q)) if mode == "probabilistic" else P[Q.index(max(Q))]
    # binomial standard error of a frequency over N draws is at most 0.0025; allow 4 of them
    assert got["accepted"] == pytest.approx(want_accept, abs=0.01)
    for i, (freq, prob) in enumerate(zip(got["first"], P)):
        assert freq == pytest.approx(prob, abs=0.01), f"token {i}: emitted {freq:.4f}, target p {prob}"
