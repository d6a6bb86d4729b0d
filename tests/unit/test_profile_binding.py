"""A speculation profile is bound to the weights it measured: ``speculation_profile.json``
records the sha256 of the export's ``model.safetensors`` and the method; ``draftsmith export``
removes a profile of other weights from its output folder (one logged line), and ``draftsmith
hub`` refuses to publish one (exit 1, one line), leaving every other file's bytes as they were.
The exports are real (tests/helpers/method_exports.py: tiny random drafts, no training)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from draftsmith.cli import export as export_cli
from draftsmith.cli import hub as hub_cli
from draftsmith.eval import profile
from draftsmith.eval.profile import ProfileError, build_profile, read_profile, write_profile

from helpers.method_exports import build_export

COUNTERS = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 10, "per_pos": [6, 3, 1]}
REPO = "alice/tiny-draft"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def measured(draft: Path, method: str = "eagle3") -> profile.SpeculationProfile:
    """The profile ``draftsmith acceptance`` writes for a measurement of ``draft`` by ``method``."""
    result = {"method": method, "num_speculative_tokens": 3, "temperature": 0.0, "prompts": "builtin:eval",
              "num_prompts": 4, "counters": COUNTERS}
    return build_profile(result, "tiny-target", draft)


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err.strip()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Two EAGLE-3 checkpoints of different weights (seeds 0 and 1), and the export of the first."""
    root = tmp_path_factory.mktemp("binding")
    for name, method, seed in (("a", "eagle3", 0), ("b", "eagle3", 1)):
        build_export(method, root / name, seed=seed)
    return {"a": root / "a" / "ckpt", "b": root / "b" / "ckpt", "export_a": root / "a" / "export"}


@pytest.fixture()
def export_a(built, tmp_path) -> Path:
    """A fresh copy of checkpoint a's export (float32), with a user's own file beside it."""
    out = tmp_path / "export"
    shutil.copytree(built["export_a"], out)
    (out / "NOTES.md").write_text("my notes on this draft\n")
    return out


# ------------------------------------------------------------------------------------------
# the profile records what it measured


def test_the_profile_records_the_weights_sha256_and_the_method(export_a):
    prof = measured(export_a)
    assert prof.method == "eagle3"
    assert prof.draft_checkpoint == {"name_or_path": f"{export_a.parent.name}/export", "method": "eagle3",
                                     "weights_file": "model.safetensors",
                                     "weights_sha256": sha256(export_a / "model.safetensors")}
    path = write_profile(export_a, prof)
    assert read_profile(path) == prof
    assert json.loads(path.read_text())["draft_checkpoint"]["weights_sha256"] == sha256(export_a / "model.safetensors")


def test_the_hash_is_streamed_over_chunk_boundaries(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(bytes(range(256)) * (3 * 4096 + 7))  # 3 MiB + 1792 bytes: 4 chunks, the last partial
    assert profile.file_sha256(path) == sha256(path)


def test_a_recorded_sha256_that_is_not_one_is_refused_naming_the_key(export_a):
    path = write_profile(export_a, measured(export_a))
    data = json.loads(path.read_text())
    data["draft_checkpoint"]["weights_sha256"] = "abc"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as err:
        read_profile(path)
    assert str(err.value) == (f"{path}: draft_checkpoint.weights_sha256: 'abc' is not a sha256 "
                              "(64 lowercase hex digits)")


# ------------------------------------------------------------------------------------------
# draftsmith export into a folder that holds a profile


def test_exporting_the_same_weights_again_keeps_the_profile(built, export_a, caplog):
    write_profile(export_a, measured(export_a))
    before = tree(export_a)
    with caplog.at_level(logging.WARNING):
        assert export_cli.main([str(built["a"]), "--out", str(export_a), "--dtype", "float32", "--vllm", "0.32"]) == 0
    assert tree(export_a) == before  # the same bytes exported again: every file, the profile too
    assert not caplog.records


def _stale_export(built, export_a, caplog, capsys) -> str:
    """Export checkpoint b into ``export_a``; the one line logged."""
    notes = sha256(export_a / "NOTES.md")
    with caplog.at_level(logging.WARNING):
        assert export_cli.main([str(built["b"]), "--out", str(export_a), "--dtype", "float32"]) == 0
    assert not (export_a / "speculation_profile.json").exists()
    assert sha256(export_a / "NOTES.md") == notes  # the user's own file keeps its bytes
    assert sorted(p.name for p in export_a.iterdir()) == ["NOTES.md", "config.json", "model.safetensors"]
    assert capsys.readouterr().err == ""
    records = [r for r in caplog.records if r.name == "draftsmith.eval.export"]
    assert len(records) == 1 and "\n" not in records[0].getMessage()
    return records[0].getMessage()


def test_exporting_other_weights_removes_the_profile_naming_it(built, export_a, caplog, capsys):
    old = sha256(export_a / "model.safetensors")
    write_profile(export_a, measured(export_a))
    message = _stale_export(built, export_a, caplog, capsys)
    new = sha256(export_a / "model.safetensors")
    assert new != old
    assert message == (f"removed {export_a / 'speculation_profile.json'}: it measured weights sha256 {old[:12]}, "
                       f"method eagle3, but {export_a / 'model.safetensors'} is sha256 {new[:12]}, method eagle3; "
                       f"measure the new weights with `draftsmith acceptance --target TARGET --draft {export_a}`")


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["draft_checkpoint"].pop("weights_sha256"), "it measured weights sha256 not recorded, method eagle3"),
    (lambda d: d.update(draft_checkpoint=None), "it measured weights sha256 not recorded, method eagle3"),
    (lambda d: d.update(method="dflash"), "method dflash, but"),
    (lambda d: d.pop("measurement_conditions"), "it does not read as a speculation profile (measurement_conditions"),
])
def test_a_profile_that_cannot_be_shown_to_match_is_removed(built, export_a, caplog, capsys, edit, words):
    path = write_profile(export_a, measured(export_a))
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    message = _stale_export(built, export_a, caplog, capsys)
    assert message.startswith(f"removed {path}: ") and words in message


