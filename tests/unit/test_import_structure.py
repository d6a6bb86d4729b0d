"""The package's import structure: relative imports inside it, thin training entry scripts,
and data flowing one way (target <- models <- data_prep <- train <- eval <- serve; vllm_bridge beside
them; a method package's training / proposer modules in the train / eval layer)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from draftsmith.methods import get_method, registered_methods

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = {"tests", "scripts", "benchmarks", "runs", "docs", "recipes", ".venv", "build"}
# the training launch points (absolute imports): the launch module of every method (`accelerate launch -m
# draftsmith.train`) and the published EAGLE-3 file (`accelerate launch train/eagle3.py`)
ENTRY_SCRIPTS = {"train/__main__.py", "train/eagle3.py"}
# what each top-level folder may import from the others: the pipeline flows data_prep -> train ->
# eval -> serve with models below all of them, the target room below models, and vllm_bridge beside
# them (it imports no stage); cli/ is on top (tests/unit/test_cli_on_top.py)
MAY_IMPORT = {
    "target": {"vllm_bridge"},
    "models": {"target"},
    "vllm_bridge": set(),
    "data_prep": {"target", "models", "vllm_bridge"},
    "train": {"target", "models", "data_prep", "vllm_bridge"},
    "eval": {"target", "models", "data_prep", "train", "vllm_bridge"},
    "serve": {"target", "models", "data_prep", "train", "eval", "vllm_bridge"},
}


# a draft method is one package, models/<name>/ (draftsmith.methods): its model floor (__init__, recipe,
# config, model, format) sits with models/ and imports no stage folder; these modules of it belong to
# the layer named here and import what that layer may
METHOD_MODULE_LAYERS = {"training.py": "train", "warm_start.py": "train", "proposer.py": "eval", "simulate.py": "eval"}
BUILTIN_METHODS = {spec.package.split(".")[-1] for spec in map(get_method, registered_methods())
                   if spec.package.startswith("draftsmith.models.")}  # the built-in method packages


def layer_of(rel: tuple[str, ...]) -> str | None:
    """The layer (a :data:`MAY_IMPORT` key) of the package module or module path ``rel``
    (``("models", "dflash", "proposer.py")``, or a dotted module's parts after ``draftsmith``),
    None for the root modules."""
    rel = tuple(rel)
    if len(rel) >= 3 and rel[0] == "models" and rel[1] in BUILTIN_METHODS:
        stem = rel[2] if rel[2].endswith(".py") else f"{rel[2]}.py"
        return METHOD_MODULE_LAYERS.get(stem, "models")
    return rel[0] if len(rel) > 1 else None


def package_modules(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not (set(p.relative_to(root).parts[:-1]) & OUTSIDE) and not p.name.startswith(".")
                  and not p.relative_to(root).parts[0].startswith("."))  # .venv-interop, .git, .ci


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
    # run by accelerate / torchrun: they import the training command line (cli/train.py) and call it
    tree = ast.parse((ROOT / script).read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    imports = [m for _, m in imported_modules(ROOT / script) if m.startswith("draftsmith")]
    assert functions in ([], ["main"]) and classes == [] and imports == ["draftsmith.cli.train"]


def backward_imports(root: Path = ROOT) -> list[str]:
    """``"<module>:<line> imports <module>"`` for each import in the package at ``root`` against the
    flow of :data:`MAY_IMPORT`, and each import of the test suite."""
    backwards = []
    for path in package_modules(root):
        rel = path.relative_to(root)
        folder = layer_of(rel.parts)
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if parts[0] in ("tests", "conftest", "helpers") or parts[:2] == ["draftsmith", "tests"]:
                backwards.append(f"{rel}:{line} imports {module}")
            if folder in MAY_IMPORT and parts[0] == "draftsmith" and len(parts) > 1:
                other = layer_of(parts[1:]) if len(parts) > 2 else parts[1]
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


def method_imports(root: Path = ROOT) -> list[str]:
    """``"<module>:<line> imports <module>"`` for each import of a built-in method package
    (``draftsmith.models.<name>``) by a module outside every method package: nothing outside a
    method's folder names the method (a method package may build on another's: dspark on dflash)."""
    found = []
    for path in package_modules(root):
        rel = path.relative_to(root)
        if len(rel.parts) >= 3 and rel.parts[0] == "models" and rel.parts[1] in BUILTIN_METHODS:
            continue
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if parts[:2] == ["draftsmith", "models"] and len(parts) > 2 and parts[2] in BUILTIN_METHODS:
                found.append(f"{rel}:{line} imports {module}")
    return found


def test_only_a_methods_own_package_imports_it():
    assert method_imports() == []


def test_the_checker_sees_a_method_package_import_out_of_place(tmp_path):
    # in a copy of the package: a model floor importing train, a training module importing eval, a
    # proposer importing serve, a train module importing a proposer, and a generic module naming a method
    copy = tmp_path / "draftsmith"
    for path in package_modules():
        (copy / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy / path.relative_to(ROOT))
    floor, planted = copy / "models" / "medusa", []
    (floor / "_probe_floor.py").write_text("from ...train import optim\nfrom ..common import RMSNorm\n")
    (floor / "training.py").write_text("from ...eval import export\nfrom ...train import optim\n")
    (floor / "proposer.py").write_text("from ...serve import proxy\nfrom ...eval import spec_decode\n")
    (copy / "train" / "_probe.py").write_text("from ..models.medusa.proposer import MedusaProposer\n")
    (copy / "eval" / "_probe.py").write_text("from ..models.medusa import model\n")
    assert backward_imports(copy) == ["models/medusa/_probe_floor.py:1 imports draftsmith.train",
                                      "models/medusa/proposer.py:1 imports draftsmith.serve",
                                      "models/medusa/training.py:1 imports draftsmith.eval",
                                      "train/_probe.py:1 imports draftsmith.models.medusa.proposer"]
    assert [m for m in method_imports(copy) if "_probe" in m] == [
        "eval/_probe.py:1 imports draftsmith.models.medusa", "train/_probe.py:1 imports draftsmith.models.medusa.proposer"]


@pytest.mark.parametrize("name", sorted(BUILTIN_METHODS))
def test_a_method_package_registers_with_the_registry_alone(name):
    # its parts are lazy strings: listing the methods and loading a recipe stay free of torch
    imports = [m for _, m in imported_modules(ROOT / "models" / name / "__init__.py")]
    assert imports == ["draftsmith.methods"]


def test_loading_a_recipe_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from draftsmith.recipe import load_recipe; from draftsmith.methods import registered_methods; "
            "[load_recipe(None, [f'draft.method={m}']) for m in registered_methods()]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# every part of a registered method lives in its own package (draftsmith.methods)
PARTS = ("recipe_config", "config_class", "model_class", "format", "training_method", "parameter_estimator",
         "activation_estimator", "proposer_factory", "target_check", "vllm_serve_check", "simulator")


@pytest.mark.parametrize("name", registered_methods())
def test_registered_parts_live_in_the_methods_package(name):
    spec = get_method(name)
    wrong = []
    for part in PARTS:
        obj = getattr(spec, part)
        if obj is None:
            continue
        objects = [obj]
        if part == "format":  # a DraftFormat of models.common: its functions are the method package's
            objects = [obj.detect, obj.export, obj.load, obj.card.facts, obj.card.num_speculative_tokens,
                       *([obj.fit] if obj.fit else [])]
        for o in objects:
            module = getattr(o, "func", o).__module__  # functools.partial: the function it wraps
            if not (module.startswith(spec.package + ".") or module == "draftsmith.models.common"):
                wrong.append(f"{name}.{part}: {module}")
    assert wrong == []


def test_the_registry_imports_no_layer_at_import_time():
    # methods.py loads the method packages and the train / eval parts on use, never on import
    imports = [m for _, m in imported_modules(ROOT / "methods.py") if m.startswith("draftsmith")]
    assert imports == []
