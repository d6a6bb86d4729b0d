"""The reference decoder's target cache after a round with rejected drafts: whatever the layer kind
(full, sliding-window or Gated DeltaNet linear attention), the next forward pass sees exactly the
committed tokens, as a cache that never saw the rejected ones does."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval.spec_decode import Target
from draftsmith.eval.target_cache import rollback, snapshot_linear_states

from helpers.families import build_family_model


def _next_logits(target: Target, cache, token: int) -> torch.Tensor:
    logits, _ = target.forward(torch.tensor([token]), cache)
    return logits[-1]


@pytest.mark.parametrize("name, prompt_len", [
    ("qwen3_next", 12),  # linear attention: the recurrent state is restored and recomputed
    ("gemma4_text", 20),  # sliding window 8: the rejected keys are cropped past the window
    ("deepseek_v3", 12),  # full attention (MLA): a plain crop
])
@pytest.mark.parametrize("kept", [1, 3])
def test_rollback_leaves_the_cache_of_the_committed_tokens(name, prompt_len, kept):
    model, _ = build_family_model(name)
    target = Target(model)
    ids = torch.randint(0, 384, (prompt_len + 6,), generator=torch.Generator().manual_seed(3))
    prompt, fed, nxt = ids[:prompt_len], ids[prompt_len:prompt_len + 5], int(ids[-1])

    cache = target.new_cache()
    target.forward(prompt, cache)
    committed = cache.get_seq_length()
    saved = snapshot_linear_states(cache)
    assert (saved is not None) == (name == "qwen3_next")
    target.forward(fed, cache)  # the verification pass: 5 tokens, the last 5 - kept rejected
    rollback(cache, committed, fed[:kept], saved, target.extend)
    assert cache.get_seq_length() == prompt_len + kept

    fresh = target.new_cache()
    target.forward(torch.cat([prompt, fed[:kept]]), fresh)
    torch.testing.assert_close(_next_logits(target, cache, nxt), _next_logits(target, fresh, nxt),
                               rtol=1e-4, atol=1e-4)


def test_rollback_after_every_draft_accepted_keeps_the_state():
    """A round whose drafts were all accepted keeps its linear-attention state (no recomputation)."""
    model, _ = build_family_model("qwen3_next")
    target = Target(model)
    ids = torch.randint(0, 384, (16,), generator=torch.Generator().manual_seed(4))
    cache = target.new_cache()
    target.forward(ids[:10], cache)
    saved = snapshot_linear_states(cache)
    target.forward(ids[10:14], cache)
    calls = []
    rollback(cache, 10, ids[10:14], saved, lambda t, c: calls.append(t))
    assert calls == [] and cache.get_seq_length() == 14
    fresh = target.new_cache()
    target.forward(ids[:14], fresh)
    torch.testing.assert_close(_next_logits(target, cache, int(ids[14])), _next_logits(target, fresh, int(ids[14])),
                               rtol=1e-4, atol=1e-4)


def test_logits_apply_the_targets_final_soft_cap():
    """Gemma's ``final_logit_softcapping``: the reference decoder's logits are the model's own."""
    model, _ = build_family_model("gemma4_text")
    ids = torch.randint(0, 384, (1, 9), generator=torch.Generator().manual_seed(5))
    target = Target(model)
    logits, _ = target.forward(ids[0], target.new_cache())
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0].float()
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert ref.abs().max() < 30.0
