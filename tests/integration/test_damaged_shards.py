"""Damaged hidden-state shards are found where users look.

- ``draftsmith prepare`` checks the shards it keeps (size and safetensors header against the
  manifest, the check training opens them with; ``--verify-shards``: their sha256 too) and
  recomputes a bad one, one log line naming it; the others are kept as they were.
- Training refuses a truncated shard naming it and the command that recomputes it.
- Non-finite hidden states: the trainer names the shard, the sequence and its record id, once per
  shard (a warning, and ``nonfinite_shards`` in ``train_state.json``), counting on the device;
  a run whose every step was skipped stops non-zero naming the first bad shard, even when it is
  shorter than one logging window, and writes no checkpoint of zero updates.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from draftsmith.cli.prepare import main as prepare_main
from draftsmith.data_prep.shards import load_manifest, read_safetensors_header, verify_shards
from draftsmith.recipe import dump_recipe
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.cli.train import launch
from draftsmith.models.eagle3.training import Eagle3Method

pytestmark = pytest.mark.integration  # runs the prepare command and trains the tiny target

SHARD = "shard-00001.safetensors"


@pytest.fixture()
def run(prepared, tmp_path) -> tuple[Path, Path]:
    """``(recipe file, run dir)``: a copy of the prepared tiny run's data."""
    recipe, src, _ = prepared
    shutil.copytree(src / "data", tmp_path / "run" / "data")
    path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, path)
    return path, tmp_path / "run"


def shards(run: Path) -> Path:
    return run / "data" / "hidden_states"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def poison_first_sequence(path: Path, key: str = "aux_hidden_states") -> None:
    """NaN (bf16 0xFFFF) over the start of the first ``key`` row (aux or final states) of the shard's
    first sequence; the size is kept."""
    tensors, start = read_safetensors_header(path)
    a, _ = tensors[key]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + a: start + a + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


def kept(run: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards(run).glob("shard-*.safetensors")}


def recomputed_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "recomputing it" in r.getMessage()]


def test_a_truncated_shard_is_recomputed_by_prepare(run, caplog):
    recipe, run = run
    bad = shards(run) / SHARD
    want, size = sha256(bad), bad.stat().st_size
    with bad.open("r+b") as fh:
        fh.truncate(size - 100)
    before = {k: v for k, v in kept(run).items() if k != SHARD}
    caplog.set_level(logging.INFO)
    code = prepare_main([str(recipe), "--run-dir", str(run), "--stage", "hidden-states"])
    assert code == 0
    assert recomputed_lines(caplog) == [f"hidden states: {bad}: size {size - 100} bytes, manifest says {size} "
                                        "(truncated or corrupt shard): recomputing it"]
    assert any("2 of 3 shards already on disk (kept, not recomputed); computing 1" in r.getMessage()
               for r in caplog.records)
    assert sha256(bad) == want  # recomputed to the same bytes
    assert {k: v for k, v in kept(run).items() if k != SHARD} == before  # the others untouched
    result = verify_shards(shards(run), progress=False)
    assert not result["bad"] and not result["problems"], result


def test_a_shard_damaged_in_place_is_recomputed_with_verify_shards(run, caplog):
    recipe, run = run
    bad = shards(run) / SHARD
    want = sha256(bad)
    poison_first_sequence(bad)
    caplog.set_level(logging.INFO)
    assert prepare_main([str(recipe), "--run-dir", str(run), "--stage", "hidden-states"]) == 0
    assert not recomputed_lines(caplog)  # same size, same header: kept by the default check
    caplog.clear()
    assert prepare_main([str(recipe), "--run-dir", str(run), "--stage", "hidden-states",
                                "--verify-shards"]) == 0
    assert recomputed_lines(caplog) == [f"hidden states: {bad}: checksum mismatch (corrupt or truncated shard): "
                                        "recomputing it"]
    assert sha256(bad) == want


