"""``--resume`` with a changed recipe: every recipe key is classed (free, applied, refused), the
refusal is one line naming every refused key, a damaged checkpoint names its file and the previous
checkpoint, a run without a checkpoint resumes from step 0 (:mod:`draftsmith.train.resume`).
In-process, on checkpoints written by hand (the end-to-end runs: tests/integration/test_resume_recipe_changes.py)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from draftsmith.recipe import Recipe, dump_recipe, load_recipe
from draftsmith.train.checkpoint import (
    CheckpointError,
    RunDirNotEmptyError,
    checkpoint_problem,
    claim_run_dir,
)
from draftsmith.train.resume import (
    APPLIED,
    FREE,
    KEY_CLASSES,
    REFUSED,
    CorruptCheckpointError,
    ResumeRefusedError,
    apply_hyperparameters,
    classify,
    compare_recipes,
    flatten,
    plan_resume,
    recipe_sections,
    set_aside_later,
)
from pydantic import BaseModel
from safetensors.torch import save_file


def leaf_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every leaf key of a pydantic model, walked here (not with the code under test): nested
    models are sections, the draft union is every method's section, a list of models is a value."""
    keys = set()
    for name, fld in model.model_fields.items():
        key, ann = f"{prefix}{name}", fld.annotation
        members = typing.get_args(ann) if typing.get_origin(ann) is typing.Union else ()
        if typing.get_origin(ann) is typing.Annotated:
            members = typing.get_args(typing.get_args(ann)[0])
        sections = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= leaf_keys(ann, f"{key}.")
        elif sections and len(sections) == len([m for m in members if m is not type(None)]):
            for section in sections:
                keys |= leaf_keys(section, f"{key}.")
        else:
            keys.add(key)
    return keys


def test_every_recipe_key_is_classed_and_every_entry_is_a_recipe_key():
    keys = leaf_keys(Recipe)
    assert {"draft.ttt_steps", "draft.block_size", "draft.n_predict", "train.lr", "vllm.dtype",
            "eval.serve.k_sweep", "data.regenerate.engine"} <= keys  # the walk reaches every method and section
    unclassed = sorted(k for k in keys if classify(k) is None)
    assert not unclassed, f"recipe keys without a resume class in train/resume.py KEY_CLASSES: {unclassed}"
    stale = sorted(k for k in KEY_CLASSES if not any(x == k or x.startswith(k + ".") for x in keys))
    assert not stale, f"KEY_CLASSES entries that are no recipe key: {stale}"
    assert {kind for kind, _ in KEY_CLASSES.values()} == {FREE, APPLIED, REFUSED}


@pytest.mark.parametrize("key, kind", [
    ("train.max_steps", FREE), ("train.epochs", FREE), ("train.log_every", FREE), ("train.report_to", FREE),
    ("train.checkpoint_every", FREE), ("train.num_workers", FREE), ("vllm.max_num_seqs", FREE),
    ("eval.serve.concurrency", FREE), ("eval.temperature", FREE),
    ("train.lr", APPLIED), ("train.warmup_ratio", APPLIED), ("train.min_lr_ratio", APPLIED), ("draft.gamma", APPLIED),
    ("draft.method", REFUSED), ("draft.ttt_steps", REFUSED), ("draft.num_layers", REFUSED),
    ("train.optimizer", REFUSED), ("data.aux_layer_ids", REFUSED), ("target.name_or_path", REFUSED),
    ("data.max_length", REFUSED), ("data.sources", REFUSED), ("train.batch_size", REFUSED),
])
def test_classes_of_the_keys_users_change(key, kind):
    assert classify(key)[0] == kind


def test_a_dict_valued_key_is_one_value_not_a_section():
    sections = recipe_sections()
    flat = flatten(load_recipe(None, ["vllm.extra_engine_args={seed: 1}"]).model_dump(mode="json"), sections)
    assert flat["vllm.extra_engine_args"] == {"seed": 1} and flat["data.regenerate.engine"] == "auto"
    assert "data.regenerate" not in flat


def _changes(*overrides: str):
    sections = recipe_sections()
    old = flatten(load_recipe(None, []).model_dump(mode="json"), sections)
    new = flatten(load_recipe(None, list(overrides)).model_dump(mode="json"), sections)
    return {c.key: c for c in compare_recipes(old, new)}


def test_compare_classes_each_changed_key_and_ignores_equal_values():
    got = _changes("train.lr=0.1", "draft.ttt_steps=5", "train.max_steps=9", "train.betas=[0.9, 0.95]")
    assert {k: c.kind for k, c in got.items()} == {"train.lr": APPLIED, "draft.ttt_steps": REFUSED,
                                                  "train.max_steps": FREE}
    assert str(got["draft.ttt_steps"]) == "draft.ttt_steps 7 -> 5"


# -- checkpoints written by hand ------------------------------------------------------------------

