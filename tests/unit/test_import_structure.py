"""The package's import structure: relative imports inside it, thin training entry scripts,
and data flowing one way (models <- data_prep <- train <- eval <- serve; vllm_bridge beside them)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from draftsmith.methods import get_method, registered_methods

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = {"tests", "scripts", "benchmarks", "runs", "docs", "recipes", ".venv", "build"}
ENTRY_SCRIPTS = {f"train/{m}.py" for m in registered_methods()}  # run as files
# what each top-level folder may import from the others: the pipeline flows data_prep -> train ->
# eval -> serve with models below all of them and vllm_bridge beside them (it imports no stage)
MAY_IMPORT = {
    "models": set(),
    "vllm_bridge": set(),
    "data_prep": {"models", "vllm_bridge"},
    "train": {"models", "data_prep", "vllm_bridge"},
    "eval": {"models", "data_prep", "train", "vllm_bridge"},
    "serve": {"models", "data_prep", "train", "eval", "vllm_bridge"},
}


def package_modules(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not (set(p.relative_to(root).parts[:-1]) & OUTSIDE) and not p.name.startswith("."))


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, absolute dotted module)`` of every ``from ... import`` in ``path``."""
    rel = path.relative_to(root).with_suffix("")
    package = ["draftsmith", *rel.parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_modules_inside_the_package_import_each_other_relatively():
    absolute = []
    for path in package_modules():
        rel = str(path.relative_to(ROOT))
        if rel in ENTRY_SCRIPTS:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and not node.level else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            absolute += [f"{rel}:{node.lineno} {n}" for n in names if n and n.split(".")[0] == "draftsmith"]
    assert package_modules(), "no package modules found"
    assert absolute == []


@pytest.mark.parametrize("script", sorted(ENTRY_SCRIPTS))
def test_training_entry_scripts_are_thin(script):
    # run as files by `accelerate launch train/<method>.py`: they import the method and call train_main
    tree = ast.parse((ROOT / script).read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert functions == ["main"] and classes == []


def backward_imports(root: Path = ROOT) -> list[str]:
    """``"<module>:<line> imports <module>"`` for each import in the package at ``root`` against the
    flow of :data:`MAY_IMPORT`, and each import of the test suite."""
    backwards = []
    for path in package_modules(root):
        rel = path.relative_to(root)
        folder = rel.parts[0] if len(rel.parts) > 1 else None
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if parts[0] in ("tests", "conftest", "helpers") or parts[:2] == ["draftsmith", "tests"]:
                backwards.append(f"{rel}:{line} imports {module}")
            if folder in MAY_IMPORT and parts[0] == "draftsmith" and len(parts) > 1:
                other = parts[1]
                if other in MAY_IMPORT and other != folder and other not in MAY_IMPORT[folder]:
                    backwards.append(f"{rel}:{line} imports {module}")
    return backwards


def test_data_flows_one_way_and_the_package_never_imports_its_tests():
    assert backward_imports() == []


def test_the_checker_sees_a_backward_import(tmp_path):
    # the scan above must be able to fail: in a copy of the package (the source tree is not
    # written), a data_prep module importing eval and an eval module importing a test helper are caught
    copy = tmp_path / "draftsmith"
    for path in package_modules():
        (copy / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy / path.relative_to(ROOT))
    assert backward_imports(copy) == []
    (copy / "data_prep" / "_layout_probe.py").write_text("from ..eval import export\n")
    (copy / "eval" / "_layout_probe.py").write_text("import os\n\nfrom helpers.tiny import CPU_VLLM\n")
    assert backward_imports(copy) == ["data_prep/_layout_probe.py:1 imports draftsmith.eval",
                                      "eval/_layout_probe.py:3 imports helpers.tiny"]


# the layer each part of a registered method comes from (draftsmith.methods): the method package
# registers its model and format, recipe.py its section, train/ and eval/ attach theirs
PART_LAYERS = {"config_class": "models", "model_class": "models", "format": "models", "recipe_config": "recipe",
               "training_method": "train", "parameter_estimator": "train",
               "proposer_factory": "eval", "target_check": "eval", "vllm_serve_check": "vllm_bridge"}


@pytest.mark.parametrize("name", registered_methods())
def test_registered_parts_live_in_the_layer_that_owns_them(name):
    spec = get_method(name)
    wrong = []
    for part, layer in PART_LAYERS.items():
        obj = getattr(spec, part)
        if obj is None:
            continue
        objects = [obj]
        if part == "format":  # a DraftFormat of models.common: its functions are the method package's
            objects = [obj.detect, obj.export, obj.load, obj.card.facts, obj.card.num_speculative_tokens,
                       *([obj.fit] if obj.fit else [])]
        for o in objects:
            module = getattr(o, "func", o).__module__  # functools.partial: the function it wraps
            parts = module.split(".")
            if parts[0] != "draftsmith" or parts[1] != layer or (layer == "models" and parts[2] not in (name, "common")):
                wrong.append(f"{name}.{part}: {module}")
    assert wrong == []


def test_the_registry_imports_no_layer_at_import_time():
    # methods.py loads the method packages and the train / eval parts on use, never on import
    imports = [m for _, m in imported_modules(ROOT / "methods.py") if m.startswith("draftsmith")]
    assert imports == []
