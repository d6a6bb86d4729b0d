"""Package discovery for the wheel and the editable install; everything else is in pyproject.toml.

The repository root *is* the ``draftsmith`` package (pyproject: ``package-dir = {"draftsmith" = "."}``).
pyproject's ``[tool.setuptools.packages.find]`` cannot say so: it names what it finds after the
folder it searches (``models``, not ``draftsmith.models``), so the packages are found here, every
folder below the root with an ``__init__.py``, prefixed. The data files beside them (recipes/,
data_prep/prompts/) are pyproject's ``package-data``.
"""

from pathlib import Path

from setuptools import find_packages, setup

# folders that run from a checkout only (the test suite, draftsmith's own benchmarks, maintainer
# scripts) or are outputs (runs, build trees); .venv, .git and folders without an __init__.py
# (docs/, recipes/) are never packages to find_packages
EXCLUDE = ["tests", "benchmarks", "scripts", "runs", "build", "dist", "outputs", "wandb", "docs", "recipes"]

setup(
    packages=["draftsmith", *(f"draftsmith.{name}" for name in find_packages(
        Path(__file__).resolve().parent, exclude=[p for name in EXCLUDE for p in (name, f"{name}.*")]))],
    # the build backend runs this file under another name: without it, build_py ships setup.py
    # itself as draftsmith/setup.py (it leaves out the setup script by this name)
    script_name="setup.py",
)
