"""MT-bench prompts: HuggingFaceH4/mt_bench_prompts rows (``prompt`` a list of user turns) and
the ``builtin:mt_bench`` source that fetches them with ``datasets``."""

from __future__ import annotations

import pytest

from draftsmith.data_prep.conversations import DataError, load_records, resolve_source_path

from helpers.tiny import write_jsonl

TURNS = ["Write a haiku about rain.", "Now make it rhyme."]


def test_hub_shaped_rows_load_like_fastchat_turns(tmp_path):
    hub = write_jsonl(tmp_path / "h4.jsonl", [
        {"prompt": TURNS, "category": "writing", "prompt_id": 81, "reference": []},
        {"prompt": ["What is 2 + 2?"], "category": "math", "prompt_id": 82, "reference": ["4"]},
    ])
    fastchat = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": TURNS},
        {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?"]},
    ])
    from_hub, report = load_records(str(hub))
    from_fastchat, _ = load_records(str(fastchat))
    assert report.kept == 2 and not report.skipped
    assert from_hub == from_fastchat
    assert from_hub[0] == {"id": "81", "messages": [{"role": "user", "content": TURNS[0]}]}
    # an explicit format says the same
    assert load_records(str(hub), fmt="mt_bench")[0] == from_fastchat


def test_builtin_mt_bench_resolves_to_the_hub_dataset():
    assert resolve_source_path("builtin:mt_bench") == "HuggingFaceH4/mt_bench_prompts"


def test_builtin_mt_bench_offline_names_the_dataset_and_the_local_option(monkeypatch):
    import datasets

    calls = []

    def offline(path, *args, **kwargs):
        calls.append((path, kwargs.get("split")))
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/mt_bench_prompts' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as err:
        load_records("builtin:mt_bench")
    msg = str(err.value)
    assert "HuggingFaceH4/mt_bench_prompts" in msg and "--prompts" in msg
    assert calls == [("HuggingFaceH4/mt_bench_prompts", "train")]


def test_builtin_mt_bench_rows_from_datasets(monkeypatch):
    import datasets

    rows = [{"prompt": TURNS, "category": "writing", "prompt_id": 81, "reference": []}]
    monkeypatch.setattr(datasets, "load_dataset", lambda path, *a, **k: rows)
    records, report = load_records("builtin:mt_bench")
    assert report.source == "HuggingFaceH4/mt_bench_prompts"
    assert records == [{"id": "81", "messages": [{"role": "user", "content": TURNS[0]}]}]
