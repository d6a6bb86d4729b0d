"""``draftsmith train R --resume`` with a recipe changed since the checkpoint, on the tiny target:
an applied key (train.lr) really trains at the new value; refused keys (draft.ttt_steps,
train.optimizer, another draft.method, aux layer ids re-prepared with ``prepare --overwrite-data``)
exit 2 with one line and leave every byte under checkpoints/ as it was; a truncated
``model.safetensors`` names the file and ``--resume-from`` the previous checkpoint works; a run that
wrote no checkpoint resumes from step 0. The commands run in-process (``draftsmith.cli.main``), as
``tests/unit/test_user_errors.py`` runs them; the classification itself: tests/unit/test_resume_changes.py."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from draftsmith.cli import main
from draftsmith.recipe import dump_recipe
from draftsmith.train.checkpoint import find_checkpoints
from helpers.faults import read_metrics

pytestmark = pytest.mark.integration

TRAIN = {"max_steps": 2, "batch_size": 2, "checkpoint_every": 1, "keep_checkpoints": 2, "log_every": 1,
         "warmup_ratio": 0.0, "lr": 0.003}


def cli(capsys, *argv: str) -> tuple[int, str]:
    """``(exit code, stderr)`` of ``draftsmith ARGV`` in-process."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def message(err: str) -> str:
    """The one line of a refusal: stderr's only ``error:`` line."""
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """``(recipe file, run dir)``: the tiny EAGLE-3 run trained 2 steps by ``draftsmith train``, a
    checkpoint at each step (step-1, step-2). Read only: each test resumes a copy."""
    recipe, prepared_run, _ = prepared
    root = tmp_path_factory.mktemp("resume_changes")
    run = root / "run"
    shutil.copytree(prepared_run / "data", run / "data")
    recipe = recipe.model_copy(deep=True)
    for k, v in TRAIN.items():
        setattr(recipe.train, k, v)
    path = root / "tiny.yaml"
    dump_recipe(recipe, path)
    assert main(["train", str(path), "--run-dir", str(run)]) == 0
    assert [c.name for c in find_checkpoints(run / "checkpoints")] == ["step-1", "step-2"]
    return path, run


@pytest.fixture
def resumable(trained, tmp_path):
    path, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return path, copy


