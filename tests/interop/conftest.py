"""The interop environment: speculators 0.9.0 in ``.venv-interop`` and the vLLM 0.33.0 wheel's
Python sources in ``.venv-interop/vllm-0.33.0`` (both built by ``make interop``).

speculators cannot share draftsmith's environment (its pins conflict with ours), so a test runs
its speculators side as a script in the interop interpreter (:func:`run_speculators`) and
exchanges tensors with draftsmith through safetensors files in ``tmp_path``. Without the
environment every test here skips, naming ``make interop``.

``DRAFTSMITH_INTEROP_PYTHON`` / ``DRAFTSMITH_VLLM_NEXT_SRC`` point at another interpreter /
source tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / ".venv-interop"
VLLM_NEXT = "0.33.0"
SPECULATORS = "0.9.0"
BUILD = "`make interop` builds it"


def _interop_python() -> Path:
    return Path(os.environ.get("DRAFTSMITH_INTEROP_PYTHON", INTEROP / "bin" / "python"))


@pytest.fixture(scope="session")
def speculators_python() -> Path:
    """The interop interpreter, checked to import speculators 0.9.0 (skips otherwise)."""
    python = _interop_python()
    if not python.exists():
        pytest.skip(f"no speculators {SPECULATORS} environment at {python}: {BUILD}")
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('speculators'))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 or probe.stdout.strip() != SPECULATORS:
        pytest.skip(f"{python} has no speculators {SPECULATORS} ({(probe.stdout + probe.stderr).strip()[-200:]}): {BUILD}")
    return python


@pytest.fixture(scope="session")
def vllm_next_src() -> Path:
    """The vLLM 0.33.0 wheel's Python sources (the folder holding ``vllm/``; skips without it)."""
    src = Path(os.environ.get("DRAFTSMITH_VLLM_NEXT_SRC", INTEROP / f"vllm-{VLLM_NEXT}"))
    if not (src / "vllm" / "transformers_utils" / "configs" / "speculators" / "algos.py").exists():
        pytest.skip(f"no vLLM {VLLM_NEXT} sources at {src}: {BUILD}")
    return src


def run_speculators(python: Path, script: str, *args: str, timeout: int = 600) -> str:
    """Run ``script`` (Python source) in the interop interpreter with ``args`` as ``sys.argv[1:]``;
    its stdout. Fails the test with the script's stderr when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        pytest.fail(f"the speculators side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def both_sides(run, script: str, build_args: list[str], kinds, export, inputs: dict, root: Path) -> dict:
    """speculators' checkpoints of ``kinds`` (``script build *build_args KINDS root/speculators``)
    beside draftsmith's exports (``export(kind, root/draftsmith/kind)``), then the library's
    outputs on each for the same ``inputs`` (``script run JOBS inputs``; one JSON config line per
    job): ``{"root", "configs": {(side, kind): dict}, (side, kind): folder}``, side ``speculators``
    or ``draftsmith``. ``run`` is :func:`in_speculators` (the :func:`two_sided` fixture binds it);
    two interop runs in all."""
    from safetensors.torch import save_file

    run(script, "build", *build_args, json.dumps(kinds), str(root / "speculators"))
    folders = {("speculators", k): root / "speculators" / k for k in kinds}
    folders.update({("draftsmith", k): export(k, root / "draftsmith" / k) for k in kinds})
    save_file(inputs, str(root / "inputs.safetensors"))
    jobs = [(k, str(f), str(root / f"out_{side}_{k}.safetensors")) for (side, k), f in folders.items()]
    printed = run(script, "run", json.dumps(jobs), str(root / "inputs.safetensors"))
    configs = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert len(configs) == len(jobs), printed
    return {"root": root, "configs": dict(zip(folders, configs)), **folders}


@pytest.fixture(scope="session")
def in_speculators(speculators_python):
    """``in_speculators(script, *args)``: :func:`run_speculators` in the interop interpreter."""
    def run(script: str, *args: str, timeout: int = 600) -> str:
        return run_speculators(speculators_python, script, *args, timeout=timeout)
    return run


@pytest.fixture(scope="session")
def two_sided(in_speculators):
    """:func:`both_sides` in the interop interpreter."""
    def run(*args):
        return both_sides(in_speculators, *args)
    return run