def test_a_profile_without_a_sha256_is_removed_even_by_the_same_weights(built, export_a, caplog):
    path = write_profile(export_a, measured(export_a))
    data = json.loads(path.read_text())
    del data["draft_checkpoint"]["weights_sha256"]
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        assert export_cli.main([str(built["a"]), "--out", str(export_a), "--dtype", "float32"]) == 0
    assert not path.exists() and len(caplog.records) == 1


def test_a_refused_export_leaves_the_folder_and_its_profile_alone(built, export_a, capsys):
    write_profile(export_a, measured(export_a))
    before = tree(export_a)
    assert export_cli.main([str(built["b"]), "--out", str(export_a), "--vllm", "0.34"]) == 1
    assert "error: --vllm 0.34: not a vLLM release draftsmith has checked" in one_line(capsys.readouterr().err)
    assert tree(export_a) == before


# ------------------------------------------------------------------------------------------
# draftsmith hub publishes only a profile of the export's own weights and method


def test_hub_publishes_a_profile_of_these_weights(export_a, tmp_path):
    write_profile(export_a, measured(export_a))
    out = tmp_path / "hub"
    assert hub_cli.main([str(export_a), "--out", str(out), "--repo-id", REPO]) == 0
    assert sha256(out / "speculation_profile.json") == sha256(export_a / "speculation_profile.json")
    assert "### Speculation profile" in (out / "README.md").read_text()


def _refused(export_a: Path, tmp_path: Path, capsys) -> str:
    before = tree(export_a)
    out = tmp_path / "hub"
    assert hub_cli.main([str(export_a), "--out", str(out), "--repo-id", REPO]) == 1
    assert not out.exists()  # nothing written
    assert tree(export_a) == before  # and nothing of the user's changed
    return one_line(capsys.readouterr().err)


def _fix(export_a: Path) -> str:
    return (f"re-measure the export with `draftsmith acceptance --target TARGET --draft {export_a}` (it rewrites the "
            "file), or delete it to publish the draft without a profile")


def test_hub_refuses_a_profile_of_other_weights(built, export_a, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(export_a, other)
    shutil.copy2(built["b"].parent / "export" / "model.safetensors", other / "model.safetensors")
    write_profile(export_a, measured(other))  # measured b's weights, left in a's export
    old, new = sha256(other / "model.safetensors"), sha256(export_a / "model.safetensors")
    assert _refused(export_a, tmp_path, capsys) == (
        f"error: {export_a / 'speculation_profile.json'}: not published: it measured weights sha256 {old[:12]}, "
        f"method eagle3, but {export_a / 'model.safetensors'} is sha256 {new[:12]}, method eagle3; {_fix(export_a)}")


def test_hub_refuses_a_dflash_profile_in_an_eagle3_export(export_a, tmp_path, capsys):
    write_profile(export_a, measured(export_a, method="dflash"))  # the very weights, another method
    sha = sha256(export_a / "model.safetensors")[:12]
    assert _refused(export_a, tmp_path, capsys) == (
        f"error: {export_a / 'speculation_profile.json'}: not published: it measured weights sha256 {sha}, "
        f"method dflash, but {export_a / 'model.safetensors'} is sha256 {sha}, method eagle3; {_fix(export_a)}")


def test_hub_refuses_a_profile_that_records_no_sha256(export_a, tmp_path, capsys):
    path = write_profile(export_a, measured(export_a))
    data = json.loads(path.read_text())
    del data["draft_checkpoint"]["weights_sha256"]
    path.write_text(json.dumps(data))
    sha = sha256(export_a / "model.safetensors")[:12]
    assert _refused(export_a, tmp_path, capsys) == (
        f"error: {path}: not published: it measured weights sha256 not recorded, method eagle3, but "
        f"{export_a / 'model.safetensors'} is sha256 {sha}, method eagle3; {_fix(export_a)}")


def test_hub_into_an_earlier_hub_folder_drops_the_profile_this_draft_lacks(export_a, tmp_path, caplog):
    """--out reused: the profile an earlier draft's run copied there is not this draft's, and
    --push uploads the whole folder; it goes, with one line, and the user's own files stay."""
    out = tmp_path / "hub"
    write_profile(export_a, measured(export_a))
    assert hub_cli.main([str(export_a), "--out", str(out), "--repo-id", REPO]) == 0
    (out / "LICENSE").write_text("mine\n")
    (export_a / "speculation_profile.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert hub_cli.main([str(export_a), "--out", str(out), "--repo-id", REPO]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["LICENSE", "README.md", "config.json", "model.safetensors"]
    assert (out / "LICENSE").read_text() == "mine\n"
    assert [r.getMessage() for r in caplog.records if r.name == "draftsmith.eval.hub"] == [
        f"removed {out / 'speculation_profile.json'}: {export_a} has no speculation_profile.json; the copy an earlier "
        "`draftsmith hub` left there is another draft's and would be published as this one's"]


def test_hub_into_the_export_folder_itself_keeps_every_byte(export_a):
    write_profile(export_a, measured(export_a))
    before = tree(export_a)
    assert hub_cli.main([str(export_a), "--out", str(export_a), "--repo-id", REPO]) == 0
    after = tree(export_a)
    assert after.pop("README.md") and after == before
