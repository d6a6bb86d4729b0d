"""The ``draftsmith`` command line: subcommands reach each stage, ``train`` picks the recipe's
method, and ``recipe schema`` documents every key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.cli import STAGES, main
from draftsmith.models.medusa.recipe import MedusaDraftConfig
from draftsmith.recipe import Recipe, dump_recipe, recipe_schema

from helpers.tiny import write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

REPO = Path(__file__).resolve().parents[2]


def test_schema_lists_every_key_with_a_description(capsys):
    rows = recipe_schema()
    keys = {r["key"] for r in rows}
    assert {"train.lr", "vllm.tensor_parallel_size", "data.sources[].path", "train.report_to"} <= keys
    assert not [r["key"] for r in rows if not r["description"]]
    # every leaf of a resolved recipe is in the schema (list items under `[]`)
    def leaves(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict) and k not in ("extra_engine_args", "reasoning_effort"):
                yield from leaves(v, f"{prefix}{k}.")
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                yield from leaves(v[0], f"{prefix}{k}[].")
            else:
                yield f"{prefix}{k}"
    assert set(leaves(Recipe().model_dump(mode="json"))) <= keys
    assert next(r for r in rows if r["key"] == "data.sources[].path")["default"] == "(required)"
    # a method's training keys are listed under draft, for the methods they apply to
    methods = {(r["key"], r["description"].split(")")[0].removeprefix("(method ")) for r in rows}
    assert {("draft.ttt_steps", "eagle3"), ("draft.head_decay", "medusa"), ("draft.head_decay", "mlp_speculator"),
            ("draft.gradient_checkpointing", "dflash"), ("draft.loss", "peagle")} <= methods
    assert not keys & {"train.ttt_steps", "train.gamma", "train.head_decay", "train.loss", "train.gradient_checkpointing"}
    assert main(["recipe", "schema", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(rows, default=str))


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_recipe_validate_accepts_every_shipped_recipe(path, capsys):
    from draftsmith.recipe import load_recipe
    from draftsmith.vllm_bridge.releases import check_vllm_serves_method, installed_vllm_version

    try:
        check_vllm_serves_method(load_recipe(path).draft.method, installed_vllm_version())
    except ValueError as exc:  # a recipe for another vLLM release (XPress: 0.33 on) is refused in one line
        assert main(["recipe", "validate", str(path)]) == 2
        assert str(exc) in capsys.readouterr().err
        return
    assert main(["recipe", "validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out


def test_recipe_validate_names_the_bad_key(capsys):
    assert main(["recipe", "validate", str(REPO / "recipes" / "smollm2_135m.yaml"), "--set", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_train_dispatches_on_the_recipes_method(tiny_target, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    recipe = tiny_recipe(tiny_target, prompts)
    recipe.draft = MedusaDraftConfig()
    path = tmp_path / "medusa.yaml"
    dump_recipe(recipe, path)
    assert main(["train", str(path), "--dry-run"]) == 0
    assert "draft            medusa" in capsys.readouterr().out


def test_every_stage_subcommand_has_a_main_and_unknown_ones_are_refused(capsys):
    import importlib

    for module, _ in STAGES.values():
        assert callable(importlib.import_module(module).main), module
    assert main(["nonsense"]) == 2
    assert "unknown subcommand 'nonsense'" in capsys.readouterr().err
