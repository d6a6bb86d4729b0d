"""draftsmith plan's cost measurement against the real engine (eval/serving_costs.py): one vLLM
engine per K on the tiny target, in turn in one worker process, every batch size, prefill split
off by vLLM's own request timestamps, and K = 0 scheduled inside the speculative engine. The plan
arithmetic on top of it is tests/unit/test_serving_plan.py."""

from __future__ import annotations

import importlib.util

import pytest

from draftsmith.eval.serving_costs import measure_costs
from draftsmith.recipe import VllmConfig
from draftsmith.vllm_bridge import spec_config
from draftsmith.vllm_bridge.spec_config import served_method

from helpers.tiny import CPU_VLLM


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_cost_table_of_the_target_and_an_eagle3_draft_at_every_batch_size(tiny_target, tmp_path):
    """An EAGLE-3 draft drafts at every step (ngram only where the target repeats itself, which a
    random tiny target does not)."""
    from helpers.recipes import tiny_deployed_draft

    draft = tiny_deployed_draft(tiny_target, tmp_path)[3]
    spec = {k: v for k, v in spec_config.for_export(served_method(draft), str(draft), 2).items()
            if k != "num_speculative_tokens"}
    table = measure_costs(tiny_target, spec, [0, 2], [1, 2], prompt_tokens=16, new_tokens=8, repeats=1,
                          engine=VllmConfig(**{**CPU_VLLM, "max_model_len": 512}), draft=str(draft), method="eagle3",
                          log_dir=tmp_path)
    # vLLM 0.32 reads a per-batch-size K: K = 0 is also measured inside the speculative engine
    assert sorted((c.batch_size, c.k, c.scheduled_off) for c in table.costs) == [
        (1, 0, False), (1, 0, True), (1, 2, False), (2, 0, False), (2, 0, True), (2, 2, False)]
    for c in table.costs:
        assert c.step_s > 0 and c.steps >= 1
        # the engine kept its request timestamps: the prefill came from them, not from a second pass
        assert c.prefill_s is not None and 0 < c.prefill_s < c.step_s * 100
    assert table.cost(1, 0).steps == 7  # 8 tokens: the prefill's and 7 decode steps
    assert table.source.startswith("measured") and table.engine_version
