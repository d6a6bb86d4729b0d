"""Facts read from a vLLM source tree without importing it (``ast``): the speculative methods its
config accepts and the architectures its model registry loads. Used on the installed vLLM (found,
not imported) and on the vLLM 0.33 sources of the interop environment."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def installed_vllm_package() -> Path | None:
    """The installed ``vllm`` package folder, found without importing it; None without one."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def literal_values(source: Path, name: str) -> set[str]:
    """The strings of the module-level ``name = Literal[...]`` in ``source``, nested aliases
    (``EagleModelTypes``) resolved."""
    aliases: dict[str, ast.expr] = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id == "Literal":
                aliases[node.targets[0].id] = value.slice

    def resolve(expr: ast.expr) -> set[str]:
        if isinstance(expr, ast.Tuple):
            return set().union(*(resolve(e) for e in expr.elts))
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, ast.Name) and expr.id in aliases:
            return resolve(aliases[expr.id])
        raise ValueError(f"{source}: {ast.unparse(expr)} in {name} is neither a string nor a Literal alias")

    if name not in aliases:
        raise ValueError(f"{source}: no module-level {name} = Literal[...]")
    return resolve(aliases[name])


def registered_architectures(registry: Path) -> dict[str, tuple[str, str]]:
    """Architecture -> ``(module, class)`` of every ``"Arch": ("module", "Class")`` entry in the
    model registry file ``registry`` (``vllm/model_executor/models/registry.py``); commented-out
    entries are not in it."""
    found: dict[str, tuple[str, str]] = {}
    for node in ast.walk(ast.parse(registry.read_text())):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values):
            if (isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Tuple)
                    and len(value.elts) == 2 and all(isinstance(e, ast.Constant) for e in value.elts)):
                found[key.value] = (value.elts[0].value, value.elts[1].value)
    return found
