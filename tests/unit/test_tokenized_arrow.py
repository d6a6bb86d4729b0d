"""The tokenised data as a memory-mapped ``datasets`` Arrow dataset (``RUN_DIR/data/tokenized/``):
the same ids and masks as tokenising each conversation directly, ``data.num_proc`` and
``data.max_samples``, legacy ``tokenized.jsonl`` runs, and atomic writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from draftsmith.data_prep import conversations as conv
from draftsmith.data_prep.prepare import missing_stages, prepare
from draftsmith.layout import DataPaths, RunLayout, read_tokenized, write_tokenized_rows
from draftsmith.recipe import load_recipe
from draftsmith.train.data import TokenizedDataset

from helpers.tiny import TINY_AUX, write_jsonl

CONVERSATIONS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
                                 {"role": "assistant", "content": f"The answer is {2 * i}. " * (1 + i % 4)}]}
    for i in range(12)
] + [{"id": "no-reply", "messages": [{"role": "user", "content": "nobody answers"}]}]


def recipe_for(tiny_target: Path, source: Path, *extra: str):
    return load_recipe(None, [
        f"target.name_or_path={tiny_target}", f"data.sources=[{{path: {source}}}]", "data.eval_prompts=null",
        "data.regenerate.enabled=false", f"data.aux_layer_ids={TINY_AUX}", "data.draft_vocab_size=64",
        "data.max_length=48", "data.hidden_states_mode=online", *extra])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("src") / "conv.jsonl", CONVERSATIONS)


def tokenize_run(tiny_target, source, run: Path, *extra: str):
    recipe = recipe_for(tiny_target, source, *extra)
    prepare(recipe, run, ["target", "tokenize"])
    return recipe, RunLayout(run).data


def as_lists(ds) -> list[dict]:
    return [{"id": r["id"], "input_ids": list(r["input_ids"]), "loss_mask": list(r["loss_mask"]), "length": r["length"]}
            for r in ds.with_format(None)]


def test_arrow_dataset_matches_direct_tokenisation(tiny_target, source, tmp_path):
    recipe, paths = tokenize_run(tiny_target, source, tmp_path / "run")
    assert paths.tokenized_done.is_file() and not (paths.root / "tokenized.jsonl").exists()
    ds = read_tokenized(paths)
    assert set(ds.column_names) == {"id", "input_ids", "loss_mask", "length"}
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"
    tok = AutoTokenizer.from_pretrained(tiny_target)
    expected, truncated, no_reply = [], 0, 0
    for c in CONVERSATIONS:
        if not conv.has_assistant_turn(c):
            no_reply += 1
            continue
        t = conv.tokenize_conversation(tok, c["messages"], recipe.data.max_length)
        truncated += t["truncated"]
        if sum(t["loss_mask"]) < 2:  # truncated before the reply
            no_reply += 1
            continue
        expected.append({"id": c["id"], "input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
                         "length": len(t["input_ids"])})
    assert as_lists(ds) == expected
    stats = json.loads(paths.stats.read_text())
    assert stats["sequences"] == len(expected) and stats["skipped"]["no_assistant_turn"] == no_reply
    assert stats["tokens"] == sum(e["length"] for e in expected)
    assert stats["assistant_tokens"] == sum(sum(e["loss_mask"]) for e in expected)
    assert stats["truncated"] == truncated > 0
    # the training dataset reads rows by index from the memory-mapped files
    td = TokenizedDataset(paths, max_length=40)
    assert len(td) == len(expected)
    assert td.lengths() == [min(e["length"], 40) for e in expected]
    item = td[3]
    assert item["input_ids"].tolist() == expected[3]["input_ids"][:40]
    assert item["loss_mask"].tolist() == expected[3]["loss_mask"][:40]


def test_num_proc_2_gives_the_same_dataset(tiny_target, source, tmp_path):
    _, one = tokenize_run(tiny_target, source, tmp_path / "one")
    _, two = tokenize_run(tiny_target, source, tmp_path / "two", "data.num_proc=2")
    assert as_lists(read_tokenized(one)) == as_lists(read_tokenized(two))
    assert json.loads(one.stats.read_text()) == json.loads(two.stats.read_text())


def test_max_samples_limits_rows(tiny_target, source, tmp_path):
    _, paths = tokenize_run(tiny_target, source, tmp_path / "run", "data.max_samples=5")
    ds = read_tokenized(paths)
    assert ds.with_format(None)["id"][:] == [f"c{i}" for i in range(5)]
    assert json.loads(paths.stats.read_text())["sequences"] == 5


def test_max_samples_is_exact_over_several_sources_and_reads_no_further(tiny_target, source, tmp_path, caplog):
    """4 rows of the first source, 2 of the second, and the third (a file that does not even
    exist) is never opened: max_samples counts over the sources together, in order."""
    import logging

    first = write_jsonl(tmp_path / "first.jsonl", CONVERSATIONS[:4])
    recipe = recipe_for(tiny_target, source, "data.max_samples=6", "data.sources=[{path: %s}, {path: %s}, {path: %s}]"
                        % (first, source, tmp_path / "never-read.jsonl"))
    caplog.set_level(logging.INFO, logger="draftsmith")
    prepare(recipe, tmp_path / "run", ["target", "tokenize"])
    paths = RunLayout(tmp_path / "run").data
    assert read_tokenized(paths).with_format(None)["id"][:] == ["0:c0", "0:c1", "0:c2", "0:c3", "1:c0", "1:c1"]
    stats = json.loads(paths.stats.read_text())
    assert [r.split(": ", 1)[1] for r in stats["sources"]] == ["4/4 rows kept", "2/2 rows kept"]
    assert "source 2 (%s) and later ones not read" % (tmp_path / "never-read.jsonl") in caplog.text


def test_sources_are_streamed_not_listed(tiny_target, source, tmp_path, monkeypatch):
    """The tokenize stage pulls records from the sources one at a time: when the 3rd record is
    read, the first has already reached the Arrow writer (no list of the corpus in between)."""
    import draftsmith.data_prep.prepare as prep

    events: list[str] = []
    real_iter = conv.iter_records

    def spy(*args, **kwargs):
        for r in real_iter(*args, **kwargs):
            events.append("read " + r["id"])
            yield r

    real_dumps = prep.json.dumps

    def dumps(obj, *a, **k):
        if isinstance(obj, dict) and "messages" in obj:
            events.append("write " + obj["id"])
        return real_dumps(obj, *a, **k)

    monkeypatch.setattr(prep.conv, "iter_records", spy)
    monkeypatch.setattr(prep.json, "dumps", dumps)
    prepare(recipe_for(tiny_target, source), tmp_path / "run", ["target", "tokenize"])
    assert events.index("write c0") < events.index("read c2")
    assert len([e for e in events if e.startswith("write")]) == len(CONVERSATIONS)


def test_a_bad_source_in_the_stream_raises_its_own_error(tiny_target, source, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{not json\n")
    recipe = recipe_for(tiny_target, source, f"data.sources=[{{path: {source}}}, {{path: {empty}}}]")
    with pytest.raises(conv.DataError, match="empty.jsonl: no usable rows"):
        prepare(recipe, tmp_path / "run", ["target", "tokenize"])
    assert not RunLayout(tmp_path / "run").data.tokenized_done.exists()


def test_data_prepared_before_0_2_0_is_refused_naming_prepare(tmp_path):
    # draftsmith < 0.2.0 tokenised into tokenized.jsonl; this version reads the Arrow dataset only
    paths = DataPaths(tmp_path / "data")
    paths.root.mkdir()
    write_jsonl(paths.root / "tokenized.jsonl", [{"id": "r0", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    recipe = load_recipe(None, ["data.hidden_states_mode=online"])
    (paths.root / "target.json").write_text("{}")
    (paths.vocab).write_bytes(b"")
    assert missing_stages(recipe, tmp_path) == ["regenerate", "tokenize", "vocab", "hidden-states"]
    with pytest.raises(FileNotFoundError, match=r"tokenized.jsonl: data prepared by draftsmith < 0.2.0.*re-run prepare"):
        read_tokenized(paths)


def test_killed_write_is_not_taken_as_done(tiny_target, source, tmp_path):
    run = tmp_path / "run"
    recipe, paths = tokenize_run(tiny_target, source, run)
    good = as_lists(read_tokenized(paths))
    # a write killed before its rename leaves only the temporary directory
    stale = paths.root / ".tokenized.tmp-killed"
    shutil.copytree(paths.tokenized, stale / "dataset")
    shutil.rmtree(paths.tokenized)
    assert "tokenize" in missing_stages(recipe, run)
    with pytest.raises(FileNotFoundError):
        read_tokenized(paths)
    prepare(recipe, run, ["tokenize"])  # reruns, clears the stale temp directory
    assert not stale.exists() and as_lists(read_tokenized(paths)) == good


def test_writer_streams_rows(tmp_path):
    paths = DataPaths(tmp_path / "data")
    rng = np.random.default_rng(0)
    write_tokenized_rows(paths, ({"id": str(i), "input_ids": rng.integers(0, 500, 20).tolist(), "loss_mask": [1] * 20}
                                 for i in range(50)))
    ds = read_tokenized(paths)
    assert len(ds) == 50 and int(ds.select_columns(["length"])[:]["length"].sum()) == 1000
    assert not list(paths.root.glob(".tokenized.tmp-*"))
