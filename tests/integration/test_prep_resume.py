"""Data preparation killed with SIGKILL part-way and rerun: finished hidden-state shards and
regenerated conversations are kept (not recomputed), and the result has no duplicates or
gaps: the same sequence ids, tokens and shard bytes as an uninterrupted run.

The kill is a real SIGKILL of a real ``data_prep/prepare.py`` process, delivered by the
process itself at a chosen point (after the n-th shard's temp file is written, before its
rename; or when the n-th regeneration batch starts) so the test never races the target.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.data_prep.shards import load_manifest
from draftsmith.train.data import HiddenStateDataset
from draftsmith.data_prep.regenerate import regenerate

from helpers.faults import PREP_KILLER

pytestmark = pytest.mark.integration  # kills and reruns data_prep/prepare.py processes

REPO = Path(__file__).resolve().parents[2]

def prepare_cmd(prepared, run: Path, *overrides: str, kill: tuple[str, int] | None = None) -> list[str]:
    recipe, _, _ = prepared
    recipe_path = run / "recipe.in.yaml"
    from draftsmith.recipe import dump_recipe

    run.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, recipe_path)
    args = [str(recipe_path), "--run-dir", str(run)] + [a for o in overrides for a in ("--set", o)]
    if kill is None:
        return [sys.executable, "-m", "draftsmith.cli.prepare", *args]
    script = run.parent / "killer.py"
    script.write_text(PREP_KILLER)
    return [sys.executable, str(script), kill[0], str(kill[1]), *args]


def file_ids(directory: Path) -> dict[str, tuple[int, int]]:
    """shard file -> (inode, mtime_ns)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(directory.glob("shard-*.safetensors"))}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_killed_hidden_state_stage_resumes_without_recompute_duplicates_or_gaps(prepared, tmp_path):
    _, src, _ = prepared
    per_shard = ["data.sequences_per_shard=1"]
    # the uninterrupted reference and the killed run start from the same regenerated data
    for name in ("ref", "killed"):
        (tmp_path / name / "data").mkdir(parents=True)
        shutil.copy(src / "data" / "regen.jsonl", tmp_path / name / "data" / "regen.jsonl")
    ref, run = tmp_path / "ref", tmp_path / "killed"
    done = subprocess.run(prepare_cmd(prepared, ref, *per_shard), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = subprocess.run(prepare_cmd(prepared, run, *per_shard, kill=("shard", 4)), capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shards = run / "data" / "hidden_states"
    before = file_ids(shards)
    assert sorted(before) == [f"shard-{i:05d}.safetensors" for i in range(3)]  # the 4th died before its rename
    assert list(shards.glob(".shard-00003.safetensors.tmp-*"))  # its half-finished write
    assert [s["index"] for s in load_manifest(shards)["shards"]] == [0, 1, 2]

    rerun = subprocess.run(prepare_cmd(prepared, run, *per_shard), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    n = len(load_manifest(ref / "data" / "hidden_states")["shards"])
    assert f"hidden states: 3 of {n} shards already on disk (kept, not recomputed); computing {n - 3}" in rerun.stderr
    after = file_ids(shards)
    assert {k: after[k] for k in before} == before  # same inode and mtime: not rewritten
    assert not list(shards.glob(".*tmp*"))

    got, want = load_manifest(shards), load_manifest(ref / "data" / "hidden_states")
    ids = [i for s in got["shards"] for i in s["ids"]]
    assert len(ids) == len(set(ids)) and ids == [i for s in want["shards"] for i in s["ids"]]
    assert got["num_tokens"] == want["num_tokens"]
    for s, w in zip(got["shards"], want["shards"]):
        assert sha256(shards / s["file"]) == s["sha256"] == w["sha256"]  # valid and equal to the reference
    dataset = HiddenStateDataset(shards, verify=True)
    assert len(dataset) == len(ids) and sum(dataset.lengths()) == want["num_tokens"]


def test_killed_regeneration_keeps_finished_conversations(prepared, tmp_path):
    small_batches = ["data.regenerate.batch_size=2"]
    ref, run = tmp_path / "ref", tmp_path / "killed"
    stage = ["--stage", "target", "--stage", "regenerate"]
    done = subprocess.run(prepare_cmd(prepared, ref, *small_batches) + stage, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = subprocess.run(prepare_cmd(prepared, run, *small_batches, kill=("regenerate", 3)) + stage,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    cache = run / "data" / "regen.jsonl"
    kept = cache.read_text()
    assert len(kept.splitlines()) == 4  # two batches of two were flushed before the kill

    rerun = subprocess.run(prepare_cmd(prepared, run, *small_batches) + stage, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "regenerating 4 conversations (4 cached)" in rerun.stderr
    text = cache.read_text()
    assert text.startswith(kept)  # finished rows untouched, new ones appended
    rows = {json.loads(line)["id"]: json.loads(line) for line in text.splitlines()}
    want = {json.loads(line)["id"]: json.loads(line) for line in (ref / "data" / "regen.jsonl").read_text().splitlines()}
    assert len(text.splitlines()) == len(rows) == len(want)  # no duplicates
    assert rows == want  # same replies as the uninterrupted run (same batches, same seeds)


def test_torn_last_cache_line_is_dropped_and_regenerated(tmp_path):
    cache = tmp_path / "regen.jsonl"
    cache.write_text(json.dumps({"id": "a", "messages": [], "temperature": 0.0}) + "\n" + '{"id": "b", "mess')

    class Echo:
        def generate(self, conversations, temperatures, max_new_tokens):
            return ["reply"] * len(conversations)

    records = [{"id": i, "messages": [{"role": "user", "content": "hi"}]} for i in ("a", "b")]
    out = regenerate(records, cache, Echo, [0.0], 8, progress=False)
    assert [r["id"] for r in out] == ["a", "b"]
    lines = [json.loads(line) for line in cache.read_text().splitlines()]  # every line parses
    assert [r["id"] for r in lines] == ["a", "b"] and lines[1]["messages"][-1]["content"] == "reply"
