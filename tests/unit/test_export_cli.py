"""``draftsmith export``'s command line: K from the checkpoint's saved recipe, and a mistyped run
directory as one line (exit 1), not a traceback."""

from __future__ import annotations

import pytest

from draftsmith.cli import export as export_cli
from draftsmith.eval import export as ex
from draftsmith.recipe import dump_recipe, load_recipe


def test_k_comes_from_the_recipe_saved_with_the_checkpoint(tmp_path):
    assert ex.saved_num_speculative_tokens(tmp_path) == 3  # no recipe saved: the default
    dump_recipe(load_recipe(None, ["eval.num_speculative_tokens=5"]), tmp_path / "recipe.yaml")
    assert ex.saved_num_speculative_tokens(tmp_path) == 5
    (tmp_path / "recipe.yaml").write_text("draft: {method: nonsense}\n")
    with pytest.raises(ex.ExportError, match="recipe.yaml: the checkpoint's recipe does not load"):
        ex.saved_num_speculative_tokens(tmp_path)


def test_a_mistyped_run_directory_is_one_line(tmp_path, capsys):
    assert export_cli.main([str(tmp_path / "runs" / "typo"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "typo: no such checkpoint or run directory" in err
    assert not (tmp_path / "out").exists()
    # a directory that exists but holds no checkpoint
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    assert export_cli.main([str(tmp_path / "runs" / "empty"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a checkpoint nor a run directory with checkpoints" in err


def test_a_folder_without_draft_config_json_names_the_missing_file(tmp_path, capsys):
    """A checkpoint whose draft_config.json is gone, an export passed for its checkpoint, and an
    empty folder: each one line naming draft_config.json, nothing written."""
    ckpt = tmp_path / "step-400"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "train_state.json").write_text("{}")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "empty").mkdir()
    want = {
        ckpt: f"error: {ckpt / 'draft_config.json'} missing: {ckpt} holds model.safetensors and train_state.json but "
              "no draft config, so it is not a complete draftsmith training checkpoint; pass another "
              "RUN_DIR/checkpoints/step-N, or the RUN_DIR (its latest complete checkpoint)",
        export: f"error: {export / 'draft_config.json'} missing: {export} is an exported draft (config.json), not a "
                "training checkpoint; pass the RUN_DIR/checkpoints/step-N it was exported from",
        tmp_path / "empty": f"error: {tmp_path / 'empty'}: neither a checkpoint nor a run directory with checkpoints "
                            "(no draft_config.json, no checkpoints/step-N); pass RUN_DIR/checkpoints/step-N or the "
                            "RUN_DIR of `draftsmith train`",
    }
    for folder, line in want.items():
        assert export_cli.main([str(folder), "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert err == line + "\n"
        assert not (tmp_path / "out").exists()
