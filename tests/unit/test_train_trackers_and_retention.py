"""Checks of the training command line that need no run: a tracker that is not installed is an
error, and checkpoint retention never deletes the checkpoint just written."""

from __future__ import annotations

import pytest
from draftsmith.train.checkpoint import CheckpointManager, find_checkpoints


def test_a_tracker_that_is_not_installed_is_an_error(monkeypatch):
    import importlib.util

    from draftsmith.train.distributed import check_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"train.report_to names 'wandb'.*not installed.*draftsmith\[wandb\]"):
        check_trackers(["wandb"])
    check_trackers(["tensorboard"])  # installed: no error


class _OneProcess:
    is_main_process = True

    def wait_for_everyone(self):
        pass


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    for step in (3, 100, 200):  # an earlier run's checkpoints carry higher step numbers
        (ckpt_dir / f"step-{step}").mkdir(parents=True)
        (ckpt_dir / f"step-{step}" / "train_state.json").write_text("{}")
    manager = CheckpointManager(_OneProcess(), ckpt_dir, keep=2, extras=lambda d: None)
    removed = manager.apply_retention(ckpt_dir / "step-3")
    assert [p.name for p in removed] == ["step-100"]
    assert [p.name for p in find_checkpoints(ckpt_dir)] == ["step-3", "step-200"]
    manager = CheckpointManager(_OneProcess(), ckpt_dir, keep=1, extras=lambda d: None)
    manager.apply_retention(ckpt_dir / "step-3")
    assert [p.name for p in find_checkpoints(ckpt_dir)] == ["step-3"]