def write_checkpoint(run: Path, step: int, recipe: Recipe, method: str = "eagle3", aux=(1, 3, 4),
                     save_recipe: bool = True) -> Path:
    ckpt = run / "checkpoints" / f"step-{step}"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(4, 4)}, str(ckpt / "model.safetensors"))
    (ckpt / "train_state.json").write_text(json.dumps({"step": step, "version": "9.9.9"}))
    (ckpt / "draft_config.json").write_text(json.dumps({"method": method, "config": {},
                                                        "target": {"aux_layer_ids": list(aux)}}))
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.bin")
    if save_recipe:
        dump_recipe(recipe, ckpt / "recipe.yaml")
    return ckpt


def tiny(*overrides: str) -> Recipe:
    return load_recipe(None, ["data.aux_layer_ids=[1, 3, 4]", "draft.ttt_steps=3", "train.lr=0.003", *overrides])


def write_data(run: Path, aux=(1, 3, 4)) -> None:
    (run / "data").mkdir(parents=True, exist_ok=True)
    (run / "data" / "target.json").write_text(json.dumps({"aux_layer_ids": list(aux), "num_hidden_layers": 6}))


def test_a_refusal_is_one_line_naming_every_refused_key_old_and_new_and_the_ways_out(tmp_path):
    write_data(tmp_path)
    write_checkpoint(tmp_path, 1, tiny())
    ckpt = write_checkpoint(tmp_path, 2, tiny())
    new = tiny("draft.ttt_steps=5", "train.optimizer=muon", "train.lr=0.1", "train.max_steps=9")
    with pytest.raises(ResumeRefusedError) as err:
        plan_resume(new, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"--resume: {ckpt} was trained with other values of keys a resumed run cannot change: ")
    assert "draft.ttt_steps 3 -> 5, train.optimizer adamw -> muon;" in msg
    assert "train.lr" not in msg and "max_steps" not in msg  # applied / free keys are not refused
    assert "--overwrite" in msg and "fresh --run-dir" in msg and str(ckpt / "recipe.yaml") in msg


def test_applied_and_free_keys_pass_with_one_note(tmp_path):
    write_data(tmp_path)
    write_checkpoint(tmp_path, 2, tiny())
    plan = plan_resume(tiny("train.lr=0.1", "train.max_steps=9"), tmp_path)
    assert [str(c) for c in plan.applied] == ["train.lr 0.003 -> 0.1"]
    assert [c.key for c in plan.free] == ["train.max_steps"]
    assert plan.note().startswith("--resume: train.lr 0.003 -> 0.1 (changed since step-2): applied from step 2 on")


def test_another_method_is_named_before_any_key_or_shape(tmp_path):
    write_data(tmp_path)
    ckpt = write_checkpoint(tmp_path, 2, tiny())
    dflash = tiny("draft={method: dflash, num_layers: 1, block_size: 4}")
    with pytest.raises(ResumeRefusedError) as err:
        plan_resume(dflash, tmp_path)
    assert str(err.value).startswith(f"--resume: checkpoint step-2 was trained by eagle3, the recipe asks for dflash ({ckpt})")
    assert "\n" not in str(err.value)


def test_a_checkpoint_without_its_recipe_is_compared_with_the_run_dirs(tmp_path):
    write_data(tmp_path)
    write_checkpoint(tmp_path, 2, tiny(), save_recipe=False)
    dump_recipe(tiny(), tmp_path / "recipe.yaml")
    with pytest.raises(ResumeRefusedError, match=r"draft\.ttt_steps 3 -> 4"):
        plan_resume(tiny("draft.ttt_steps=4"), tmp_path)
    assert plan_resume(tiny(), tmp_path).recipe_source == tmp_path / "recipe.yaml"


def test_aux_ids_of_the_draft_against_the_data_prepared_since(tmp_path):
    """prepare --overwrite-data with other aux ids, and a recipe that does not name them (the
    default ids of the target): the checkpoint's draft_config.json says what the draft reads."""
    write_data(tmp_path, aux=(1, 2, 4))
    ckpt = write_checkpoint(tmp_path, 2, tiny("data.aux_layer_ids=null"), aux=(1, 3, 4))
    with pytest.raises(ResumeRefusedError) as err:
        plan_resume(tiny("data.aux_layer_ids=null"), tmp_path)
    assert (f"data.aux_layer_ids [1, 3, 4] -> [1, 2, 4] ({ckpt / 'draft_config.json'} -> "
            f"{tmp_path / 'data' / 'target.json'})") in str(err.value)


