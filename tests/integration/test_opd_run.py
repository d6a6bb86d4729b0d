"""``draftsmith opd`` end to end on the tiny target's trained EAGLE-3 run: the offline variant,
its resume, the replay variant (rows where verification rejected, their capture, training), a
replay interrupted mid-row that resumes without a duplicate row, and the refusals; both variants
on a DFlash run."""

from __future__ import annotations

import json
import shutil

import pytest
from draftsmith.cli import opd as opd_cli

from helpers import folder_digest


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """``(recipe, run dir)``: the tiny target's EAGLE-3 draft prepared and trained 6 steps. Read only."""
    from helpers.recipes import tiny_deployed_draft

    root = tmp_path_factory.mktemp("opd_base")
    recipe, run, _, _ = tiny_deployed_draft(tiny_target, root, max_steps=6)
    return recipe, run


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_offline_opd_trains_from_the_run_s_checkpoint_and_resumes(trained, tmp_path, capsys):
    _, base = trained
    run = _copy(base, tmp_path)
    before = {name: folder_digest(run / name) for name in ("data", "checkpoints")}
    assert opd_cli.main([str(run), "--max-steps", "3", "--split", "hard"]) == 0
    out = capsys.readouterr().out
    assert "data cost: 0.000 target tokens scored per trained token (0 scored by the offline stage" in out
    opd = run / "opd"
    result = json.loads((opd / "opd.json").read_text())
    assert result["steps"] == 3 and result["trained_tokens"] > 0 and result["target_tokens_scored"] == 0
    assert result["started_from"] == str((run / "checkpoints" / "step-6").resolve())
    assert (opd / "export" / "config.json").is_file() and (opd / "checkpoints" / "step-3").is_dir()
    assert (opd / "data").is_symlink()
    recipe = (opd / "recipe.yaml").read_text()
    assert "opd: hard" in recipe and "step-6" in recipe
    rows = _metrics(opd)
    assert any("reach_1" in r for r in rows)  # the split's figures are logged
    # the run's own data and checkpoints are untouched
    assert before == {name: folder_digest(run / name) for name in ("data", "checkpoints")}

    # re-running continues (no --overwrite): 3 more steps from the OPD checkpoint
    assert opd_cli.main([str(run), "--max-steps", "5", "--split", "hard"]) == 0
    result = json.loads((opd / "opd.json").read_text())
    assert result["steps"] == 5 and (opd / "checkpoints" / "step-5").is_dir()
    steps = [r["step"] for r in _metrics(opd) if "step" in r and "loss" in r]
    assert len(steps) == len(set(steps))

    # the other variant is not mixed into it
    capsys.readouterr()
    assert opd_cli.main([str(run), "--variant", "replay", "--max-steps", "1"]) == 1
    assert "holds a offline OPD stage" in capsys.readouterr().err


