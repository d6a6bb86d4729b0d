"""The gpt_oss architecture (MoE, attention sinks, sliding-window layers) as a target: a tiny
random GptOssForCausalLM runs data prep, a few training steps and export on CPU."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.data_prep.chat_engines import TransformersChatEngine, VllmChatEngine
from draftsmith.data_prep.regenerate import draw_reasoning_effort, regenerate
from draftsmith.recipe import load_recipe

from helpers.tiny import HARMONY, build_tokenizer

REPO = Path(__file__).resolve().parents[2]


# gpt-oss's real template renders the effort into its system message ("Reasoning: medium" by
# default); the tiny harmony template of conftest gets the same line.
HARMONY_EFFORT = HARMONY.replace(
    "You are ChatGPT.", "You are ChatGPT.\nReasoning: {{ reasoning_effort | default('medium') }}")
MIX = {"low": 1.0, "medium": 1.0, "high": 2.0}


def harmony_effort_tokenizer():
    tok = build_tokenizer(HARMONY)
    tok.chat_template = HARMONY_EFFORT
    return tok


class PromptRecorder:
    """Stands in for the target in ``TransformersChatEngine``: records the rendered prompts and
    answers one token."""

    device = torch.device("cpu")

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, input_ids, attention_mask, **kwargs):
        for row, att in zip(input_ids, attention_mask):
            self.prompts.append(self.tok.decode(row[att.bool()]))
        return torch.cat([input_ids, torch.full((input_ids.shape[0], 1), 20)], dim=1)


def effort_in(prompt: str) -> str:
    return re.search(r"Reasoning: (\w+)", prompt).group(1)


def test_regenerated_prompts_carry_the_drawn_efforts_in_the_mix_proportions(tmp_path):
    tok = harmony_effort_tokenizer()
    model = PromptRecorder(tok)
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(400)]
    out = regenerate(records, tmp_path / "regen.jsonl", lambda: TransformersChatEngine(model, tok, 0), [0.0], 4,
                     batch_size=64, progress=False, reasoning_effort=MIX, harmony=True, seed=7)
    assert len(model.prompts) == 400
    by_question = {re.search(r"question (\d+)", p).group(1): effort_in(p) for p in model.prompts}
    # the effort rendered into each prompt is the one stored in that conversation's row
    assert all(by_question[r["id"][1:]] == r["reasoning_effort"] for r in out)
    cached = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert [r["reasoning_effort"] for r in cached] == [r["reasoning_effort"] for r in out]
    counts = Counter(by_question.values())
    for effort, weight in MIX.items():  # 1/4, 1/4, 1/2 (400 draws: sd ~0.025)
        assert abs(counts[effort] / 400 - weight / sum(MIX.values())) < 0.08, counts
    # deterministic: another seed draws differently, the same seed identically, whatever the order
    assert [draw_reasoning_effort(r["id"], MIX, 7) for r in out] == [r["reasoning_effort"] for r in out]
    assert [draw_reasoning_effort(r["id"], MIX, 8) for r in out] != [r["reasoning_effort"] for r in out]


def test_every_turn_of_a_conversation_uses_its_effort(tmp_path):
    tok = harmony_effort_tokenizer()
    model = PromptRecorder(tok)
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "second"}]
    out = regenerate([{"id": "a", "messages": msgs}], tmp_path / "c.jsonl", lambda: TransformersChatEngine(model, tok, 0),
                     [0.0], 4, progress=False, reasoning_effort={"high": 1.0}, harmony=True)
    assert len(model.prompts) == 2 and all(effort_in(p) == "high" for p in model.prompts)
    assert out[0]["reasoning_effort"] == "high"


def test_vllm_engine_passes_the_effort_as_chat_template_kwargs():
    tok = harmony_effort_tokenizer()

    class FakeLLM:  # records what LLM.chat is given and renders it like vLLM does
        def __init__(self):
            self.prompts = []

        def chat(self, conversations, params, use_tqdm, chat_template_kwargs=None):
            assert len(params) == len(conversations)
            outs = []
            for c in conversations:
                self.prompts.append(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                            **(chat_template_kwargs or {})))
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=f"reply to {c[-1]['content']}",
                                                                      finish_reason="stop")]))
            return outs

    engine = VllmChatEngine.__new__(VllmChatEngine)  # no vLLM start: only the call it makes
    engine.llm = FakeLLM()
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    replies = engine.generate(convs, [0.0, 1.0, 0.0, 1.0], 8, ["low", "high", "low", None])
    assert [r.text for r in replies] == [f"reply to q{i}" for i in range(4)]  # in input order despite grouping
    assert [effort_in(p) for p in engine.llm.prompts] == ["low", "low", "high", "medium"]


def test_reasoning_effort_for_a_non_harmony_target_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="data.regenerate.reasoning_effort"):
        regenerate([{"id": "a", "messages": [{"role": "user", "content": "hi"}]}], tmp_path / "c.jsonl",
                   lambda: None, [0.0], 4, progress=False, reasoning_effort=MIX, harmony=False)


def test_gpt_oss_recipes_regenerate_with_an_effort_mix():
    for name in ("gptoss120b", "gptoss20b"):
        mix = load_recipe(REPO / "recipes" / f"{name}.yaml").data.regenerate.reasoning_effort
        assert mix and set(mix) <= {"low", "medium", "high"} and sum(mix.values()) > 0


def test_tokenized_conversation_carries_the_effort_it_was_regenerated_at():
    from draftsmith.data_prep.conversations import tokenize_conversation

    tok = harmony_effort_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    high = tokenize_conversation(tok, msgs, None, ("analysis", "final"), "high")
    default = tokenize_conversation(tok, msgs, None, ("analysis", "final"))
    assert effort_in(tok.decode(high["input_ids"])) == "high"
    assert effort_in(tok.decode(default["input_ids"])) == "medium"
    assert sum(high["loss_mask"]) == sum(default["loss_mask"]) > 0  # same assistant tokens trained
