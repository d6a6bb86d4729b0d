"""Loss masks under the real chat templates of thinking models (tests/fixtures/chat_templates/):
labels on exactly what the target emits when served (reasoning when it thinks, answer, end of
turn), never on the generation prompt; the kwargs the target is served with reach the template."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.data_prep import served_turns as st
from draftsmith.data_prep.conversations import DataError, normalise_row, tokenize_conversation
from draftsmith.data_prep.served_turns import THINK_CLOSE

from helpers.tiny import build_tokenizer, masked_text

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SPECIALS = ["<think>", "</think>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
            "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]

R, A = "Two and two make four.", "Four."
R2, A2 = "Double four.", "Eight."


def tokenizer(name: str):
    """The tiny byte-level tokenizer carrying the real template ``name`` (and its marker tokens)."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.bos_token = "<｜begin▁of▁sentence｜>"
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def conv(reasoning: bool = True, turns: int = 1) -> list[dict]:
    out = [{"role": "system", "content": "Be brief."}]
    for q, r, a in [("What is 2+2?", R, A), ("And doubled?", R2, A2)][:turns]:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if reasoning:
            out[-1]["reasoning_content"] = r
    return out


def test_qwen3_thinking_labels_the_reasoning_answer_and_end_of_turn():
    tok = tokenizer("qwen3")
    enc = tokenize_conversation(tok, conv(), template_kwargs={"enable_thinking": True})
    assert masked_text(tok, enc) == [f"<think>\n{R}\n</think>\n\n{A}<|im_end|>"]


def test_qwen3_thinking_off_leaves_the_empty_think_block_to_the_prompt():
    tok = tokenizer("qwen3")
    enc = tokenize_conversation(tok, conv(reasoning=False), template_kwargs={"enable_thinking": False})
    text = tok.decode(enc["input_ids"])
    assert text.endswith(f"<|im_start|>assistant\n<think>\n\n</think>\n\n{A}<|im_end|>\n")  # as served
    assert masked_text(tok, enc) == [f"{A}<|im_end|>"]


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_multi_turn_no_longer_raises_and_trains_the_last_reply_as_served(thinking):
    tok = tokenizer("qwen3")
    enc = tokenize_conversation(tok, conv(reasoning=thinking, turns=2), template_kwargs={"enable_thinking": thinking})
    text = tok.decode(enc["input_ids"])
    # the first reply is history as the template renders it (no reasoning, no think block) ...
    assert f"<|im_start|>assistant\n{A}<|im_end|>" in text and R not in text
    # ... and is context: the target never wrote it in this form; the last reply is the label
    last = f"<think>\n{R2}\n</think>\n\n{A2}<|im_end|>" if thinking else f"{A2}<|im_end|>"
    assert masked_text(tok, enc) == [last]


def test_qwen3_reasoning_held_in_the_content_is_split_out():
    tok = tokenizer("qwen3")
    messages = conv(reasoning=False)
    messages[-1]["content"] = f"<think>\n{R}\n</think>\n\n{A}"  # the raw generated text
    enc = tokenize_conversation(tok, messages)
    assert masked_text(tok, enc) == [f"<think>\n{R}\n</think>\n\n{A}<|im_end|>"]


def test_deepseek_r1_forced_think_opening_is_prompt_and_the_reasoning_is_label():
    tok = tokenizer("deepseek_r1")
    messages = conv(reasoning=False)
    messages[-1]["content"] = f"{R}\n</think>\n\n{A}"  # what R1 generates after its prompt's <think>\n
    enc = tokenize_conversation(tok, messages)
    text = tok.decode(enc["input_ids"])
    assert text == f"<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜><think>\n{R}\n</think>\n\n{A}<｜end▁of▁sentence｜>"
    assert masked_text(tok, enc) == [f"{R}\n</think>\n\n{A}<｜end▁of▁sentence｜>"]


