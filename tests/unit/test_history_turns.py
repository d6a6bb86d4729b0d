"""``data.history_turns``: a chat template that rewrites earlier replies once they are history
(Qwen3 with thinking drops their reasoning) leaves them unlabelled in the conversation's row;
``each`` (the default) trains each of them in a row of its own (``<id>#turn<k>``), labelled as
the target emitted it, beside the usual full row; ``last`` keeps the full row alone. Templates
that render history as served give today's rows either way, and data tokenised before the key
existed is not refused for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.data_prep import conversations as conv
from draftsmith.data_prep import served_turns as st
from draftsmith.data_prep.agreement import disagreements, read_spec
from draftsmith.data_prep.prepare import stage_tokenize
from draftsmith.layout import RunLayout
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.target import TargetInfo
from draftsmith.train.validation import conversation_key, split_by_conversation

from helpers.tiny import CHATML, build_tokenizer, masked_text

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
THINKING = {"enable_thinking": True}
TURNS = [("What is 2+2?", "Two and two make four.", "Four."), ("And doubled?", "Double four.", "Eight."),
         ("And halved?", "Half of eight.", "Four again.")]


def conversation(rid: str = "c", turns: int = 3, reasoning: bool = True, cut: bool = False) -> dict:
    messages = [{"role": "system", "content": "Be brief."}]
    for q, r, a in TURNS[:turns]:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if reasoning:
            messages[-1]["reasoning_content"] = r
    return {"id": rid, "messages": messages, **({"cut": True} if cut else {})}


def emitted(k: int, end: str = "<|im_end|>") -> str:
    """What Qwen3 with thinking emits for reply ``k``: reasoning, answer, end of turn."""
    _, r, a = TURNS[k]
    return f"<think>\n{r}\n</think>\n\n{a}{end}"


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> tuple[TargetInfo, object]:
    """A tokenizer directory with the real Qwen3 chat template (no weights: the tokenize stage reads none)."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return saved(tok, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def chatml_target(tmp_path_factory) -> tuple[TargetInfo, object]:
    """SmolLM2's template family (ChatML): history rendered as served."""
    return saved(build_tokenizer(CHATML), tmp_path_factory.mktemp("chatml"))


def saved(tok, directory: Path) -> tuple[TargetInfo, object]:
    tok.save_pretrained(directory)
    return TargetInfo(path=str(directory), name_or_path=str(directory), vocab_size=len(tok), hidden_size=128,
                      aux_layer_ids=[1, 2, 3]), tok


def tokenize(target, run: Path, records: list[dict], *overrides: str, kwargs: dict | None = THINKING):
    info, tok = target
    sets = [f"data.chat_template_kwargs={json.dumps(kwargs)}"] if kwargs else []
    recipe = load_recipe(None, ["data.max_length=512", *sets, *overrides])
    paths = RunLayout(run).data
    rows = stage_tokenize(recipe, paths, info, records, [])
    return recipe, [dict(r) for r in rows.with_format(None)], json.loads(paths.stats.read_text())


def labels(tok, row: dict) -> list[str]:
    return masked_text(tok, row)


