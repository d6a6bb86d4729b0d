"""Fixtures every test module shares: the tiny target and tokenizers, the prepared tiny run
(once per session), every shipped recipe. Helpers (tiny targets, recipes, launchers) are in
``tests/helpers/``."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

from helpers.recipes import RECIPES, peagle_recipe, tiny_recipe, write_prompts
from helpers.tiny import CHATML, ZEPHYR, build_tiny_target, build_tokenizer


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_tokenizer(CHATML)


@pytest.fixture(scope="session")
def zephyr_tokenizer():
    return build_tokenizer(ZEPHYR)


@pytest.fixture(scope="session")
def shipped_recipes():
    """``{name: Recipe}`` of every ``recipes/*.yaml``, loaded once."""
    from draftsmith.recipe import load_recipe

    return {path.stem: load_recipe(path) for path in RECIPES}


@pytest.fixture(scope="session")
def prepared_run(tiny_target, tmp_path_factory):
    """``(recipe, run dir, prepare summary)``: the tiny target's EAGLE-3 run (25 steps) prepared
    once per session. Read only: :func:`prepared` hands each module its own copy."""
    from draftsmith.data_prep.prepare import prepare

    run = tmp_path_factory.mktemp("prepared_run")
    recipe = tiny_recipe(tiny_target, write_prompts(run / "prompts.jsonl"), max_steps=25)
    summary = prepare(recipe, run)
    return recipe, run, summary


@pytest.fixture(scope="module")
def prepared(prepared_run, tmp_path_factory):
    """``(recipe, run dir, prepare summary)``: this module's copy of :func:`prepared_run` (its tests
    train into it); the recipe still reads the session's prompts file."""
    recipe, run, summary = prepared_run
    copied = tmp_path_factory.mktemp("run")
    shutil.copytree(run, copied, dirs_exist_ok=True)
    return copy.deepcopy(recipe), copied, copy.deepcopy(summary)


@pytest.fixture(scope="module")
def peagle_run(tiny_target, tmp_path_factory):
    """``(recipe, run dir)``: the tiny target's P-EAGLE run, prepared."""
    from draftsmith.data_prep.prepare import prepare

    run = tmp_path_factory.mktemp("peagle_run")
    recipe = peagle_recipe(tiny_target, write_prompts(run / "prompts.jsonl"))
    prepare(recipe, run)
    return recipe, run


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """A tiny target directory (vLLM's ``ModelConfig`` of the verifier) and vLLM's single-process
    distributed state (tensor parallel 1, gloo), torn down after the module."""
    from helpers.vllm_parity import vllm_distributed

    with vllm_distributed(tmp_path_factory.mktemp("parity_target")) as target:
        yield target
