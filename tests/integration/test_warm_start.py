"""draft.init_from: fine-tune an exported EAGLE-3 draft (or a checkpoint), refused before any
step when it does not fit the run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.eval.export import export
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.cli.train import launch
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit
from draftsmith.models.eagle3.warm_start import WarmStartError, target_ids

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A draft trained 15 steps on the tiny run, exported."""
    recipe, run, _ = prepared
    root = tmp_path_factory.mktemp("base")
    shutil.copytree(run / "data", root / "data")
    recipe = recipe.model_copy(deep=True)
    recipe.train.max_steps = 15
    fit(recipe, Eagle3Method(recipe, root), root, progress=False)
    out = export(find_checkpoints(root / "checkpoints")[-1], root / "export")
    return recipe, root, out


def _warm(recipe, root, init_from):
    r = recipe.model_copy(deep=True)
    r.draft.init_from = str(init_from)
    return Eagle3Method(r, root), r


def test_the_warm_model_starts_as_the_exported_draft(trained):
    recipe, root, out = trained
    method, _ = _warm(recipe, root, out)
    model = method.build_model()
    exported = load_file(str(out / "model.safetensors"))
    for name, value in model.state_dict().items():
        if name in exported:
            assert torch.equal(value, exported[name].to(value.dtype)), name
    assert "fc.weight" in exported and "layers.0.self_attn.q_proj.weight" in exported


def test_a_checkpoint_warm_starts_too_and_training_continues_from_it(trained, tmp_path):
    recipe, root, _ = trained
    ckpt = find_checkpoints(root / "checkpoints")[-1]
    run = tmp_path / "warm"
    shutil.copytree(root / "data", run / "data")
    method, r = _warm(recipe, run, ckpt)
    r.train.max_steps = 3
    fit(r, method, run, progress=False)
    scratch = tmp_path / "scratch"
    shutil.copytree(root / "data", scratch / "data")
    r0 = recipe.model_copy(deep=True)
    r0.train.max_steps = 3
    fit(r0, Eagle3Method(r0, scratch), scratch, progress=False)
    first = lambda d: json.loads((d / "metrics.jsonl").read_text().splitlines()[0])  # noqa: E731
    assert first(run)["loss"] < 0.9 * first(scratch)["loss"]  # the warm draft starts trained


def test_lm_head_rows_move_by_target_token_id(trained, tmp_path):
    recipe, root, out = trained
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    tensors = load_file(str(moved / "model.safetensors"))
    ids = target_ids(tensors["d2t"])
    perm = torch.roll(torch.arange(ids.shape[0]), 1)  # the same tokens in another draft order
    new_ids = ids[perm]
    tensors["d2t"] = new_ids - torch.arange(ids.shape[0])
    tensors["lm_head.weight"] = tensors["lm_head.weight"][perm].contiguous()
    save_file(tensors, str(moved / "model.safetensors"))
    model = _warm(recipe, root, moved)[0].build_model()
    original = load_file(str(out / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(model.lm_head.weight, original)  # row of token t is token t's row


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "aux layer ids"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=999), "another tokenizer"),
    (lambda c: c["speculators_config"]["verifier"].update(architectures=["Qwen3ForCausalLM"]), "verifier"),
])
def test_a_draft_for_another_target_is_refused_before_training(trained, tmp_path, edit, message, capsys):
    recipe, root, out = trained
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(WarmStartError, match=message):
        _warm(recipe, root, bad)
    run = tmp_path / "run"
    shutil.copytree(root / "data", run / "data")
    recipe_file = run / "recipe.yaml"
    recipe_file.write_text(json.dumps(recipe.model_dump(mode="json")))
    code = launch([str(recipe_file), "--run-dir", str(run), "--no-prepare", "--set", f"draft.init_from={bad}"],
                  method=Eagle3Method, script="train/eagle3.py", doc="")
    assert code == 1 and message in capsys.readouterr().err
    assert not (run / "checkpoints").exists()


def test_a_missing_folder_is_named(trained):
    recipe, root, _ = trained
    with pytest.raises(WarmStartError, match="no such folder"):
        _warm(recipe, root, root / "nowhere")


def test_simulate_reads_exports_and_checkpoints_alike_in_the_drafts_own_vocab(trained, tmp_path):
    from draftsmith.models.eagle3.simulate import simulate

    recipe, root, out = trained
    ckpt = find_checkpoints(root / "checkpoints")[-1]
    from_export = simulate(out, root / "data", k=3, temperatures=(0.0, 0.7))
    from_ckpt = simulate(ckpt, root / "data", k=3, temperatures=(0.0, 0.7))
    assert from_export["val_sim_al"] == pytest.approx(from_ckpt["val_sim_al"])
    assert 1.0 <= from_export["val_sim_al"] <= 4.0 and from_export["val_chains"] > 0
    assert 1.0 <= from_export["val_sim_al_t0.7"] <= 4.0
    # the same draft with its vocab stored in another order simulates the same
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    tensors = load_file(str(moved / "model.safetensors"))
    perm = torch.roll(torch.arange(tensors["d2t"].shape[0]), 5)
    ids = target_ids(tensors["d2t"])[perm]
    tensors["d2t"] = ids - torch.arange(ids.shape[0])
    tensors["lm_head.weight"] = tensors["lm_head.weight"][perm].contiguous()
    save_file(tensors, str(moved / "model.safetensors"))
    assert simulate(moved, root / "data", k=3)["val_sim_al"] == pytest.approx(from_export["val_sim_al"])