def test_training_refuses_a_truncated_shard_naming_it_and_the_fix(run, capsys):
    recipe, run = run
    bad = shards(run) / SHARD
    with bad.open("r+b") as fh:
        fh.truncate(bad.stat().st_size - 100)
    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[str(recipe), "--run-dir", str(run)])
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 1 and len(err) == 1, err
    assert f"{bad}: size " in err[0] and "(truncated or corrupt shard)" in err[0], err
    assert f"recompute it with: draftsmith prepare RECIPE --run-dir {run}" in err[0], err


def test_nonfinite_states_name_the_shard_once_per_shard(run, caplog):
    recipe, run = run
    poison_first_sequence(shards(run) / SHARD)
    first_id = load_manifest(shards(run))["shards"][1]["ids"][0]
    caplog.set_level(logging.INFO)
    # batches of 2 of the 8 sequences: the poisoned one is in one batch per epoch (skipped), the others train
    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[
        str(recipe), "--run-dir", str(run), "--set", "train.max_steps=8", "--set", "train.batch_size=2",
        "--set", "train.log_every=1"])
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if "non-finite hidden states in" in r.getMessage()]
    where = f"{shards(run) / SHARD} (sequence 0 of the shard, id {first_id!r})"
    assert len(warnings) == 1 and warnings[0].startswith(f"non-finite hidden states in {where}: "), warnings
    assert "--verify-shards" in warnings[0]
    state = json.loads((find_checkpoints(run / "checkpoints")[-1] / "train_state.json").read_text())
    assert state["nonfinite_skipped"] == 2 and state["nonfinite_shards"] == {SHARD: where}, state


def test_nonfinite_final_states_alone_name_the_shard(run, caplog):
    """Finite aux states, a NaN in the FINAL hidden states (what the teacher logits are read from):
    the shard is named as when its aux states are bad."""
    recipe, run = run
    bad = shards(run) / SHARD
    poison_first_sequence(bad, "final_hidden_states")
    from safetensors.torch import load_file

    tensors = load_file(bad)
    assert tensors["aux_hidden_states"].isfinite().all() and not tensors["final_hidden_states"].isfinite().all()
    first_id = load_manifest(shards(run))["shards"][1]["ids"][0]
    caplog.set_level(logging.INFO)
    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[
        str(recipe), "--run-dir", str(run), "--set", "train.max_steps=4", "--set", "train.batch_size=2",
        "--set", "train.log_every=1"])
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if "non-finite hidden states in" in r.getMessage()]
    where = f"{bad} (sequence 0 of the shard, id {first_id!r})"
    assert len(warnings) == 1 and warnings[0].startswith(f"non-finite hidden states in {where}: "), warnings
    state = json.loads((find_checkpoints(run / "checkpoints")[-1] / "train_state.json").read_text())
    assert state["nonfinite_shards"] == {SHARD: where}, state


def test_a_run_of_only_skipped_steps_stops_naming_the_shard_and_saves_nothing(run, capsys, caplog):
    recipe, run = run
    poison_first_sequence(shards(run) / SHARD)
    first_id = load_manifest(shards(run))["shards"][1]["ids"][0]
    caplog.set_level(logging.INFO)
    # every batch holds every sequence; 3 steps, shorter than one logging window and than max_nonfinite_steps
    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[
        str(recipe), "--run-dir", str(run), "--set", "train.max_steps=3", "--set", "train.log_every=10",
        "--set", "train.checkpoint_every=2"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("train/eagle3.py: error: all 3 optimizer steps were skipped (non-finite loss or "
                             "gradient), so no checkpoint was written; first shard with non-finite hidden states: "
                             f"{shards(run) / SHARD} (sequence 0 of the shard, id {first_id!r}); recompute it with: "
                             f"draftsmith prepare RECIPE --run-dir {run} --verify-shards"), err
    assert not find_checkpoints(run / "checkpoints")  # not the final one, not the one at step 2
    warnings = [r.getMessage() for r in caplog.records if "non-finite hidden states in" in r.getMessage()]
    assert len(warnings) == 1, warnings