def test_replay_opd_rows_where_verification_rejected_resume_without_duplicates(trained, tmp_path, capsys,
                                                                                monkeypatch):
    from draftsmith.eval import opd_replay

    _, base = trained
    run = _copy(base, tmp_path)
    args = [str(run), "--variant", "replay", "--conversations", "4", "--prefixes", "2", "--new-tokens", "12",
            "--max-steps", "2", "--device", "cpu", "--set", "train.batch_size=2"]
    # a kill mid-replay: the third row's write dies after half a line
    real, calls = opd_replay.append_row, []

    def dying(f, row):
        calls.append(row["id"])
        if len(calls) == 3:
            f.write(json.dumps(row)[:20].encode())
            f.flush()
            raise KeyboardInterrupt
        real(f, row)

    monkeypatch.setattr(opd_replay, "append_row", dying)
    with pytest.raises(KeyboardInterrupt):
        opd_cli.main(args)
    rows_file = run / "opd" / "replay" / "rows.jsonl"
    assert len(rows_file.read_text().splitlines()) == 3 and not rows_file.read_text().endswith("\n")
    monkeypatch.setattr(opd_replay, "append_row", real)

    assert opd_cli.main(args) == 0
    out = capsys.readouterr().out
    result = json.loads((run / "opd" / "opd.json").read_text())
    replay = result["replay"]
    ids = [json.loads(line)["id"] for line in rows_file.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == replay["continuations"] == 8  # the two rows written before the kill, kept once
    assert ids[:2] == calls[:2]
    assert replay["rows"] >= 1 and replay["rejections"] >= replay["rows"]
    scored = replay["target_tokens_scored"]
    assert scored > replay["captured_tokens"] > 0
    assert result["target_tokens_scored"] == scored
    assert f"data cost: {scored / result['trained_tokens']:.3f} target tokens scored per trained token" in out
    # the rows' masks: the rejected positions and what follows them, nothing on the prefix
    from draftsmith.layout import DataPaths, read_tokenized

    data = read_tokenized(DataPaths(run / "opd" / "data"), format=None)
    assert len(data) == replay["rows"]
    for row in (json.loads(line) for line in rows_file.read_text().splitlines()):
        cut = int(row["id"].rsplit("@", 1)[1])
        assert not any(row["loss_mask"][:cut])
        assert row["kept"] == any(row["loss_mask"])
    assert (run / "opd" / "data" / "hidden_states" / "manifest.json").is_file()
    assert (run / "opd" / "export" / "config.json").is_file()

    # again: nothing is decoded twice, the training continues
    assert opd_cli.main([*args[:-4], "--max-steps", "3", "--set", "train.batch_size=2"]) == 0
    assert [json.loads(line)["id"] for line in rows_file.read_text().splitlines()] == ids


def test_replay_from_a_prompt_set_decodes_one_whole_prompt_per_row(trained, tmp_path, capsys):
    _, base = trained
    run = _copy(base, tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ("Name three rivers.", "What is 7 times 8?", "Write a short poem about tea.",
                                "Explain what a prime number is.", "Give me a word that rhymes with cat.")))
    args = [str(run), "--variant", "replay", "--prompts", str(prompts), "--conversations", "4", "--new-tokens", "10",
            "--max-steps", "1", "--device", "cpu", "--set", "train.batch_size=2", "--sft-rows", "2"]
    assert opd_cli.main(args) == 0
    replay = json.loads((run / "opd" / "opd.json").read_text())["replay"]
    assert replay["prompts"] == str(prompts) and replay["prefixes"] is None and replay["continuations"] == 4
    assert replay["rows"] >= 1 and replay["sft_rows"] == 2
    # --sft-rows: two of the run's training conversations join the replay rows, their SFT masks unchanged
    from draftsmith.layout import RunLayout, read_tokenized

    staged = read_tokenized(RunLayout(run / "opd").data, format=None)
    own = read_tokenized(RunLayout(run).data, format=None)
    own = {str(i): (list(x), list(m)) for i, x, m in zip(own["id"], own["input_ids"], own["loss_mask"])}
    sft = [(str(i)[4:], list(x), list(m)) for i, x, m in zip(staged["id"], staged["input_ids"], staged["loss_mask"])
           if str(i).startswith("sft:")]
    assert len(sft) == 2 and len(staged["id"]) == replay["rows"] + 2
    assert all(own[i] == (x, m) for i, x, m in sft)
    assert replay["sft_trained_positions"] == sum(sum(m) for _, _, m in sft) > 0
    rows = [json.loads(line) for line in (run / "opd" / "replay" / "rows.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in rows}) == 4
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_path(run)))
    for row in rows:
        index, length = (int(x) for x in row["id"].removeprefix("prompt").split("@"))
        # the prefix is the whole prompt rendered up to the generation prompt; no loss on it
        prompt = json.loads(prompts.read_text().splitlines()[index])["prompt"]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        assert row["input_ids"][:length] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert not any(row["loss_mask"][:length]) and row["kept"] == any(row["loss_mask"])

    capsys.readouterr()
    assert opd_cli.main([str(run), "--prompts", str(prompts)]) == 2  # the offline variant has no prompts
    assert "--prompts is for --variant replay" in capsys.readouterr().err
    assert opd_cli.main([str(run), "--sft-rows", "3"]) == 2
    assert "--sft-rows is for --variant replay" in capsys.readouterr().err
    assert opd_cli.main([*args[:4], str(tmp_path / "none.jsonl"), *args[5:]]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "none.jsonl: no such file" in err


def tiny_target_path(run):
    from draftsmith.target import TargetInfo

    return TargetInfo.read(run / "data" / "target.json").path


def test_bad_input_one_line_each(trained, tmp_path, capsys):
    from draftsmith.recipe import dump_recipe, load_recipe

    _, base = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    assert opd_cli.main([str(empty)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"`draftsmith train RECIPE --run-dir {empty}`" in err

    run = _copy(base, tmp_path)
    shutil.rmtree(run / "checkpoints")
    assert opd_cli.main([str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no trained checkpoint" in err and "draftsmith train RECIPE --run-dir" in err
    assert not (run / "opd").exists()

    medusa = tmp_path / "medusa"
    medusa.mkdir()
    dump_recipe(load_recipe(None, ["draft.method=medusa"]), medusa / "recipe.yaml")
    assert opd_cli.main([str(medusa)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: draft.opd: on-policy distillation is not supported by draft.method medusa "
                   "(supported: eagle3, dflash, dflash2, dspark, xpress, peagle)")
    assert opd_cli.main([str(run), "--new-tokens", "0"]) == 2


def test_offline_opd_on_a_dflash_run(tiny_target, tmp_path, capsys):
    from draftsmith.data_prep.prepare import prepare
    from draftsmith.models.dflash.training import DFlashMethod
    from draftsmith.train.trainer import fit

    from helpers.recipes import dflash_recipe

    recipe, _ = dflash_recipe(tiny_target, tmp_path)
    recipe.train.max_steps = 4
    run = tmp_path / "run"
    prepare(recipe, run)
    fit(recipe, DFlashMethod(recipe, run), run, progress=False)
    assert opd_cli.main([str(run), "--max-steps", "2", "--split", "hard", "--opd-gamma", "0.5"]) == 0
    result = json.loads((run / "opd" / "opd.json").read_text())
    assert result["steps"] == 2 and result["split"] == "hard" and result["opd_gamma"] == 0.5
    assert "reach_1" in result["last_metrics"] and (run / "opd" / "export" / "config.json").is_file()
    assert "data cost: 0.000" in capsys.readouterr().out
    # replay with the block drafter's proposer
    assert opd_cli.main([str(run), "--variant", "replay", "--overwrite", "--conversations", "3", "--prefixes", "1",
                         "--new-tokens", "8", "--max-steps", "1", "--device", "cpu",
                         "--set", "train.batch_size=2"]) == 0
    replay = json.loads((run / "opd" / "opd.json").read_text())["replay"]
    assert replay["continuations"] == 3 and replay["rows"] >= 1
