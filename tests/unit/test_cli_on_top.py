"""The command line sits on top of the package: every parser and ``main(argv)`` lives in cli/, which
calls the stages' typed functions, and no module outside cli/ imports it (root modules included).
The training launch points (``accelerate launch -m draftsmith.train``, ``accelerate launch
train/eagle3.py``) are the command line run by accelerate: they import it and nothing else."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from test_import_structure import ENTRY_SCRIPTS, ROOT, imported_modules, package_modules


def imported_names(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, absolute dotted name)`` of every module ``path`` imports and of every name it imports
    from one (``from .. import cli`` in a package module is ``draftsmith.cli``)."""
    found = list(imported_modules(path, root))
    lines = {line for line, _ in found}
    modules = dict(found)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.lineno in lines:
            found += [(node.lineno, f"{modules[node.lineno]}.{a.name}") for a in node.names]
    return found


def cli_imports(root: Path = ROOT) -> list[str]:
    """``"<module>:<line> imports <name>"`` for each import of ``draftsmith.cli`` (or a module of it)
    by a package module outside cli/ that is not a training launch point."""
    found = []
    for path in package_modules(root):
        rel = path.relative_to(root)
        if rel.parts[0] == "cli" or str(rel) in ENTRY_SCRIPTS:
            continue
        for line, name in imported_names(path, root):
            if name == "draftsmith.cli" or name.startswith("draftsmith.cli."):
                found.append(f"{rel}:{line} imports {name}")
    return sorted(set(found))


def test_no_module_outside_cli_imports_the_command_line():
    assert cli_imports() == []


def test_the_checker_sees_a_module_importing_the_command_line(tmp_path):
    # in a copy of the package: a stage importing a cli module, a root module importing cli itself
    copy = tmp_path / "draftsmith"
    for path in package_modules():
        (copy / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy / path.relative_to(ROOT))
    assert cli_imports(copy) == []
    (copy / "eval" / "_probe.py").write_text("import os\n\nfrom ..cli.export import build_parser\n")
    (copy / "_probe.py").write_text("from .cli import main\n")
    (copy / "serve" / "_probe.py").write_text("def f():\n    from .. import cli\n")
    assert cli_imports(copy) == ["_probe.py:1 imports draftsmith.cli", "_probe.py:1 imports draftsmith.cli.main",
                                 "eval/_probe.py:3 imports draftsmith.cli.export",
                                 "eval/_probe.py:3 imports draftsmith.cli.export.build_parser",
                                 "serve/_probe.py:2 imports draftsmith.cli"]


# runs the command it is given under a parent-death watchdog (procs.bound_command): a process
# wrapper, not a command line of draftsmith's
NOT_COMMAND_LINES = {"procs.py"}


def test_no_module_outside_cli_builds_a_parser():
    # argparse parsers are the command line's; outside cli/ the argparse helpers of the recipe
    # (recipe.py) and of the vLLM engine flags (vllm_bridge/engine.py) only add arguments to them
    builders = []
    for path in package_modules():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "cli" or str(rel) in NOT_COMMAND_LINES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "ArgumentParser":
                builders.append(f"{rel}:{node.lineno}")
    assert builders == []
