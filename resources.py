"""The files shipped inside the draftsmith package, found beside this module: in a checkout (the
repository root is the package) and in an installed wheel alike (pyproject.toml's package-data).

- ``recipes/*.yaml``: the shipped recipes; :func:`resolve_recipe` lets a command line name one
  (``gptoss120b``, ``gptoss120b.yaml`` or ``recipes/gptoss120b.yaml``) from any directory;
- ``recipes/accelerate/*.yaml``: their launchers (``train/launchers.py`` resolves a recipe's
  ``launcher:`` against the package root);
- ``recipes/targets/<hub id>/config.json``: the GPU targets' configs (``target/resolve.py``);
- ``data_prep/prompts/*.jsonl``: the built-in prompt sets (``data_prep/conversations.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
RECIPES_DIR = PACKAGE_ROOT / "recipes"


def shipped_recipe_names() -> list[str]:
    """Names of the shipped recipes (``recipes/<name>.yaml``), sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def shipped_recipe(name: str | Path) -> Path | None:
    """The shipped recipe ``name`` refers to (``gptoss120b``, ``gptoss120b.yaml`` or
    ``recipes/gptoss120b.yaml``), or None."""
    parts = Path(name).parts
    if len(parts) == 2 and parts[0] == "recipes":
        parts = parts[1:]
    if len(parts) != 1 or parts[0] in (".", ".."):
        return None
    stem = parts[0].removesuffix(".yaml")
    path = RECIPES_DIR / f"{stem}.yaml"
    return path if stem in shipped_recipe_names() else None


def resolve_recipe(path: str | Path) -> Path | None:
    """The recipe file ``path`` names: ``path`` itself when it exists (a path that exists always
    wins), else the shipped recipe of that name (:func:`shipped_recipe`; logged at INFO), else None."""
    given = Path(path)
    if given.exists():
        return given
    shipped = shipped_recipe(given)
    if shipped is not None:
        logging.getLogger("draftsmith.recipe").info("recipe %s: no such file here; using the shipped %s",
                                                    path, shipped)
    return shipped