def test_deepseek_v3_1_thinking_on_and_off():
    tok = tokenizer("deepseek_v3_1")
    on = tokenize_conversation(tok, conv(), template_kwargs={"thinking": True})
    assert tok.decode(on["input_ids"]).endswith(f"<｜Assistant｜><think>{R}</think>{A}<｜end▁of▁sentence｜>")
    assert masked_text(tok, on) == [f"{R}</think>{A}<｜end▁of▁sentence｜>"]
    off = tokenize_conversation(tok, conv(reasoning=False), template_kwargs={"thinking": False})
    assert tok.decode(off["input_ids"]).endswith(f"<｜Assistant｜></think>{A}<｜end▁of▁sentence｜>")
    assert masked_text(tok, off) == [f"{A}<｜end▁of▁sentence｜>"]


def test_deepseek_v3_1_multi_turn_thinking():
    tok = tokenizer("deepseek_v3_1")
    enc = tokenize_conversation(tok, conv(turns=2), template_kwargs={"thinking": True})
    assert masked_text(tok, enc) == [f"{R2}</think>{A2}<｜end▁of▁sentence｜>"]


def test_kimi_k2_thinking_refills_the_empty_think_block_of_the_last_reply():
    tok = tokenizer("kimi_k2_thinking")
    enc = tokenize_conversation(tok, conv())
    assert masked_text(tok, enc) == [f"<think>{R}</think>{A}<|im_end|>"]


def test_kimi_k2_labels_every_reply_of_a_multi_turn_conversation():
    tok = tokenizer("kimi_k2")  # K2-Instruct renders history as served: one row, every reply labelled
    enc = tokenize_conversation(tok, conv(reasoning=False, turns=2))
    assert masked_text(tok, enc) == [f"{A}<|im_end|>", f"{A2}<|im_end|>"]


@pytest.mark.parametrize("name, kwargs", [("qwen3", {"enable_thinking": False}), ("deepseek_v3_1", {"thinking": False})])
def test_reasoning_the_served_template_has_no_place_for_is_one_line_naming_the_row(name, kwargs):
    with pytest.raises(DataError) as err:
        tokenize_conversation(tokenizer(name), conv(), template_kwargs=kwargs, where="row conv-7")
    msg = str(err.value)
    assert msg.startswith("row conv-7: turn 2 carries reasoning (reasoning_content)") and "\n" not in msg
    assert str(kwargs) in msg


def test_a_template_kwarg_the_template_ignores_is_refused_naming_the_key():
    st.check_template_kwargs(tokenizer("qwen3"), {"enable_thinking": False})
    st.check_template_kwargs(tokenizer("deepseek_v3_1"), {"thinking": True})
    with pytest.raises(st.TemplateError) as err:
        st.check_template_kwargs(tokenizer("deepseek_v3_1"), {"enable_thinking": False})
    msg = str(err.value)
    assert msg.startswith("data.chat_template_kwargs.enable_thinking: the target's chat template never reads")
    assert "thinking" in msg.split("variables:")[1] and "\n" not in msg


def test_rows_keep_reasoning_under_both_field_names():
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]}
    assert normalise_row(row, "auto", "x:1")["messages"][1]["reasoning_content"] == "r"


def test_split_reasoning_keeps_whitespace_so_the_raw_reply_round_trips():
    raw = f"<think>\n{R}\n</think>\n\n{A}"
    reasoning, answer = st.split_reasoning(raw)
    assert (reasoning, answer) == (f"\n{R}\n", f"\n\n{A}")
    assert st.split_reasoning(A) == ("", A)


class ThinkingEngine:
    """Writes what Qwen3 generates with thinking on; records the conversations it is asked."""

    def __init__(self):
        self.asked: list[list[dict]] = []

    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        self.asked += [list(c) for c in conversations]
        return [f"<think>\nthought {len(c)}\n</think>\n\nanswer {len(c)}" for c in conversations]


