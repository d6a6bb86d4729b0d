"""prepare checks the free disk space before the hidden-state capture and keeps the stages it
already finished."""

from __future__ import annotations

import pytest
from draftsmith.layout import RunLayout


@pytest.mark.integration  # runs the tiny target's data stages
def test_prepare_checks_free_space_before_capture_and_keeps_the_earlier_stages(tiny_target, tmp_path, monkeypatch):
    import collections

    from draftsmith import fileio
    from draftsmith.data_prep.prepare import prepare
    from draftsmith.fileio import DiskFullError

    from helpers.recipes import small_recipe

    recipe = small_recipe(tiny_target, tmp_path)
    run = tmp_path / "run"
    real = fileio.shutil.disk_usage
    monkeypatch.setattr(fileio.shutil, "disk_usage",
                        lambda p: collections.namedtuple("U", "total used free")(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DiskFullError) as exc:
        prepare(recipe, run)
    msg = str(exc.value)
    assert "\n" not in msg and "hidden-state shards" in msg and "1000 free" in msg and str(run / "data") in msg
    paths = RunLayout(run).data
    assert paths.tokenized_done.is_file() and paths.vocab.is_file()  # the finished stages are kept
    assert not list(paths.hidden_states.glob("shard-*"))  # nothing was captured
    monkeypatch.setattr(fileio.shutil, "disk_usage", real)
    assert prepare(recipe, run, ["hidden-states"])["hidden_states"]["tokens"] > 0  # the rerun resumes there
