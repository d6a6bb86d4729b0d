"""Security: weights load without pickle, remote code runs only when the recipe asks, tokens
never reach a run directory or a log, and names from recipes / manifests cannot write (or
read) outside their directory."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.layout import safe_path
from draftsmith.train.run_info import REDACTED, redact_argv

from helpers.fake_inputs import FAKE

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for p in REPO.rglob("*.py") if not {".venv", "tests", "build", "runs"} & set(p.relative_to(REPO).parts)
           and not p.relative_to(REPO).parts[0].startswith(".")]  # .venv-interop, .git


def calls(name: str):
    """(file, line, ast.Call) for every call of an attribute or function called ``name``."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                    yield path.relative_to(REPO), node.lineno, node


def kwarg(node: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def test_every_torch_load_is_weights_only_and_nothing_unpickles():
    for path, line, node in calls("load"):
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch":
            value = kwarg(node, "weights_only")
            assert isinstance(value, ast.Constant) and value.value is True, f"{path}:{line}: torch.load without weights_only=True"
    for bad in ("pickle", "dill", "cloudpickle"):
        assert not [p for p in SOURCES if f"import {bad}" in p.read_text()], f"{bad} imported"


def test_trust_remote_code_is_never_forced_on():
    """Every from_pretrained either leaves trust_remote_code at its default (off) or passes a
    value that comes from the recipe (a name or attribute, never the literal True)."""
    seen = 0
    for path, line, node in calls("from_pretrained"):
        value = kwarg(node, "trust_remote_code")
        if value is None:
            continue
        seen += 1
        assert not isinstance(value, ast.Constant), f"{path}:{line}: trust_remote_code={ast.unparse(value)}"
        assert "trust_remote_code" in ast.unparse(value), f"{path}:{line}: {ast.unparse(value)}"
    assert seen >= 4  # target config, tokenizer, model, draft config at least


REMOTE_CONFIG = '''
from pathlib import Path
from transformers import LlamaConfig

Path(MARKER).touch()  # the side effect remote code could have


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''


@pytest.fixture
def remote_code_target(tiny_target, tmp_path):
    """The tiny target whose config names custom code (``auto_map``), as hub repos with
    remote code do."""
    target = tmp_path / "remote_target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(model_type="tiny_remote", auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig"})
    (target / "config.json").write_text(json.dumps(cfg))
    (target / "configuration_tiny.py").write_text(REMOTE_CONFIG.replace("MARKER", repr(str(tmp_path / "remote_code_ran"))))
    return target


def test_remote_code_runs_only_when_the_recipe_sets_trust_remote_code(remote_code_target, tmp_path):
    from draftsmith.data_prep.prepare import stage_target
    from draftsmith.layout import DataPaths

    paths = DataPaths(tmp_path / "data")
    recipe = load_recipe(None, [f"target.name_or_path={remote_code_target}", "data.aux_layer_ids=[1, 3, 4]"])
    assert recipe.target.trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        stage_target(recipe, paths)
    assert not (tmp_path / "remote_code_ran").exists()

    recipe.target.trust_remote_code = True
    info = stage_target(recipe, paths)
    assert info.hidden_size == 128 and (tmp_path / "remote_code_ran").exists()


def test_redact_argv_forms():
    env = {"HF_TOKEN": FAKE["HF_TOKEN"], "HOME": "/root", "TOKENIZERS_PARALLELISM": "false"}
    argv = ["train.py", "r.yaml", "--hf-token", "abcdefgh1234", "--token=abcdefgh5678", "--set",
            "hub.api_key=zzzzzzzz", f"--push-url=https://user:{FAKE['HF_TOKEN']}@host/x", "--set", "train.lr=1e-3"]
    out = redact_argv(argv, env)
    assert out == ["train.py", "r.yaml", "--hf-token", REDACTED, f"--token={REDACTED}", "--set",
                   f"hub.api_key={REDACTED}", f"--push-url=https://user:{REDACTED}@host/x", "--set", "train.lr=1e-3"]
    assert redact_argv(["--tokenizer", "x/y", "--access-token", "t"], env) == ["--tokenizer", "x/y", "--access-token", REDACTED]


@pytest.mark.parametrize("part", ["../outside", "/etc/passwd", "a/../../outside", "~/x"])
def test_safe_path_refuses_names_leaving_the_root(tmp_path, part):
    with pytest.raises(ValueError, match=r"export\.name"):
        safe_path(tmp_path, part, key="export.name")


def test_safe_path_follows_symlinks_and_allows_plain_names(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="escapes"):
        safe_path(tmp_path / "root", "link", "x")
    assert safe_path(tmp_path / "root", "sub", "ok.json") == tmp_path / "root" / "sub" / "ok.json"


@pytest.mark.parametrize("name", ["../evil", "/abs", "a/b", ".."])
def test_recipe_name_must_be_one_path_component(name):
    with pytest.raises(RecipeError, match="name"):
        load_recipe(None, [f"name={json.dumps(name)}"])