def test_regenerated_replies_keep_their_reasoning_and_tokenise_back_to_the_served_text(tmp_path):
    from draftsmith.data_prep import regenerate as regen

    rows = [{"id": "a", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
                                     {"role": "user", "content": "q2"}]}]
    engine = ThinkingEngine()
    base = {"chat_template_kwargs": {"enable_thinking": True}}
    out = regen.regenerate(rows, tmp_path / "regen.jsonl", lambda: engine, [0.0], 64, progress=False,
                           fingerprint_base=base, thinking=True)
    first, second = out[0]["messages"][1], out[0]["messages"][3]
    assert first == {"role": "assistant", "content": "\n\nanswer 1", "reasoning_content": "\nthought 1\n"}
    assert engine.asked[1][1]["content"] == "\n\nanswer 1"  # the second turn's history holds the answer alone
    assert out[0]["fingerprint"]["chat_template_kwargs"] == {"enable_thinking": True}
    tok = tokenizer("qwen3")
    enc = tokenize_conversation(tok, out[0]["messages"][:2], template_kwargs={"enable_thinking": True})
    assert masked_text(tok, enc) == ["<think>\nthought 1\n</think>\n\nanswer 1<|im_end|>"]  # the generated text
    assert second["reasoning_content"] == "\nthought 3\n"
    # a changed kwarg regenerates: the cached rows' fingerprint no longer matches
    again = regen.regenerate(rows, tmp_path / "regen.jsonl", lambda: engine, [0.0], 64, progress=False,
                             fingerprint_base={"chat_template_kwargs": {"enable_thinking": False}}, thinking=True)
    assert len(engine.asked) == 4 and again[0]["fingerprint"]["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_server_reply_puts_a_parsed_reasoning_back_in_front_of_the_answer():
    from types import SimpleNamespace

    from draftsmith.data_prep.chat_engines import _reply_text

    parsed = SimpleNamespace(content="\n\nFour.", reasoning_content="\nadd\n", model_extra={})
    assert st.with_reasoning({"role": "assistant", "content": _reply_text(parsed)}) == {
        "role": "assistant", "content": "\n\nFour.", "reasoning_content": "\nadd\n"}
    newer = SimpleNamespace(content="Four.", model_extra={"reasoning": "add"})  # vLLM's newer field name
    assert _reply_text(newer) == "<think>add</think>Four."
    assert _reply_text(SimpleNamespace(content="Four.", model_extra={})) == "Four."


# --- replies cut by max_tokens ----------------------------------------------------------------

CUT_R = "Two and two"  # reasoning the cut interrupted


def cut_conv(content: str) -> list[dict]:
    return conv(reasoning=False)[:-1] + [{"role": "assistant", "content": content}]


@pytest.mark.parametrize("name, kwargs, raw, prompt_end, label", [
    # Qwen3 / Kimi: the target writes <think> itself; R1 / V3.1: the generation prompt opened it
    ("qwen3", {"enable_thinking": True}, f"<think>\n{CUT_R}", "assistant\n", f"<think>\n{CUT_R}"),
    ("kimi_k2_thinking", None, f"<think>{CUT_R}", "<|im_middle|>", f"<think>{CUT_R}"),
    ("deepseek_r1", None, CUT_R, "<｜Assistant｜><think>\n", CUT_R),
    ("deepseek_r1", None, f"<think>{CUT_R}", "<｜Assistant｜><think>\n", CUT_R),  # the server's parsed reasoning
    ("deepseek_v3_1", {"thinking": True}, CUT_R, "<｜Assistant｜><think>", CUT_R),
])
def test_a_reply_cut_inside_its_reasoning_is_labelled_as_far_as_the_target_wrote_it(name, kwargs, raw, prompt_end,
                                                                                     label):
    tok = tokenizer(name)
    enc = tokenize_conversation(tok, cut_conv(raw), cut=True, template_kwargs=kwargs)
    assert masked_text(tok, enc) == [label]  # the reasoning: no </think>, no answer, no end of turn
    text = tok.decode(enc["input_ids"])
    assert text.endswith(prompt_end + label) and THINK_CLOSE not in text  # the row ends where the reply did


@pytest.mark.parametrize("name, kwargs, raw, label, uncut", [
    ("qwen3", {"enable_thinking": True}, f"<think>\n{R}\n</think>\n\nFo", f"<think>\n{R}\n</think>\n\nFo",
     f"<think>\n{R}\n</think>\n\nFo<|im_end|>"),
    ("qwen3", {"enable_thinking": True}, f"<think>\n{R}\n</think>", f"<think>\n{R}\n</think>",  # cut after </think>
     f"<think>\n{R}\n</think>\n\n<|im_end|>"),
    ("deepseek_r1", None, f"{R}\n</think>\n\nFo", f"{R}\n</think>\n\nFo", f"{R}\n</think>\n\nFo<｜end▁of▁sentence｜>"),
    ("deepseek_v3_1", {"thinking": True}, f"{R}</think>Fo", f"{R}</think>Fo", f"{R}</think>Fo<｜end▁of▁sentence｜>"),
])
def test_a_reply_cut_in_its_answer_ends_at_its_text(name, kwargs, raw, label, uncut):
    tok = tokenizer(name)
    enc = tokenize_conversation(tok, cut_conv(raw), cut=True, template_kwargs=kwargs)
    assert masked_text(tok, enc) == [label]
    whole = tokenize_conversation(tok, cut_conv(raw), template_kwargs=kwargs)  # not cut: as before, end labelled
    assert masked_text(tok, whole) == [uncut]


def test_an_uncut_reply_with_an_unclosed_think_keeps_its_rendering():
    """Not cut, ``<think>`` never closed (a reply that stopped inside its reasoning, or a cut one
    from a cache written before rows said so): read as an answer, as before."""
    tok = tokenizer("qwen3")
    enc = tokenize_conversation(tok, cut_conv(f"<think>\n{CUT_R}"), template_kwargs={"enable_thinking": True})
    assert masked_text(tok, enc) == [f"<think>\n\n</think>\n\n<think>\n{CUT_R}<|im_end|>"]


def test_split_reasoning_of_a_cut_reply_reads_an_unclosed_think_as_reasoning():
    assert st.split_reasoning(f"<think>\n{CUT_R}", cut=True) == (f"\n{CUT_R}", "")
    assert st.split_reasoning(f"<think>\n{CUT_R}") == ("", f"<think>\n{CUT_R}")  # not cut: as before
    assert st.split_reasoning(f"<think>\n{R}\n</think>\n\nFo", cut=True) == (f"\n{R}\n", "\n\nFo")
    assert st.split_reasoning("Fo", cut=True) == ("", "Fo")


class CutThinkingEngine:
    """Qwen3 with thinking on, cut by max_tokens on the turns listed in ``cut_turns`` (1-based)."""

    def __init__(self, cut_turns):
        self.cut_turns, self.asked = cut_turns, []

    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        from draftsmith.data_prep.chat_engines import Reply

        self.asked += [list(c) for c in conversations]
        out = []
        for c in conversations:
            turn = sum(m["role"] == "user" for m in c)
            cut = turn in self.cut_turns
            out.append(Reply(f"<think>\n{CUT_R} {turn}" if cut else f"<think>\n{R}\n</think>\n\n{A}", cut))
        return out


@pytest.mark.parametrize("cut_turns", [{2}, {1}, {1, 2}])
def test_a_regenerated_row_is_cut_when_its_last_reply_was(tmp_path, cut_turns):
    from draftsmith.data_prep import regenerate as regen

    rows = [{"id": "a", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
                                     {"role": "user", "content": "q2"}]}]
    engine = CutThinkingEngine(cut_turns)
    out = regen.regenerate(rows, tmp_path / "regen.jsonl", lambda: engine, [0.0], 8, progress=False, thinking=True)
    row, kwargs = out[0], {"enable_thinking": True}
    assert row.get("cut", False) == (2 in cut_turns)  # only the last reply decides
    first, last = row["messages"][1], row["messages"][3]
    # an earlier cut reply is history as generated (no </think> to split at), the next request carries it
    assert first == ({"role": "assistant", "content": f"<think>\n{CUT_R} 1"} if 1 in cut_turns else
                     {"role": "assistant", "content": f"\n\n{A}", "reasoning_content": f"\n{R}\n"})
    assert engine.asked[1][1]["content"] == first["content"]
    tok = tokenizer("qwen3")
    enc = tokenize_conversation(tok, row["messages"], cut=bool(row.get("cut")), template_kwargs=kwargs)
    if 2 in cut_turns:
        assert last == {"role": "assistant", "content": f"<think>\n{CUT_R} 2"}  # stored as generated
        assert masked_text(tok, enc)[-1] == f"<think>\n{CUT_R} 2"
        assert tok.decode(enc["input_ids"]).endswith(f"<|im_start|>assistant\n<think>\n{CUT_R} 2")
    else:
        assert masked_text(tok, enc)[-1] == f"<think>\n{R}\n</think>\n\n{A}<|im_end|>"
