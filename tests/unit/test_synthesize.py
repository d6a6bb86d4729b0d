"""Magpie-style prompt synthesis from the target alone."""

from __future__ import annotations

import itertools

import torch

from draftsmith.cli.synthesize import main
from draftsmith.data_prep.synthesize import keep_prompt, synthesize, transformers_sampler, user_turn_prefix
from draftsmith.target import load_target


def test_user_turn_prefix_on_two_templates(chatml_tokenizer, zephyr_tokenizer):
    assert user_turn_prefix(chatml_tokenizer) == ("<|im_start|>user\n", "<|im_end|>")
    assert user_turn_prefix(zephyr_tokenizer) == ("<|user|>\n", "</s>")


def test_filters_and_deduplication():
    assert keep_prompt("Write a poem about rivers.", finished=True) is None
    assert keep_prompt("Write a poem about rivers.", finished=False) == "unfinished"
    assert keep_prompt("hi", finished=True) == "too_short"
    assert keep_prompt("tell me <|im_start|> more", finished=True) == "markup"
    assert keep_prompt("the " * 20, finished=True) == "repetitive"
    samples = itertools.cycle([("Explain tides to a child.", True), ("explain  tides to a CHILD.", True),
                               ("x", True), ("Name three rivers in Asia.", True)])
    prompts, counts = synthesize(lambda n: [next(samples) for _ in range(n)], num_prompts=2, batch_size=4)
    assert prompts == ["Explain tides to a child.", "Name three rivers in Asia."]
    assert counts["duplicate"] == 1 and counts["too_short"] == 1 and counts["kept"] == 2


def test_tiny_target_synthesises_user_messages(tiny_target):
    model, tok = load_target(tiny_target)
    prefix, end = user_turn_prefix(tok)
    torch.manual_seed(0)
    gen = transformers_sampler(model, tok, prefix, end, temperature=1.0, max_tokens=24)
    samples = gen(4)
    assert len(samples) == 4 and all(isinstance(t, str) and isinstance(f, bool) for t, f in samples)
    assert all("<|im_end|>" not in t for t, _ in samples)


def test_cli_refuses_a_bad_engine_flag(tiny_target, tmp_path, capsys):
    assert main(["--target", str(tiny_target), "--num-prompts", "2", "--out", str(tmp_path / "m.jsonl"),
                 "--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization" in capsys.readouterr().err
