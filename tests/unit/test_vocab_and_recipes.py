"""Draft vocab (d2t/t2d) and recipe validation."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith.data_prep.vocab import (
    build_draft_vocab,
    count_assistant_tokens,
    draft_to_target_ids,
    target_to_draft_ids,
)
from draftsmith.methods import registered_methods
from draftsmith.models.eagle3.recipe import Eagle3DraftConfig
from draftsmith.models.medusa.recipe import MedusaDraftConfig
from draftsmith.recipe import RecipeError, dump_recipe, load_recipe

from helpers.recipes import RECIPES

RECIPE_DIR = Path(__file__).parents[2] / "recipes"


def test_draft_vocab_keeps_most_frequent_assistant_tokens_and_round_trips():
    records = [
        {"input_ids": [9, 3, 3, 5, 7, 7, 7], "loss_mask": [1, 0, 1, 1, 1, 1, 1]},
        {"input_ids": [2, 2, 2, 2], "loss_mask": [0, 0, 0, 1]},
    ]
    counts = count_assistant_tokens(records)
    assert counts == Counter({7: 3, 9: 1, 3: 1, 5: 1, 2: 1})
    d2t, t2d = build_draft_vocab(counts, vocab_size=12, draft_vocab_size=3)
    # 7 (x3), then ties broken by lower id: 2, 3
    assert draft_to_target_ids(d2t).tolist() == [2, 3, 7]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.shape == (12,)
    assert torch.nonzero(t2d).flatten().tolist() == [2, 3, 7]
    back = target_to_draft_ids(t2d)
    assert back[draft_to_target_ids(d2t)].tolist() == [0, 1, 2]
    assert back[5].item() == -1


def test_draft_vocab_is_filled_when_few_distinct_tokens():
    d2t, t2d = build_draft_vocab(Counter({4: 2}), vocab_size=8, draft_vocab_size=3)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 4] and int(t2d.sum()) == 3


def test_draft_vocab_errors():
    with pytest.raises(ValueError, match="must be in"):
        build_draft_vocab(Counter({1: 1}), vocab_size=8, draft_vocab_size=9)
    with pytest.raises(ValueError, match="outside the target vocab"):
        build_draft_vocab(Counter({12: 1}), vocab_size=8, draft_vocab_size=2)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_is_named_after_its_file_and_the_file_after_its_method(path, shipped_recipes):
    # runs/<recipe name> is a recipe's default run directory, and <target>_<method>.yaml (EAGLE-3:
    # <target>.yaml, EAGLE-3.1: <target>_eagle31.yaml) is how the dry run and the docs find a
    # recipe's target and method
    recipe = shipped_recipes[path.stem]
    assert recipe.name == path.stem
    suffixes = [m for m in registered_methods() if path.stem.endswith(f"_{m}")]
    assert suffixes == ([] if recipe.draft.method == "eagle3" else [recipe.draft.method])
    if recipe.draft.method == "eagle3":  # the EAGLE-3.1 variants, and only they, set the 3.1 options
        eagle31 = (recipe.draft.norm_before_fc, recipe.draft.fc_norm, recipe.draft.norm_output)
        assert eagle31 == ((True, False, True) if path.stem.endswith("_eagle31") else (False, False, False))


def test_unknown_key_is_rejected_naming_the_key(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(RecipeError, match=r"train\.learning_rate: unknown key"):
        load_recipe(f)


def test_bad_value_is_rejected_naming_the_key(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("draft:\n  ttt_steps: 0\n")
    with pytest.raises(RecipeError, match=r"draft\.ttt_steps"):
        load_recipe(f)
    with pytest.raises(RecipeError, match=r"data\.overlong"):
        load_recipe(None, ["data.overlong=sometimes"])


def test_command_line_overrides_yaml_overrides_defaults(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("train:\n  lr: 0.001\n  batch_size: 3\n")
    r = load_recipe(f, ["train.lr=0.5"])
    assert r.train.lr == 0.5 and r.train.batch_size == 3 and r.draft.gamma == 0.8


@pytest.mark.parametrize("key,value,methods", [
    ("ttt_steps", 3, "eagle3 / mtp"), ("gamma", 0.5, "eagle3 / mtp"), ("head_decay", 0.5, "medusa / mlp_speculator"),
    ("loss", "jsd", "eagle3 / dflash / peagle / dspark / dflash2 / xpress / mtp"),
    ("lk_kl_scale", 0.5, "eagle3 / dflash / peagle / dspark / dflash2 / xpress / mtp"),
    ("gradient_checkpointing", True, "eagle3 / dflash / peagle / dspark / dflash2 / xpress / mtp"),
])
def test_a_training_key_that_moved_to_the_draft_section_names_its_new_place(tmp_path, key, value, methods):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"train": {key: value, "lr": 0.001}}))
    with pytest.raises(RecipeError) as err:
        load_recipe(f)
    assert str(err.value) == (f"{f}: invalid recipe: train.{key}: unknown key: it moved to draft.{key} "
                              f"(draft.method {methods})")
    method = methods.split(" / ")[0]
    assert getattr(load_recipe(None, [f"draft.method={method}", f"draft.{key}={value}"]).draft, key) == value


@pytest.mark.parametrize("recipe_file,overrides,message", [
    ("smollm2_135m_medusa.yaml", ["draft.gradient_checkpointing=true"], "draft.gradient_checkpointing.*eagle3 / dflash / peagle"),
])
def test_settings_that_the_method_cannot_honour_are_refused(recipe_file, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPE_DIR / recipe_file, overrides)
    # without the conflicting key the recipe is fine
    load_recipe(RECIPE_DIR / recipe_file)


def test_draft_section_is_the_methods_own_keys():
    r = load_recipe(None, ["draft.method=medusa", "draft.num_heads=4"])
    assert isinstance(r.draft, MedusaDraftConfig) and r.draft.num_heads == 4
    assert load_recipe(None).draft == Eagle3DraftConfig()  # no draft section: EAGLE-3 defaults
    with pytest.raises(RecipeError, match=r"draft.num_heads: unknown key for draft.method eagle3 \(a key of medusa\)"):
        load_recipe(None, ["draft.num_heads=4"])
    with pytest.raises(RecipeError, match="draft: Input tag 'dflash3' found using 'method' does not match"):
        load_recipe(None, ["draft.method=dflash3"])


@pytest.mark.parametrize("tree,message", [
    ({"draft": {"method": "medusa", "medusa": {"num_heads": 2}}}, "draft.medusa: unknown key"),
    ({"eval": {"vllm": {"dtype": "float32"}}}, "eval.vllm: unknown key: it moved to vllm"),
    ({"train": {"wandb": {"enabled": True}}}, "train.wandb: unknown key: it moved to train.report_to"),
])
def test_recipes_in_the_layouts_before_0_2_0_are_refused_naming_the_key(tmp_path, tree, message):
    # draftsmith 0.2.0 dropped the conversions of older layouts: one line names what to change
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_resolved_recipe_dump_loads_back_equal(tmp_path):
    for name in ("smollm2_135m.yaml", "smollm2_135m_medusa.yaml", "smollm2_135m_mlp_speculator.yaml"):
        r = load_recipe(RECIPE_DIR / name)
        dump_recipe(r, tmp_path / name)
        assert load_recipe(tmp_path / name) == r


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_gpu_recipe_packs_and_picks_its_attention_kernel_by_device(path, shipped_recipes):
    """A GPU recipe's regenerated chat conversations are mostly far shorter than data.max_length:
    unpacked, most of each row would be padding the step still computes (the MLP speculator's
    stage 2 generates from each packed document's prompt)."""
    recipe = shipped_recipes[path.stem]
    assert recipe.train.attention_backend == "auto"
    if path.stem.startswith("smollm2_135m"):  # the CPU lab recipes
        return
    assert recipe.train.packing
