"""A real run keeps secrets out: no token from the environment or the command line reaches the
run directory or the logs, and shard manifests cannot name files outside their directory."""

from __future__ import annotations
import json
import logging
import shutil

import pytest

from draftsmith.fileio import ShardError
from draftsmith.train.data import HiddenStateDataset
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.run_info import REDACTED
from draftsmith.train.trainer import fit

from helpers.fake_inputs import FAKE

ARGV_SECRET = "FAKEargvsecret00000000000005"


@pytest.mark.integration
def test_tokens_never_reach_the_run_directory_or_logs(prepared, tmp_path, monkeypatch, caplog, capfd):
    recipe, src, _ = prepared
    for k, v in FAKE.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    shutil.copytree(src / "data", run / "data")
    recipe = recipe.model_copy(deep=True)
    recipe.train.max_steps = 2
    recipe.train.checkpoint_every = 1
    argv = ["train/eagle3.py", "recipe.yaml", "--run-dir", str(run), "--hf-token", ARGV_SECRET,
            "--set", f"hub.token={FAKE['HF_TOKEN']}", f"--note={FAKE['WANDB_API_KEY']}"]
    with caplog.at_level(logging.DEBUG):
        fit(recipe, Eagle3Method(recipe, run), run, argv=argv, progress=True)
    secrets = [*FAKE.values(), ARGV_SECRET]
    leaks = [(str(p.relative_to(run)), s) for p in run.rglob("*") if p.is_file()
             for s in secrets if s.encode() in p.read_bytes()]
    assert not leaks
    out, err = capfd.readouterr()
    for s in secrets:
        assert s not in caplog.text and s not in out and s not in err
    meta = json.loads((run / "run_meta.json").read_text())
    assert meta["argv"][5] == REDACTED and "env" not in meta  # recorded, but redacted


@pytest.mark.integration
def test_manifest_file_names_cannot_leave_the_shard_directory(prepared, tmp_path):
    _, src, _ = prepared
    shards = tmp_path / "hidden_states"
    shutil.copytree(src / "data" / "hidden_states", shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["shards"][0]["file"] = "../../" + manifest["shards"][0]["file"]
    (shards / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="shard 0 file.*escapes"):
        HiddenStateDataset(shards)
