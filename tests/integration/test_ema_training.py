"""``train.ema_decay`` on the tiny target's prepared EAGLE-3 run: the average does not touch
training (the trained weights and the loss curve equal a run without it), checkpoints carry it,
a resume after a crash continues it exactly, and export serves it unless ``--raw-weights``."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli.export import main as export_main
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints, read_draft
from draftsmith.train.trainer import fit

from helpers.faults import FAULT_TRAIN, FaultyEagle3, final_params, max_param_diff, read_metrics

pytestmark = pytest.mark.integration

STEPS = 12


def _run(prepared, root, ema_decay: float):
    recipe, run, _ = prepared
    root.mkdir(parents=True)
    shutil.copytree(run / "data", root / "data")
    recipe = recipe.model_copy(deep=True)
    for k, v in {**FAULT_TRAIN, "max_steps": STEPS, "ema_decay": ema_decay, "keep_checkpoints": 8}.items():
        setattr(recipe.train, k, v)
    return recipe, root


def _ema(run, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step}" / "ema.safetensors"))


def test_the_average_leaves_training_alone_resumes_exactly_and_is_exported(prepared, tmp_path, capsys):
    recipe_off, off = _run(prepared, tmp_path / "off", 0.0)
    fit(recipe_off, Eagle3Method(recipe_off, off), off, progress=False)
    recipe, ref = _run(prepared, tmp_path / "ref", 0.8)
    fit(recipe, Eagle3Method(recipe, ref), ref, progress=False)

    # the average is read, never written back: the trained weights and the curve are the run without it
    assert not any((c / "ema.safetensors").exists() for c in find_checkpoints(off / "checkpoints"))
    assert max_param_diff(final_params(ref), final_params(off)) == 0.0
    assert [m["loss"] for m in read_metrics(ref) if "loss" in m] == [m["loss"] for m in read_metrics(off) if "loss" in m]
    trained, average = final_params(ref), _ema(ref)
    model = Eagle3Method(recipe, ref).build_model()
    assert sorted(average) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert all(average[n].dtype == torch.float32 for n in average)
    assert max_param_diff(average, {n: trained[n] for n in average}) > 1e-4

    # a crash in the second checkpoint save, then --resume from step 3: the same average at steps 6 and 12
    # (at step 6 the average before the resume still weighs (5/14)(6/15)(7/16) = 0.06)
    _, crashed = _run(prepared, tmp_path / "crashed", 0.8)
    with pytest.raises(OSError, match="injected crash"):
        fit(recipe, FaultyEagle3(recipe, crashed, crash_on_save=2), crashed, progress=False)
    fit(recipe, Eagle3Method(recipe, crashed), crashed, resume=True, progress=False)
    for step in (6, STEPS):
        assert max_param_diff(_ema(crashed, step), _ema(ref, step)) <= 1e-6, step

    # export and warm starts read the average; --raw-weights exports the trained weights
    ckpt = find_checkpoints(ref / "checkpoints")[-1]
    state = read_draft(ckpt).state
    assert all(torch.equal(state[n], average[n].to(state[n].dtype)) for n in average)
    assert torch.equal(read_draft(ckpt, average=False).state["fc.weight"], trained["fc.weight"])
    assert export_main([str(ckpt), "--out", str(tmp_path / "avg")]) == 0
    assert "(its weight average, ema.safetensors)" in capsys.readouterr().out
    assert export_main([str(ckpt), "--out", str(tmp_path / "raw"), "--raw-weights"]) == 0
    avg, raw = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("avg", "raw"))
    assert avg.keys() == raw.keys()
    assert not torch.equal(avg["fc.weight"], raw["fc.weight"])
    torch.testing.assert_close(avg["fc.weight"], average["fc.weight"].to(avg["fc.weight"].dtype))