@pytest.mark.parametrize("damage, problem", [
    ("truncate_weights", "model.safetensors: truncated or corrupt"),
    ("bad_state", "train_state.json: unreadable"),
    ("truncate_optimizer", "optimizer.bin: truncated or corrupt"),
])
def test_a_damaged_last_checkpoint_names_the_file_and_the_previous_one(tmp_path, damage, problem):
    write_data(tmp_path)
    write_checkpoint(tmp_path, 1, tiny())
    ckpt = write_checkpoint(tmp_path, 2, tiny())
    target = {"truncate_weights": "model.safetensors", "bad_state": "train_state.json",
              "truncate_optimizer": "optimizer.bin"}[damage]
    data = (ckpt / target).read_bytes()
    (ckpt / target).write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError) as err:
        plan_resume(tiny(), tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"{ckpt}/{problem}") and "\n" not in msg
    assert "cannot resume from step-2; resume from the previous checkpoint with --resume-from step-1" in msg
    plan = plan_resume(tiny(), tmp_path, resume_from="step-1")
    assert plan.checkpoint == tmp_path / "checkpoints" / "step-1" and plan.later == [ckpt]
    assert plan_resume(tiny(), tmp_path, resume_from=str(tmp_path / "checkpoints" / "step-1")).checkpoint == plan.checkpoint
    set_aside_later(plan)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["abandoned-step-2", "step-1"]


def test_a_damaged_only_checkpoint_says_to_start_over(tmp_path):
    write_data(tmp_path)
    ckpt = write_checkpoint(tmp_path, 2, tiny())
    (ckpt / "train_state.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match="no earlier checkpoint is left: start over with --overwrite"):
        plan_resume(tiny(), tmp_path)


def test_resume_from_names_only_complete_checkpoints_of_the_run(tmp_path):
    write_data(tmp_path)
    write_checkpoint(tmp_path, 2, tiny())
    for bad in ("step-7", "best", str(tmp_path)):
        with pytest.raises(Exception, match=r"--resume-from .*: not a checkpoint of .* there: step-2\)"):
            plan_resume(tiny(), tmp_path, resume_from=bad)
    assert plan_resume(tiny(), tmp_path, resume_from="2").checkpoint.name == "step-2"


def test_a_run_with_output_but_no_checkpoint_resumes_from_step_0_and_says_so_without_resume(tmp_path):
    write_data(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": NaN}\n')
    assert plan_resume(tiny(), tmp_path).checkpoint is None
    with pytest.raises(RunDirNotEmptyError) as err:
        claim_run_dir(tmp_path, resume=False, overwrite=False)
    assert "wrote no checkpoint (metrics.jsonl): pass --resume to train it from step 0" in str(err.value)
    assert (tmp_path / "metrics.jsonl").is_file()
    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):  # nothing at all to resume
        plan_resume(tiny(), empty)


def test_checkpoint_problem_is_none_for_a_whole_checkpoint(tmp_path):
    assert checkpoint_problem(write_checkpoint(tmp_path, 3, tiny())) is None


def test_applied_lr_reaches_the_restored_optimizer_and_schedule():
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    def build(lr):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
        return opt, get_cosine_with_min_lr_schedule_with_warmup(opt, 0, 10, min_lr_rate=0.0)

    old_opt, old_sched = build(0.003)
    for _ in range(4):
        old_opt.step()
        old_sched.step()
    opt, sched = build(0.1)
    fresh = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]], [list(sched.base_lrs)]
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(0.003 * sched.lr_lambdas[0](4))  # what resume did before
    apply_hyperparameters([opt], [sched], *fresh)
    assert sched.base_lrs == [0.1] and opt.param_groups[0]["initial_lr"] == 0.1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * sched.lr_lambdas[0](4))
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * sched.lr_lambdas[0](5))


def test_a_batch_size_that_keeps_the_global_batch_is_free(tmp_path):
    """One process with batch 4 trains like two with batch 2 (the launcher tests' twin runs)."""
    write_data(tmp_path)
    ckpt = write_checkpoint(tmp_path, 2, tiny("train.batch_size=2"))
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "num_processes": 2}))
    plan = plan_resume(tiny("train.batch_size=4"), tmp_path, distributed_type="NO", num_processes=1)
    assert [c.key for c in plan.free] == ["train.batch_size"]
    with pytest.raises(ResumeRefusedError, match=r"train\.batch_size 2 -> 4 \(global batch 4 -> 8 over 2 -> 2 "
                                                 r"processes\)"):
        plan_resume(tiny("train.batch_size=4"), tmp_path, distributed_type="NO", num_processes=2)


def test_the_launcher_that_wrote_it_is_named_before_the_recipe_keys(tmp_path):
    write_data(tmp_path)
    ckpt = write_checkpoint(tmp_path, 2, tiny("train.batch_size=2"))
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "num_processes": 2, "distributed_type": "DEEPSPEED"}))
    with pytest.raises(CheckpointError, match="train_state.json: distributed_type=DEEPSPEED"):
        plan_resume(tiny("train.batch_size=8", "draft.ttt_steps=5"), tmp_path, distributed_type="NO", num_processes=1)
