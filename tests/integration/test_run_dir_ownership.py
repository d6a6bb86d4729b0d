"""A run directory is owned, its data fingerprinted by content, and every check the dry run makes
is made by the real run before anything is written (issue 49, items 1, 2 and 5).

- One writer at a time: a second ``prepare`` / ``train`` on a run directory whose lock a live
  process holds is refused with one line naming that process (exit 2); a lock left by a killed
  process is taken over with one warning.
- ``--overwrite-data`` deletes only what draftsmith wrote: a recipe source kept in ``data/`` or any
  other foreign file stops it before a byte is deleted; ``--dry-run`` lists what it would delete.
- A source edited in place (same path, other bytes) is refused before anything is written; the
  same file named by a relative and an absolute path is the same source.
- ``data.max_length`` / ``draft.sliding_window`` beyond the target's context, an XPress draft vocab
  below the target's, a target folder without weights and a truncated target ``config.json`` stop
  ``prepare`` before its first write.

Every refusal leaves every byte of the run directory (and the user's source) as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.cli.prepare import main as prepare_main
from draftsmith.cli.train import launch
from draftsmith.data_prep.agreement import disagreements
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.recipe import dump_recipe
from draftsmith.run_lock import lock_path, read_lock

from helpers import REPO
from helpers.recipes import PROMPTS
from helpers.tiny import TINY_AUX, write_jsonl


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (the lock file, which commands hold while they run, aside)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".draftsmith.lock"}


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


@pytest.fixture()
def run(prepared, tmp_path) -> Path:
    """A copy of the prepared tiny EAGLE-3 run's data."""
    _, src, _ = prepared
    shutil.copytree(src / "data", tmp_path / "run" / "data")
    return tmp_path / "run"


def recipe_file(prepared, tmp_path: Path, name: str = "r.yaml", **data) -> Path:
    recipe = prepared[0].model_copy(deep=True)
    for key, value in data.items():
        setattr(recipe.data, key, value)
    dump_recipe(recipe, tmp_path / name)
    return tmp_path / name