def test_each_trains_every_reply_of_a_qwen3_thinking_conversation_as_served(qwen3_target, tmp_path):
    _, tok = qwen3_target
    _, rows, stats = tokenize(qwen3_target, tmp_path / "run", [conversation()])
    assert [r["id"] for r in rows] == ["c#turn0", "c#turn1", "c"]
    assert [labels(tok, r) for r in rows] == [[emitted(0)], [emitted(1)], [emitted(2)]]
    # exactly what the target emits after each turn's own generation prompt
    messages = [st.with_reasoning(m) for m in conversation()["messages"]]
    for k, (i, row) in enumerate(zip([2, 4, 6], rows)):
        served = st.served_turn(tok, messages, i, THINKING)
        assert served.reply == emitted(k)
        assert tok.decode(row["input_ids"]).startswith(served.text)
    # the row of reply k is the conversation up to it, rendered with it as the last turn
    assert tok.decode(rows[0]["input_ids"]) == st.render(tok, messages[:3], THINKING)
    assert stats["sequences"] == 3 and stats["history_turns"] == {"mode": "each", "conversations": 1, "replies": 2,
                                                                   "rows_added": 2}
    assert stats["tokens"] == sum(r["length"] for r in rows)
    assert stats["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


def test_last_keeps_the_single_row_of_today(qwen3_target, tmp_path):
    _, tok = qwen3_target
    _, rows, stats = tokenize(qwen3_target, tmp_path / "run", [conversation()], "data.history_turns=last")
    today = conv.tokenize_conversation(tok, conversation()["messages"], 512, template_kwargs=THINKING)
    assert [r["id"] for r in rows] == ["c"]
    assert rows[0]["input_ids"] == today["input_ids"] and rows[0]["loss_mask"] == today["loss_mask"]
    assert labels(tok, rows[0]) == [emitted(2)]
    assert stats["sequences"] == 1 and stats["history_turns"] == {"mode": "last", "conversations": 1, "replies": 2,
                                                                   "rows_added": 0}


def test_the_cut_flag_applies_to_the_row_that_ends_with_the_last_reply_only(qwen3_target, tmp_path):
    _, tok = qwen3_target
    _, rows, _ = tokenize(qwen3_target, tmp_path / "run", [conversation(cut=True)])
    assert [r["id"] for r in rows] == ["c#turn0", "c#turn1", "c"]
    assert [labels(tok, r) for r in rows] == [[emitted(0)], [emitted(1)], [emitted(2, end="")]]


def test_thinking_off_trains_each_answer_after_its_empty_think_block(qwen3_target, tmp_path):
    _, tok = qwen3_target
    _, rows, _ = tokenize(qwen3_target, tmp_path / "run", [conversation(turns=2, reasoning=False)],
                          kwargs={"enable_thinking": False})
    assert [r["id"] for r in rows] == ["c#turn0", "c"]
    assert [labels(tok, r) for r in rows] == [["Four.<|im_end|>"], ["Eight.<|im_end|>"]]
    assert tok.decode(rows[0]["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>\n")


def test_stats_count_every_row_and_skip_with_mixed_data_and_num_proc_2(qwen3_target, tmp_path):
    records = [conversation("a"), conversation("b", turns=1), {"id": "n", "messages": [{"role": "user", "content": "hi"}]},
               conversation("d", turns=2), {"id": "bad", "messages": [{"role": "user", "content": "x"},
                                                                       {"role": "assistant", "content": " "}]}]
    _, one, stats = tokenize(qwen3_target, tmp_path / "one", records)
    assert [r["id"] for r in one] == ["a#turn0", "a#turn1", "a", "b", "d#turn0", "d"]
    assert stats["sequences"] == 6 and stats["skipped"] == {"no_assistant_turn": 1, "invalid": 1, "overlong_dropped": 0}
    assert stats["history_turns"] == {"mode": "each", "conversations": 2, "replies": 3, "rows_added": 3}
    _, two, stats2 = tokenize(qwen3_target, tmp_path / "two", records, "data.num_proc=2")
    assert two == one and stats2 == stats


def test_overlong_extra_rows_follow_the_policy_row_by_row(qwen3_target, tmp_path):
    _, tok = qwen3_target
    lengths = [len(conv.tokenize_turns(tok, conversation()["messages"], template_kwargs=THINKING)[0][k][1]["input_ids"])
               for k in range(3)]
    assert lengths == sorted(lengths)
    _, rows, stats = tokenize(qwen3_target, tmp_path / "run", [conversation()], f"data.max_length={lengths[1]}",
                              "data.overlong=drop")
    assert [r["id"] for r in rows] == ["c#turn0", "c#turn1"]  # the full row is over-long; its replies' rows are not
    assert stats["skipped"]["overlong_dropped"] == 1 and stats["history_turns"]["rows_added"] == 2


@pytest.mark.parametrize("history", ["each", "last"])
def test_a_template_that_renders_history_as_served_gives_todays_rows(chatml_target, tmp_path, history):
    _, tok = chatml_target
    records = [conversation("a", reasoning=False), conversation("b", turns=1, reasoning=False)]
    _, rows, stats = tokenize(chatml_target, tmp_path / "run", records, f"data.history_turns={history}", kwargs=None)
    today = [conv.tokenize_conversation(tok, r["messages"], 512) for r in records]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert [(r["input_ids"], r["loss_mask"]) for r in rows] == [(t["input_ids"], t["loss_mask"]) for t in today]
    assert labels(tok, rows[0]) == ["Four.<|im_end|>", "Eight.<|im_end|>", "Four again.<|im_end|>"]
    assert stats["history_turns"] == {"mode": history, "conversations": 0, "replies": 0, "rows_added": 0}
    # the data does not depend on the key: it is not recorded, so flipping it refuses nothing
    assert "data.history_turns" not in read_spec(RunLayout(tmp_path / "run").data)["tokenize"]
    other = "last" if history == "each" else "each"
    assert disagreements(load_recipe(None, ["data.max_length=512", f"data.history_turns={other}"]),
                         tmp_path / "run") == []


def test_data_that_depends_on_the_key_records_it_and_refuses_the_other_value(qwen3_target, tmp_path):
    run = tmp_path / "run"
    recipe, _, _ = tokenize(qwen3_target, run, [conversation()])
    paths = RunLayout(run).data
    assert read_spec(paths)["tokenize"]["data.history_turns"] == "each"
    assert disagreements(recipe, run) == []
    found = disagreements(recipe.model_copy(update={"data": recipe.data.model_copy(update={"history_turns": "last"})}),
                          run)
    assert [(k, old, new) for k, old, _, new in found] == [("data.history_turns", "each", "last")]
    # data tokenised before the key existed (no entry): kept as it is, whatever the recipe says
    spec = json.loads(paths.spec.read_text())
    del spec["tokenize"]["data.history_turns"]
    paths.spec.write_text(json.dumps(spec))
    assert disagreements(recipe, run) == []


def test_a_reply_row_belongs_to_its_conversation_for_the_validation_split():
    assert conversation_key("7:abc#turn3") == conversation_key("7:abc_gen1#turn0") == "7:abc"
    ids = [f"c{i}{suffix}" for i in range(20) for suffix in ("#turn0", "#turn1", "")]
    train, val = split_by_conversation(ids, 0.25, seed=0)
    assert {conversation_key(ids[i]) for i in train}.isdisjoint({conversation_key(ids[i]) for i in val})
    assert len(val) == 5 * 3


def test_the_recipe_key_defaults_to_each_and_refuses_other_values():
    assert load_recipe(None).data.history_turns == "each"
    with pytest.raises(RecipeError, match="data.history_turns: Input should be .each. or .last."):
        load_recipe(None, ["data.history_turns=all"])
