"""draftsmith long-context: the conversations each context-length bucket is measured on."""

import pytest

from draftsmith.eval.long_context import LongContextError, build_long_conversations, load_history

from helpers.tiny import write_jsonl


def _length(tok, conv):
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_buckets_fill_with_whole_exchanges_and_end_with_the_question(chatml_tokenizer, tmp_path):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)},
                                         {"role": "assistant", "content": f"answer {i} " * (3 + i % 7)}]}
            for i in range(60)]
    pairs = load_history(write_jsonl(tmp_path / "h.jsonl", rows))
    assert len(pairs) == 60
    groups = build_long_conversations(pairs, ["final one?", "final two?"], chatml_tokenizer, [64, 256, 512], 3)
    assert list(groups) == ["<=64", "<=256", "<=512"]
    previous = 0
    for limit, convs in zip((64, 256, 512), groups.values()):
        lengths = [_length(chatml_tokenizer, c) for c in convs]
        assert all(n <= limit for n in lengths) and min(lengths) > previous
        previous = limit // 2
        for i, c in enumerate(convs):
            assert c[-1] == {"role": "user", "content": ["final one?", "final two?"][i % 2]}
            roles = [m["role"] for m in c[:-1]]
            assert roles == ["user", "assistant"] * (len(roles) // 2)  # whole exchanges only
    assert groups["<=512"][0] != groups["<=512"][1]  # each conversation draws its own history


def test_a_history_too_short_for_a_bucket_is_refused(chatml_tokenizer, tmp_path):
    rows = [{"id": "c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    pairs = load_history(write_jsonl(tmp_path / "h.jsonl", rows))
    with pytest.raises(LongContextError, match="bucket 4096"):
        build_long_conversations(pairs, ["q?"], chatml_tokenizer, [4096], 1)
    with pytest.raises(LongContextError, match="no user/assistant exchange"):
        load_history(write_jsonl(tmp_path / "p.jsonl", [{"id": "p", "prompt": "only a prompt"}]))
