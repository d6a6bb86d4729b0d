"""``data.regenerate.samples_per_prompt``: several target replies per prompt, each its own row
(``<id>_gen<j>``), sampled at the temperatures of their positions, kept on one side of the
validation split."""

from __future__ import annotations

import pytest

from draftsmith.data_prep import regenerate as regen
from draftsmith.recipe import RegenerateConfig
from draftsmith.train.validation import conversation_key, split_by_conversation


class CountingEngine:
    """Numbers every reply it is asked for, so copies of one prompt get different replies."""

    def __init__(self):
        self.asked = 0

    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        out = []
        for c, t in zip(conversations, temperatures):
            self.asked += 1
            out.append(f"{c[-1]['content']} reply {self.asked} at T={t}")
        return out


def _rows(n: int) -> list[dict]:
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old"}]}
            for i in range(n)]


def test_one_sample_per_prompt_leaves_the_records_as_they_are():
    rows = _rows(3)
    assert list(regen.repeat_prompts(rows, 1)) == rows


def test_copies_are_regenerated_as_rows_of_their_own_at_their_positions_temperature(tmp_path):
    engine = CountingEngine()
    rows = _rows(3) + [{"id": "tok", "input_ids": [1, 2], "loss_mask": [0, 1]}]  # tokenised: passes once
    out = regen.regenerate(regen.repeat_prompts(rows, 3), tmp_path / "regen.jsonl", lambda: engine, [0.0, 0.7], 8,
                           batch_size=4, progress=False)
    assert [r["id"] for r in out] == ["p0", "p0_gen1", "p0_gen2", "p1", "p1_gen1", "p1_gen2",
                                      "p2", "p2_gen1", "p2_gen2", "tok"]
    assert engine.asked == 9
    assert [r["temperature"] for r in out[:9]] == [0.0, 0.7] * 4 + [0.0]  # row i at temperatures[i % 2]
    replies = [r["messages"][-1]["content"] for r in out[:9]]
    assert len(set(replies)) == 9 and all(x.startswith("q0 ") for x in replies[:3])
    assert [conversation_key(r["id"]) for r in out[:9]] == ["p0"] * 3 + ["p1"] * 3 + ["p2"] * 3
    # a rerun reads every copy back from the cache
    again = regen.regenerate(regen.repeat_prompts(rows, 3), tmp_path / "regen.jsonl",
                             lambda: pytest.fail("everything is cached"), [0.0, 0.7], 8, progress=False)
    assert [r["messages"][-1]["content"] for r in again[:9]] == replies


def test_copies_of_a_prompt_stay_on_one_side_of_the_validation_split():
    ids = [r["id"] for r in regen.repeat_prompts(_rows(20), 4)]
    train, val = split_by_conversation(ids, 0.25, seed=0)
    assert len(val) == 5 * 4
    assert not {conversation_key(ids[i]) for i in train} & {conversation_key(ids[i]) for i in val}


def test_more_than_one_sample_needs_a_temperature_above_zero():
    assert RegenerateConfig().samples_per_prompt == 1
    assert RegenerateConfig(samples_per_prompt=4, temperatures=[0.0, 0.8]).samples_per_prompt == 4
    with pytest.raises(ValueError, match="samples_per_prompt=2 needs a temperature > 0"):
        RegenerateConfig(samples_per_prompt=2, temperatures=[0.0])
    with pytest.raises(ValueError, match="samples_per_prompt"):
        RegenerateConfig(samples_per_prompt=0)