def hold_lock(run: Path) -> subprocess.Popen:
    """A second process that takes ``run``'s lock as ``draftsmith train`` would and keeps it."""
    code = (f"import time; from draftsmith.run_lock import acquire; "
            f"acquire({str(run)!r}, 'draftsmith train other.yaml --run-dir {run}'); print('held', flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# -- 1. the lock ------------------------------------------------------------------------------------


def test_a_live_lock_refuses_prepare_and_train_naming_the_holder_and_a_dead_one_is_taken_over(
        prepared, run, tmp_path, capsys, caplog):
    recipe = recipe_file(prepared, tmp_path)
    before = snapshot(run)
    holder = hold_lock(run)
    try:
        code = prepare_main([str(recipe), "--run-dir", str(run), "--overwrite-data", "--stage", "target"])
        err = capsys.readouterr().err
        assert code == 2
        [line] = error_lines(err)
        assert line.startswith(f"error: {run} is in use by pid {holder.pid} on host ") and \
            f"(draftsmith train other.yaml --run-dir {run})" in line, line
        assert snapshot(run) == before  # --overwrite-data deleted nothing under the holder
        code = launch([str(recipe), "--run-dir", str(run), "--no-prepare"], method=Eagle3Method,
                      script="train/eagle3.py", doc="")
        [line] = error_lines(capsys.readouterr().err)
        assert code == 2 and f"train/eagle3.py: error: {run} is in use by pid {holder.pid}" in line, line
        assert snapshot(run) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert read_lock(run)["pid"] == holder.pid  # SIGKILL left the lock behind
    caplog.set_level("WARNING")
    code = prepare_main([str(recipe), "--run-dir", str(run), "--stage", "vocab"])
    assert code == 0, capsys.readouterr().err
    assert f"taking over the lock of pid {holder.pid}" in caplog.text and "which is no longer running" in caplog.text
    assert not lock_path(run).exists()  # released when prepare ended


def test_the_lock_is_reentrant_and_covers_the_processes_its_holder_starts(tmp_path):
    from draftsmith.run_lock import acquire, release

    assert acquire(tmp_path, "outer") and acquire(tmp_path, "inner")
    child = subprocess.run([sys.executable, "-c", (
        f"from draftsmith.run_lock import acquire; "
        f"print(acquire({str(tmp_path)!r}, 'child'))")], capture_output=True, text=True, env=os.environ.copy())
    assert child.stdout.strip() == "False", child.stderr  # covered by the parent: proceeds, takes nothing
    release(tmp_path)
    assert lock_path(tmp_path).exists()  # the outer holder still has it
    release(tmp_path)
    assert not lock_path(tmp_path).exists()


# -- 1. --overwrite-data deletes only what draftsmith wrote ------------------------------------------


def test_overwrite_data_refuses_a_recipe_source_kept_in_data_and_deletes_nothing(prepared, run, tmp_path, capsys):
    source = write_jsonl(run / "data" / "mychats.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = prepared[0].model_copy(deep=True)
    recipe.data.sources[0].path = str(source)
    dump_recipe(recipe, tmp_path / "r.yaml")
    before = snapshot(run)
    code = prepare_main([str(tmp_path / "r.yaml"), "--run-dir", str(run), "--overwrite-data"])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1
    assert line == (f"error: --overwrite-data: {source.resolve()} is a source of this recipe and lies inside "
                    f"{run / 'data'}, which --overwrite-data starts over; nothing was deleted: keep the recipe's "
                    "sources outside the run directory"), line
    assert snapshot(run) == before


def test_overwrite_data_refuses_files_it_did_not_write_and_the_dry_run_says_what_it_would_delete(
        prepared, run, tmp_path, capsys):
    recipe = recipe_file(prepared, tmp_path)
    code = prepare_main([str(recipe), "--run-dir", str(run), "--overwrite-data", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    [line] = [x for x in out.splitlines() if x.startswith("--overwrite-data would delete")]
    assert line.startswith("--overwrite-data would delete 9 entries (") and f"draftsmith wrote under {run / 'data'}: " \
        "hidden_states/, plan.json, regen.jsonl, spec.json, stats.json, summary.json, target.json, tokenized/, " \
        "vocab.safetensors" in line, line
    notes = run / "data" / "notes.txt"
    notes.write_text("mine")
    before = snapshot(run)
    code = prepare_main([str(recipe), "--run-dir", str(run), "--overwrite-data"])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1 and line == (f"error: --overwrite-data: {run / 'data'} holds files draftsmith did not write "
                                  f"({notes}); nothing was deleted: move them out of {run / 'data'}, or use a "
                                  "fresh --run-dir"), line
    assert snapshot(run) == before
    code = prepare_main([str(recipe), "--run-dir", str(run), "--overwrite-data", "--dry-run"])
    assert code == 0 and f"the real run refuses: --overwrite-data: {run / 'data'} holds files" in capsys.readouterr().out
    notes.unlink()
    code = prepare_main([str(recipe), "--run-dir", str(run), "--overwrite-data", "--stage", "target"])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in (run / "data").iterdir() if not p.name.startswith(".")) == \
        ["plan.json", "procs", "spec.json", "summary.json", "target.json"]


# -- 2. data fingerprinted by content ---------------------------------------------------------------


def test_a_source_edited_in_place_is_refused_before_anything_is_written(prepared, tmp_path, capsys):
    recipe, run = prepared[0], tmp_path / "mine"
    source = tmp_path / "chats.jsonl"
    shutil.copy(recipe.data.sources[0].path, source)
    mine = recipe.model_copy(deep=True)
    mine.data.sources[0].path = str(source)
    dump_recipe(mine, tmp_path / "r.yaml")
    assert prepare_main([str(tmp_path / "r.yaml"), "--run-dir", str(run), "--stage", "target", "--stage", "tokenize"]) == 0
    spec = json.loads((run / "data" / "spec.json").read_text())
    [fp] = spec["tokenize"]["data.sources.content"]
    assert fp["path"] == str(source.resolve()) and fp["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    capsys.readouterr()

    # the same file by a relative path: the same source
    rel = mine.model_copy(deep=True)
    rel.data.sources[0].path = os.path.relpath(source)
    assert disagreements(rel, run, ["tokenize"]) == []

    with source.open("a") as fh:  # 8 rows -> 9, same path
        fh.write(json.dumps({"id": "p99", "prompt": "One more question?"}) + "\n")
    before, source_bytes = snapshot(run), source.read_bytes()
    code = prepare_main([str(tmp_path / "r.yaml"), "--run-dir", str(run)])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1
    assert line.startswith(f"error: {source.resolve()} changed since {run / 'data'} was tokenised from it (size ")
    assert "sha256 " in line and f"nothing was written: use a fresh --run-dir, or start this one's data over with: " \
        f"draftsmith prepare {tmp_path / 'r.yaml'} --run-dir {run} --overwrite-data" in line, line
    code = launch([str(tmp_path / "r.yaml"), "--run-dir", str(run)], method=Eagle3Method, script="train/eagle3.py",
                  doc="")
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1 and f"{source.resolve()} changed since" in line, line
    assert snapshot(run) == before and source.read_bytes() == source_bytes
    code = prepare_main([str(tmp_path / "r.yaml"), "--run-dir", str(run), "--dry-run"])
    assert code == 0 and f"the real run refuses: {source.resolve()} changed since" in capsys.readouterr().out
    from draftsmith.cli.train import main as train_main

    code = train_main([str(tmp_path / "r.yaml"), "--run-dir", str(run), "--dry-run"])
    assert code == 0 and f"the real run refuses: {source.resolve()} changed since" in capsys.readouterr().out
    assert snapshot(run) == before


def test_a_touched_but_unchanged_source_is_not_refused(prepared, run, tmp_path):
    recipe = prepared[0].model_copy(deep=True)
    source = Path(recipe.data.sources[0].path)
    data = source.read_bytes()
    source.write_bytes(data)  # new mtime, same bytes
    assert disagreements(recipe, run, ["tokenize"]) == []


# -- 5. what the dry run checks, the real run checks first -------------------------------------------


@pytest.mark.parametrize("sets, message", [
    (["data.max_length=1000000000"], "data.max_length=1000000000 exceeds the target's max_position_embeddings="),
    (["draft.sliding_window=1048576"], "draft.sliding_window 1048576 is larger than the target's context (1024 tokens"),
])
def test_lengths_beyond_the_targets_context_stop_prepare_before_its_first_write(prepared, tmp_path, capsys, sets,
                                                                                message):
    recipe = recipe_file(prepared, tmp_path)
    run = tmp_path / "fresh"
    code = prepare_main([str(recipe), "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1 and message in line, line
    assert snapshot(run) == {}  # nothing written (the lock came and went)


def test_an_xpress_draft_vocab_below_the_targets_is_refused_by_dry_run_prepare_and_train(tiny_target, tmp_path,
                                                                                         capsys):
    from draftsmith.cli.train import main as train_main
    from helpers.recipes import write_prompts

    recipe = REPO / "recipes" / "smollm2_135m_xpress.yaml"
    sets = ["--set", f"target.name_or_path={tiny_target}", "--set", "data.draft_vocab_size=100",
            "--set", f"data.aux_layer_ids={list(TINY_AUX)}",
            "--set", f"data.sources=[{{path: {write_prompts(tmp_path / 'p.jsonl')}}}]"]
    want = "data.draft_vocab_size=100: XPress drafts over the full target vocab (512;"
    code = train_main([str(recipe), "--dry-run", *sets])
    assert code == 1 and want in error_lines(capsys.readouterr().err)[0]
    run = tmp_path / "x"
    code = prepare_main([str(recipe), "--run-dir", str(run), *sets])
    assert code == 1 and want in error_lines(capsys.readouterr().err)[0]
    code = train_main([str(recipe), "--run-dir", str(run), *sets])
    assert code == 1 and want in error_lines(capsys.readouterr().err)[0]
    assert snapshot(run) == {}


def test_a_target_without_weights_or_with_a_truncated_config_stops_prepare_in_one_line(prepared, tiny_target,
                                                                                       tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_target.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, bare / f.name)
    recipe = recipe_file(prepared, tmp_path)
    run = tmp_path / "fresh"
    code = prepare_main([str(recipe), "--run-dir", str(run), "--set", f"target.name_or_path={bare}"])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1 and line == (f"error: target {bare}: a config.json but no weights (no *.safetensors, "
                                  "pytorch_model*.bin or *.gguf); copy the model's weight files into it, or name the "
                                  "complete model folder"), line
    shutil.copy(next(tiny_target.glob("*.safetensors")), bare)
    (bare / "config.json").write_text((tiny_target / "config.json").read_text()[:40])
    code = prepare_main([str(recipe), "--run-dir", str(run), "--set", f"target.name_or_path={bare}"])
    [line] = error_lines(capsys.readouterr().err)
    assert code == 1 and line.startswith(f"error: {bare / 'config.json'}: not a readable config.json ("), line
    assert snapshot(run) == {}


def test_a_non_utf8_row_names_the_file_and_row_and_is_skipped_unless_strict(prepared, tmp_path):
    from draftsmith.data_prep.conversations import DataError, load_records

    source = tmp_path / "mixed.jsonl"
    source.write_bytes(b'{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": "caf\xe9"}\n{"id": "c", "prompt": "ok"}\n')
    records, report = load_records(str(source))
    assert [r["id"] for r in records] == ["a", "c"] and "not UTF-8" in report.summary()
    with pytest.raises(DataError, match=rf"^{source}:2: not UTF-8 \(byte 0xe9 at column 27\); save the file as UTF-8$"):
        load_records(str(source), strict=True)


def test_an_export_into_its_run_directory_is_one_of_the_runs_writers(tmp_path):
    from draftsmith.cli.export import run_of

    ckpt = tmp_path / "run" / "checkpoints" / "step-4"
    ckpt.mkdir(parents=True)
    assert run_of(ckpt, tmp_path / "run" / "export" / "eagle3") == (tmp_path / "run").resolve()
    assert run_of(ckpt, tmp_path / "elsewhere") is None
    assert run_of(tmp_path / "loose_ckpt", tmp_path / "loose_ckpt" / "out") is None
