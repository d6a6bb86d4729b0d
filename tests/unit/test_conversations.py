"""Dataset shapes, validation errors and assistant-only loss masks."""

from __future__ import annotations

import pytest

from draftsmith.data_prep.conversations import (
    DataError,
    load_records,
    normalise_row,
    tokenize_conversation,
)

from helpers.tiny import masked_text, write_jsonl

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a fox."},
    {"role": "assistant", "content": "The quick brown fox."},
    {"role": "user", "content": "And a dog?"},
    {"role": "assistant", "content": "The lazy dog."},
]


def test_chatml_mask_covers_exactly_the_assistant_replies_and_end_marker(chatml_tokenizer):
    enc = tokenize_conversation(chatml_tokenizer, CONV)
    assert masked_text(chatml_tokenizer, enc) == ["The quick brown fox.<|im_end|>", "The lazy dog.<|im_end|>"]
    assert len(enc["input_ids"]) == len(enc["loss_mask"])


def test_second_template_mask(zephyr_tokenizer):
    enc = tokenize_conversation(zephyr_tokenizer, CONV)
    assert masked_text(zephyr_tokenizer, enc) == ["The quick brown fox.</s>", "The lazy dog.</s>"]


@pytest.mark.parametrize("template, end", [("chatml", "<|im_end|>"), ("zephyr", "</s>")])
def test_a_reply_cut_by_max_tokens_keeps_its_tokens_and_loses_only_its_end_of_turn_label(template, end, request):
    tok = request.getfixturevalue(f"{template}_tokenizer")
    whole, cut = tokenize_conversation(tok, CONV), tokenize_conversation(tok, CONV, cut=True)
    assert cut["input_ids"] == whole["input_ids"]  # the same text: only the labels differ
    assert masked_text(tok, cut) == [f"The quick brown fox.{end}", "The lazy dog."]  # earlier turns keep theirs
    dropped = [t for t, a, b in zip(whole["input_ids"], whole["loss_mask"], cut["loss_mask"]) if a and not b]
    assert tok.decode(dropped) == end


def test_template_that_rewrites_history_is_rejected(chatml_tokenizer):
    import copy

    tok = copy.deepcopy(chatml_tokenizer)
    # Renders only the last two turns: a prefix rendering is not a prefix of the whole.
    tok.chat_template = "{% for m in messages[-2:] %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    with pytest.raises(DataError, match="cannot produce an assistant mask"):
        tokenize_conversation(tok, CONV)


def test_truncation_flags_overlong(chatml_tokenizer):
    enc = tokenize_conversation(chatml_tokenizer, CONV, max_length=10)
    assert enc["truncated"] and len(enc["input_ids"]) == 10


@pytest.mark.parametrize(
    "row",
    [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"instruction": "hi", "input": "", "output": "hello"},
    ],
    ids=["sharegpt", "messages", "alpaca"],
)
def test_shapes_normalise_to_the_same_messages(row):
    rec = normalise_row(row, "auto", "f:1")
    assert rec["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_tokenized_rows_pass_through():
    rec = normalise_row({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, "auto", "f:1")
    assert rec == {"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    with pytest.raises(DataError, match="equal length"):
        normalise_row({"input_ids": [1, 2], "loss_mask": [0]}, "auto", "f:7")


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "two user turns"),
        ([{"role": "assistant", "content": "a"}], "without a preceding user"),
        ([{"role": "user", "content": "  "}], "empty"),
        ([{"role": "wizard", "content": "a"}], "unknown role"),
    ],
)
def test_bad_conversations_raise_naming_row_and_turn(messages, match):
    with pytest.raises(DataError, match=match) as exc:
        normalise_row({"messages": messages}, "auto", "data.jsonl:12")
    assert "data.jsonl:12" in str(exc.value)


def test_malformed_rows_are_skipped_counted_and_first_reported(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "ok one"},
        "{not json",
        {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
        {"prompt": "ok two"},
    ])
    records, report = load_records(str(path))
    assert [r["messages"][0]["content"] for r in records] == ["ok one", "ok two"]
    assert report.rows == 4 and report.kept == 2
    assert report.skipped == {"malformed": 1, "invalid": 1}
    assert report.first_bad[0] == 2
    with pytest.raises(DataError, match=r"d.jsonl:2: malformed JSON"):
        load_records(str(path), strict=True)


def test_dataset_with_no_usable_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{bad", "[1, 2]"])
    with pytest.raises(DataError, match="no usable rows"):
        load_records(str(path))


def test_builtin_prompt_set_has_six_categories_and_disjoint_split():
    train, _ = load_records("builtin:train")
    held, _ = load_records("builtin:eval")
    assert len(train) + len(held) >= 300
    import json
    from draftsmith.data_prep.conversations import BUILTIN_DIR

    cats = {json.loads(line)["category"] for line in (BUILTIN_DIR / "train.jsonl").read_text().splitlines()}
    assert cats == {"short_qa", "summarization", "code_generation", "creative_writing", "translation",
                    "structured_output"}
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held}


def test_json_file_through_datasets(tmp_path):
    import json

    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"instruction": "say hi", "output": "hi"}, {"instruction": "say yo", "output": "yo"}]))
    records, report = load_records(str(f))
    assert report.kept == 2 and records[1]["messages"][1]["content"] == "yo"


def test_harmony_masks_selected_assistant_channels_only():
    from helpers.tiny import HARMONY, build_tokenizer
    from draftsmith.data_prep.conversations import is_harmony_template

    tok = build_tokenizer(HARMONY)
    assert is_harmony_template(tok)
    conv = [
        {"role": "user", "content": "Name a fox."},
        {"role": "assistant", "content": "The quick brown fox.", "thinking": "dropped by the template"},
        {"role": "user", "content": "And a dog?"},
        {"role": "assistant", "content": "The lazy dog.", "thinking": "A dog that rests."},
    ]
    both = tokenize_conversation(tok, conv, harmony_channels=("analysis", "final"))
    assert masked_text(tok, both) == ["The quick brown fox.<|end|>", "A dog that rests.<|end|>",
                                      "The lazy dog.<|return|>"]
    final = tokenize_conversation(tok, conv, harmony_channels=("final",))
    assert masked_text(tok, final) == ["The quick brown fox.<|end|>", "The lazy dog.<|return|>"]
    # system and user text never carry loss
    assert "ChatGPT" not in "".join(masked_text(tok, both)) and "Name a fox" not in "".join(masked_text(tok, both))


def test_a_cut_mark_survives_normalisation_for_the_tokenizer():
    from draftsmith.data_prep.conversations import normalise_row

    row = {"id": "t", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "half"}]}
    assert normalise_row({**row, "cut": True}, "messages", "f:1") == {**row, "cut": True}
    assert "cut" not in normalise_row(row, "messages", "f:2")