def test_a_changed_lr_is_applied_with_one_note_and_really_trains(resumable, capsys, caplog):
    path, run = resumable
    with caplog.at_level(logging.INFO, logger="draftsmith.train"):
        code, err = cli(capsys, "train", path, "--run-dir", run, "--resume", "--set", "train.lr=0.1",
                        "--set", "train.max_steps=4")
    assert code == 0, err[-3000:]
    notes = [r.getMessage() for r in caplog.records if "train.lr" in r.getMessage()]
    assert notes == [("--resume: train.lr 0.003 -> 0.1 (changed since step-2): applied from step 2 on; the "
                      "checkpoints from now on record the new values")]
    # the optimizer really ran at the new lr: the logged lr of steps 3 and 4 is 0.1 on the new cosine
    cosine = {s: 0.5 * (1 + math.cos(math.pi * s / 4)) for s in (3, 4)}
    lrs = {m["step"]: m["lr"] for m in read_metrics(run) if "lr" in m}
    assert lrs[2] == pytest.approx(0.003 * 0.0, abs=1e-12)  # the end of the first run's 2-step cosine
    assert lrs[3] == pytest.approx(0.1 * cosine[3])
    last = find_checkpoints(run / "checkpoints")[-1]
    assert last.name == "step-4"
    assert yaml.safe_load((last / "recipe.yaml").read_text())["train"]["lr"] == 0.1
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["lr"] == 0.1
    optimizer = torch.load(last / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["initial_lr"] == 0.1
    assert torch.load(last / "scheduler.bin", weights_only=True)["base_lrs"] == [0.1]


@pytest.mark.parametrize("overrides, refused", [
    (["draft.ttt_steps=5"], "draft.ttt_steps 3 -> 5"),
    (["train.optimizer=muon", "train.lr=0.1"], "train.optimizer adamw -> muon"),
])
def test_a_refused_key_is_one_line_and_writes_nothing(resumable, capsys, overrides, refused):
    path, run = resumable
    before, metrics = digests(run / "checkpoints"), (run / "metrics.jsonl").read_bytes()
    sets = [a for o in overrides for a in ("--set", o)]
    code, err = cli(capsys, "train", path, "--run-dir", run, "--resume", *sets)
    ckpt = run / "checkpoints" / "step-2"
    assert code == 2
    assert message(err) == (f"draftsmith train: error: --resume: {ckpt} was trained with other values of keys a "
                            f"resumed run cannot change: {refused}; nothing was written: set them back (the "
                            f"checkpoint's recipe: {ckpt / 'recipe.yaml'}), start over with --overwrite, or train "
                            "into a fresh --run-dir")
    assert digests(run / "checkpoints") == before and (run / "metrics.jsonl").read_bytes() == metrics


def test_another_method_is_named_before_any_shape(resumable, capsys):
    path, run = resumable
    before = digests(run / "checkpoints")
    code, err = cli(capsys, "train", path, "--run-dir", run, "--resume",
                    "--set", "draft={method: dflash, num_layers: 1, block_size: 4, num_anchors: 8, freeze_lm_head: false}")
    ckpt = run / "checkpoints" / "step-2"
    assert code == 2
    assert message(err).startswith(f"draftsmith train: error: --resume: checkpoint step-2 was trained by eagle3, the "
                                   f"recipe asks for dflash ({ckpt}); nothing was written: ")
    assert "shape" not in err
    assert digests(run / "checkpoints") == before


def test_a_truncated_checkpoint_names_the_file_and_resume_from_the_previous_works(resumable, capsys):
    path, run = resumable
    weights = run / "checkpoints" / "step-2" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    before = digests(run / "checkpoints")
    code, err = cli(capsys, "train", path, "--run-dir", run, "--resume", "--set", "train.max_steps=3")
    assert code == 2
    line = message(err)
    assert line.startswith(f"draftsmith train: error: {weights}: truncated or corrupt (")
    assert line.endswith("cannot resume from step-2; resume from the previous checkpoint with --resume-from step-1 "
                         "(later ones are moved aside), or start over with --overwrite, or train into a fresh --run-dir")
    assert digests(run / "checkpoints") == before

    code, err = cli(capsys, "train", path, "--run-dir", run, "--resume-from", "step-1", "--set", "train.max_steps=3")
    assert code == 0, err[-3000:]
    assert [c.name for c in find_checkpoints(run / "checkpoints")] == ["step-2", "step-3"]
    assert (run / "checkpoints" / "abandoned-step-2" / "model.safetensors").read_bytes() == data[: len(data) - 1000]
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    code, err = cli(capsys, "train", path, "--run-dir", run, "--resume", "--set", "train.max_steps=4")
    assert code == 0, err[-3000:]  # a plain --resume follows the resumed run, not the abandoned checkpoint


def test_aux_ids_prepared_again_are_refused(resumable, capsys):
    path, run = resumable
    before = digests(run / "checkpoints")
    other = ["--set", "data.aux_layer_ids=[1, 2, 4]"]
    code, err = cli(capsys, "prepare", path, "--run-dir", run, "--overwrite-data", *other)
    assert code == 0, err[-3000:]
    assert json.loads((run / "data" / "target.json").read_text())["aux_layer_ids"] == [1, 2, 4]
    code, err = cli(capsys, "train", path, "--run-dir", run, "--resume", *other)
    ckpt = run / "checkpoints" / "step-2"
    assert code == 2
    assert message(err).startswith(f"draftsmith train: error: --resume: {ckpt} was trained with other values of keys "
                                   "a resumed run cannot change: data.aux_layer_ids [1, 3, 4] -> [1, 2, 4]; ")
    assert digests(run / "checkpoints") == before


def test_a_run_that_wrote_no_checkpoint_resumes_from_step_0(resumable, capsys, caplog):
    """What an all-skipped run leaves (metrics.jsonl, no checkpoint): a plain rerun says to pass
    --resume, and --resume trains from step 0 with one warning."""
    path, run = resumable
    shutil.rmtree(run / "checkpoints")
    code, err = cli(capsys, "train", path, "--run-dir", run)
    assert code == 2
    assert message(err) == (f"draftsmith train: error: {run} already holds a training run that wrote no checkpoint "
                            "(metrics.jsonl): pass --resume to train it from step 0 (its metrics.jsonl lines are "
                            "dropped), --overwrite to remove its output first (data/ is kept), or choose another "
                            "--run-dir")
    with caplog.at_level(logging.WARNING, logger="draftsmith.train"):
        code, err = cli(capsys, "train", path, "--run-dir", run, "--resume")
    assert code == 0, err[-3000:]
    assert [r.getMessage() for r in caplog.records if "nothing to resume" in r.getMessage()] == [
        (f"--resume: nothing to resume: {run / 'checkpoints'} holds no checkpoint (the earlier run wrote none); "
         "training from step 0, the 2 lines of its metrics.jsonl are dropped")]
    assert [c.name for c in find_checkpoints(run / "checkpoints")] == ["step-1", "step-2"]
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
