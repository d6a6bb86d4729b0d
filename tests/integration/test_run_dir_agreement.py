"""A run directory agrees with its recipe or nothing happens (data_prep/agreement.py).

A recipe whose data keys differ from those the run directory was prepared with (other aux layer
ids, max length, storage dtype, draft vocab size ...) stops ``draftsmith train`` (its automatic
prepare included) and ``draftsmith prepare`` with one line naming the key, both values and the
two ways out, before a byte is written: every file of the run directory keeps its bytes and its
mtime. Training takes the aux layer ids from the shard manifest (what was captured), so the
export writes those, whatever the checkpoint's ``recipe.yaml`` says; a checkpoint whose config
names other layers than its run's shards (trained before this check) is refused by export.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from draftsmith.cli.prepare import main as prepare_main
from draftsmith.data_prep.agreement import RunDirMismatchError
from draftsmith.eval.export import export
from draftsmith.layout import ExportError
from draftsmith.recipe import dump_recipe
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.cli.train import launch
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit

pytestmark = pytest.mark.integration  # trains the tiny target and runs the prepare command

CAPTURED, OTHER = [1, 3, 4], [1, 2, 4]


def snapshot(run: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``run``: its sha256 and mtime (ns)."""
    return {p.relative_to(run).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture()
def run(prepared, tmp_path) -> Path:
    """A copy of the prepared tiny run's data (EAGLE-3, aux layers [1, 3, 4])."""
    _, src, _ = prepared
    shutil.copytree(src / "data", tmp_path / "run" / "data")
    return tmp_path / "run"


def other_recipe(prepared, tmp_path: Path, **data) -> Path:
    recipe = prepared[0].model_copy(deep=True)
    for key, value in data.items():
        setattr(recipe.data, key, value)
    path = tmp_path / "other.yaml"
    dump_recipe(recipe, path)
    return path


def assert_one_line(err: str, *parts: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], lines[0]


def test_other_aux_layer_ids_stop_train_and_prepare_without_writing_a_byte(prepared, run, tmp_path, capsys):
    assert json.loads((run / "data" / "hidden_states" / "manifest.json").read_text())["aux_layer_ids"] == CAPTURED
    other = other_recipe(prepared, tmp_path, aux_layer_ids=OTHER)
    before = snapshot(run)
    message = (f"{run / 'data'} was prepared with data.aux_layer_ids={CAPTURED} "
               f"({run / 'data' / 'hidden_states' / 'manifest.json'}), the recipe has {OTHER}")
    fix = (f"use a fresh --run-dir, or start this one's data over with: draftsmith prepare {other} --run-dir {run} "
           "--overwrite-data")

    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[str(other), "--run-dir", str(run)])
    assert code == 1
    assert_one_line(capsys.readouterr().err, "train/eagle3.py: error: ", message, fix)

    code = prepare_main([str(other), "--run-dir", str(run)])
    assert code == 1
    assert_one_line(capsys.readouterr().err, "error: ", message, fix)
    assert snapshot(run) == before  # target.json, tokenized/, vocab, shards, spec: same bytes, same mtimes

    # training's automatic prepare of missing shards is refused as well (on target.json's layers)
    shutil.rmtree(run / "data" / "hidden_states")
    before = snapshot(run)
    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[str(other), "--run-dir", str(run)])
    assert code == 1
    assert_one_line(capsys.readouterr().err, f"data.aux_layer_ids={CAPTURED} ({run / 'data' / 'target.json'}), "
                                             f"the recipe has {OTHER}", "--overwrite-data")
    assert snapshot(run) == before and not (run / "data" / "hidden_states").exists()


@pytest.mark.parametrize("key, value, recorded, where", [
    ("max_length", 64, "96", "spec.json"),
    ("hidden_states_dtype", "float32", '"bfloat16"', "hidden_states/manifest.json"),
    ("draft_vocab_size", 100, "128", "vocab.safetensors"),
])
def test_other_data_keys_stop_training_naming_key_values_and_file(prepared, run, tmp_path, capsys, key, value,
                                                                  recorded, where):
    other = other_recipe(prepared, tmp_path, **{key: value})
    before = snapshot(run)
    code = launch(method=Eagle3Method, script="train/eagle3.py", doc="", argv=[str(other), "--run-dir", str(run)])
    assert code == 1
    shown = json.dumps(value) if isinstance(value, str) else str(value)
    assert_one_line(capsys.readouterr().err, f"data.{key}={recorded} ({run / 'data' / where}), the recipe has {shown}",
                    "--overwrite-data")
    assert snapshot(run) == before


def test_overwrite_data_prepares_the_run_directory_afresh(prepared, run, tmp_path, capsys):
    other = other_recipe(prepared, tmp_path, aux_layer_ids=OTHER)
    code = prepare_main([str(other), "--run-dir", str(run), "--overwrite-data", "--stage", "target"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((run / "data" / "target.json").read_text())["aux_layer_ids"] == OTHER
    assert not (run / "data" / "hidden_states").exists() and not (run / "data" / "vocab.safetensors").exists()


def test_the_draft_is_trained_and_exported_with_the_captured_layers(prepared, run, tmp_path):
    recipe = prepared[0].model_copy(deep=True)
    recipe.train.max_steps = 2
    # target.json rewritten with other layers (what a refused prepare used to leave behind)
    target = run / "data" / "target.json"
    target.write_text(json.dumps({**json.loads(target.read_text()), "aux_layer_ids": OTHER}))
    other = recipe.model_copy(deep=True)
    other.data.aux_layer_ids = OTHER
    with pytest.raises(RunDirMismatchError, match=re.escape(f"data.aux_layer_ids={CAPTURED} ") + ".*"
                       + re.escape(f"the recipe has {OTHER}")):
        Eagle3Method(other, run)  # the method checks too (fit() callers skip train's check)
    method = Eagle3Method(recipe, run)
    assert method.target_info.aux_layer_ids == CAPTURED and method.config.aux_layer_ids == CAPTURED
    fit(recipe, method, run, progress=False)
    ckpt = find_checkpoints(run / "checkpoints")[-1]
    assert json.loads((ckpt / "draft_config.json").read_text())["config"]["aux_layer_ids"] == CAPTURED

    # the checkpoint's recipe.yaml is not where export reads the layers
    saved = yaml.safe_load((ckpt / "recipe.yaml").read_text())
    saved["data"]["aux_layer_ids"] = OTHER
    (ckpt / "recipe.yaml").write_text(yaml.safe_dump(saved))
    out = export(ckpt, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == CAPTURED

    # a checkpoint whose config names other layers than its run captured (trained before the check) is refused
    config = json.loads((ckpt / "draft_config.json").read_text())
    config["config"]["aux_layer_ids"] = OTHER
    (ckpt / "draft_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"aux layer ids \[1, 2, 4\], but the run's hidden states were captured at "
                                          r"\[1, 3, 4\]"):
        export(ckpt, tmp_path / "export2")
    assert not (tmp_path / "export2").exists()
