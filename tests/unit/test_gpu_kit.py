"""The lent GPU machine's run of scripts/gpu_step_checks.sh (docs/gpu_checks.md): its plan fits one
call, and every third-party package the checks import is on that machine or in the kit of wheels
(scripts/gpu_kit.sh, ``make gpu-kit``) that travels with the checkout.

The import walk: from what the script runs (tests/gpu/test_gpu_step.py with tests/conftest.py, which
pytest loads first, benchmarks/gpu.py, benchmarks/step.py), every module of the checkout they reach
(``draftsmith.*``: the repository root; ``benchmarks.*``; ``helpers.*``: tests/helpers), followed
through ``import`` / ``from ... import`` statements at module level AND inside functions, methods and
classes, and through the module names the method registry imports from strings
(``"draftsmith.models.eagle3"`` in methods.py, :data:`STRING_IMPORTS`; ``".training:Eagle3Method"``,
a part of a method package).
Every top-level name outside the standard library is third-party. Not counted: imports under
``if TYPE_CHECKING:`` (never executed). Counted, but allowed without the package on the machine:
:data:`NOT_ON_MACHINE` (imports inside functions of the listed files only; none at module level).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_step_checks.sh"
KIT_SCRIPT = REPO / "scripts" / "gpu_kit.sh"
WHEELS = REPO / "gpu_kit" / "wheels"
BUDGET_S = 540  # the one device call must end by then (600 s a call, 900 s a loan with the start)
MAX_FILES = 8  # files that come back from $OUT

# The lent H200 machine's python3 (/opt/torch/.venv, Python 3.12) already has these, by the import
# name the code uses. Each: why it is there (the device tool's package list of the image, and the
# pip list of a session that ran on it: torch 2.11.0, triton 3.6.0, transformers 5.17.0,
# accelerate 1.15.0) and what it is for here. Only packages the walk below can reach are listed.
LENT_MACHINE = {
    "torch": "the image's PyTorch (2.11.0+cu130): everything",
    "triton": "the image's Triton (3.6.0), torch's compiler backend: the fused loss kernel",
    "transformers": "the image's (5.17.0): target configs and layers",
    "accelerate": "the image's (1.15.0): the launcher settings the benchmarks read",
    "pytest": "the image's (with pytest-timeout): tests/gpu",
    "numpy": "the image's (2.5.2); required by transformers and accelerate",
    "safetensors": "the image's (0.8.0); required by transformers (>=0.8.0) and accelerate",
    "huggingface_hub": "the image's (1.33.0); required by transformers (>=1.31,<3)",
    "tokenizers": "the image's (0.23.2); required by transformers (>=0.23.1,<0.24): tests/helpers/tiny.py",
    "yaml": "pyyaml, in the image; required by transformers and accelerate: recipe.py reads recipes",
    "tqdm": "in the image; required by transformers (>=4.60)",
    "psutil": "in the image; required by accelerate: benchmarks/gpu.py's host memory on a CPU",
    "typing_extensions": "in the image, required by torch (>=4.10); the kit brings 4.16.0 (pydantic needs it)",
}

# Reached by the walk, absent from the lent machine, and never imported by what the checks run:
# each only inside functions of the files listed (a module-level import anywhere, or an import in
# another file, fails the test: decide then whether the kit must carry it).
NOT_ON_MACHINE = {
    "datasets": ("prepared runs' Arrow datasets (tokenising, loading a run directory): the checks build "
                 "random batches in memory (benchmarks.memory.random_batch) and read no run directory",
                 {"layout.py", "data_prep/conversations.py", "data_prep/prepare.py", "train/data.py"}),
    "vllm": ("regeneration, hidden-state capture and acceptance through vLLM, which is not on the machine "
             "(and pins another torch); the checks capture nothing (--no-capture) and serve nothing",
             {"data_prep/chat_engines.py", "target/vllm_capture.py", "eval/acceptance.py",
              "vllm_bridge/spec_config.py", "vllm_bridge/weight_update.py", "tests/helpers/vllm_parity.py"}),
    "openai": ("the OpenAI-compatible client of regeneration against a server",
               {"data_prep/chat_engines.py"}),
    "jinja2": ("the chat template's own variables (data.chat_template_kwargs checked against a thinking template): "
               "the checks tokenise no conversation (torch requires jinja2, but the image's list was not read for it)",
               {"data_prep/served_turns.py"}),
}

# where the checkout's top-level packages live (as the script makes them importable)
LOCAL = {"draftsmith": REPO, "benchmarks": REPO / "benchmarks", "helpers": REPO / "tests" / "helpers"}
ROOTS = [REPO / "tests" / "gpu" / "test_gpu_step.py", REPO / "tests" / "conftest.py",
         REPO / "benchmarks" / "gpu.py", REPO / "benchmarks" / "step.py"]
_ABS_REF = re.compile(r"^(draftsmith(?:\.\w+)+)(?::\w+)?$")
# the modules that import others named in strings, which the walk follows there (elsewhere such
# strings are logger names, or cli/__init__.py's subcommand table, imported only by `draftsmith CMD`)
STRING_IMPORTS = {"methods.py": "the method registry's _load() imports METHOD_PACKAGES on first use"}
_REL_REF = re.compile(r"^(\.\w+(?:\.\w+)*):\w+$")


@dataclass(frozen=True)
class Site:
    """One import of a third-party top-level package."""

    package: str
    file: str  # relative to the repository root
    line: int
    function_level: bool


def kit_wheels() -> dict[str, str]:
    """``{distribution: version}`` of scripts/gpu_kit.sh's WHEELS, each line with its comment."""
    text = KIT_SCRIPT.read_text()
    block = text.split("WHEELS=(", 1)[1].split("\n)", 1)[0]
    out = {}
    for line in block.strip().splitlines():
        m = re.fullmatch(r'\s*"([A-Za-z0-9_.-]+)==([^"]+)"\s*#\s*(\S.*)', line)
        assert m, f"scripts/gpu_kit.sh WHEELS: one '\"name==version\"  # why' a line, got {line!r}"
        out[m.group(1)] = m.group(2)
    return out


def import_name(distribution: str) -> str:
    return distribution.lower().replace("-", "_")


def _resolve(module: str) -> Path | None:
    parts = module.split(".")
    base = LOCAL.get(parts[0])
    if base is None:
        return None
    path = base.joinpath(*parts[1:])
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def _module_name(path: Path) -> tuple[str, bool]:
    for top, base in sorted(LOCAL.items(), key=lambda kv: -len(kv[1].parts)):
        if path.is_relative_to(base):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            return ".".join([top, *parts]), is_package
    raise AssertionError(f"{path} is outside the checkout's packages")


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """``(node, function_level)`` for every import statement and every string constant, skipping
    ``if TYPE_CHECKING:`` blocks."""
    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    yield from visit_one(orelse, in_function)
                continue
            yield from visit_one(child, in_function)

    def visit_one(node: ast.AST, in_function: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or \
                (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            yield node, in_function
        yield from visit(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from visit(tree, False)


def walk_imports(roots: list[Path] = ROOTS) -> tuple[set[Path], list[Site]]:
    """The checkout's modules reached from ``roots`` and the third-party import sites in them."""
    seen: set[Path] = set()
    sites: list[Site] = []
    todo = [p.resolve() for p in roots]

    def local(module: str) -> None:  # the module and the packages above it (their __init__ runs)
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            path = _resolve(".".join(parts[:i]))
            if path is not None:
                todo.append(path.resolve())

    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        name, is_package = _module_name(path)
        package = name.split(".") if is_package else name.split(".")[:-1]
        rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        for node, in_function in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant):  # the registry's module references
                m = _ABS_REF.match(node.value)
                if m and rel in STRING_IMPORTS:
                    local(m.group(1))
                elif is_package and _REL_REF.match(node.value):
                    local(".".join(package) + node.value.split(":")[0])
                continue
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                if node.level:
                    base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                modules = [base, *(f"{base}.{a.name}" for a in node.names)]
            for module in modules:
                top = module.split(".")[0]
                if top in LOCAL:
                    local(module)
                elif top and top not in sys.stdlib_module_names and top != "__future__":
                    sites.append(Site(top, rel, node.lineno, in_function))
    return seen, sites


def dry_run(*args: str) -> str:
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr
    return res.stdout


# ---------------------------------------------------------------------------------------------


def test_the_scripts_parse():
    for script in (SCRIPT, KIT_SCRIPT):
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, f"{script.name}: {res.stderr}"


@pytest.mark.parametrize("args", [(), ("--tiny",), ("--device", "cpu")], ids=["gpu", "gpu-tiny", "cpu"])
def test_the_plan_fits_one_call_and_brings_back_at_most_8_files(args):
    out = dry_run(*args)
    total = int(re.search(r"^total_worst_case_s=(\d+)$", out, re.M).group(1))
    assert total <= BUDGET_S, out
    files = re.search(r"^output_files=(\d+) \(at most 8\): (.*)$", out, re.M)
    names = files.group(2).split()
    assert int(files.group(1)) == len(names) <= MAX_FILES, out
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), names  # what the device tool brings back
    for step in ("kit", "a_env", "b_tests", "c_default_", "d_control_", "e_bench_step"):
        assert re.search(rf"^{step}", out, re.M), f"step {step} missing from the plan:\n{out}"
    assert "python" not in re.findall(r"^\s+\$ (\S+)", out, re.M), "the lent machine has python3, no `python`"


def test_the_plan_runs_what_the_brief_needs_offline():
    out = dry_run()
    assert "-m pytest" in out and "-m gpu tests/gpu/test_gpu_step.py" in out
    assert "--recipes gptoss120b --backends flex" in out and "--recipes llama3_1_8b --backends flex" in out
    control = next(line for line in out.splitlines() if "--backends sdpa" in line)
    assert "--lengths full" in control and "--recipes gptoss120b" in control
    script = SCRIPT.read_text()
    for var in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "TRITON_CACHE_DIR=", "TORCHINDUCTOR_CACHE_DIR="):
        assert var in script
    assert "--no-index --no-deps" in script and 'ln -sfn "$REPO" "$RUN/pkgs/draftsmith"' in script


def test_the_control_turns_off_what_the_measured_step_lacked():
    """The control's --set list equals benchmarks.step's MEASURED_SETS where the checkout has it."""
    sets = re.search(r"^AS_MEASURED=\((.*)\)$", SCRIPT.read_text(), re.M).group(1).split()
    assert {"train.fused_loss=false", "train.compile=false", "train.packing=false"} <= set(sets)
    from benchmarks import step

    measured = getattr(step, "MEASURED_SETS", None)
    if measured is not None:
        assert sorted(sets) == sorted(measured)


def test_the_kit_lists_each_wheel_pinned_with_a_reason():
    wheels = kit_wheels()
    assert {"pydantic", "pydantic-core", "annotated-types", "typing-inspection"} <= set(wheels)
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in wheels.values()), wheels


def test_every_third_party_import_the_checks_reach_is_on_the_machine_or_in_the_kit():
    modules, sites = walk_imports()
    assert len(modules) > 50, "the walk found too few of the checkout's modules"
    kit = {import_name(d) for d in kit_wheels()}
    covered = set(LENT_MACHINE) | kit
    problems = []
    for s in sites:
        if s.package in covered:
            continue
        if s.package in NOT_ON_MACHINE:
            why, files = NOT_ON_MACHINE[s.package]
            if s.function_level and s.file in files:
                continue
            where = "at module level" if not s.function_level else "in a file not listed in NOT_ON_MACHINE"
            problems.append(f"{s.file}:{s.line}: `{s.package}` {where}; it is not on the lent machine")
            continue
        problems.append(f"{s.file}:{s.line}: `{s.package}` is neither on the lent machine (LENT_MACHINE) nor in "
                        "the kit (scripts/gpu_kit.sh WHEELS)")
    assert not problems, "\n".join(problems)
    reached = {(s.package, s.file) for s in sites}
    stale = [f"{pkg}: {f}" for pkg, (_, files) in NOT_ON_MACHINE.items() for f in files if (pkg, f) not in reached]
    assert not stale, f"NOT_ON_MACHINE lists files the checks no longer reach with that import: {stale}"


def test_the_walk_sees_module_level_and_function_level_imports():
    """What the walk is relied on to catch: pydantic at module level, datasets only inside functions,
    the method packages the registry imports by name, the fused loss's Triton."""
    modules, sites = walk_imports()
    rel = {p.relative_to(REPO).as_posix() for p in modules}
    assert {"recipe.py", "train/fused_loss.py", "models/eagle3/training.py", "benchmarks/memory.py",
            "tests/helpers/tiny.py"} <= rel
    by = {(s.package, s.function_level) for s in sites}
    assert ("pydantic", False) in by and ("triton", False) in by
    assert ("datasets", True) in by and ("datasets", False) not in by


def test_an_uncovered_import_fails_the_walk(tmp_path, monkeypatch):
    """A module-level import of a package the machine lacks, anywhere the checks reach, is caught;
    so is a function-level import of an excluded package in a file not listed."""
    fake = tmp_path / "benchmarks"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "gpu.py").write_text("import torch\nimport not_on_the_machine_pkg\nfrom draftsmith.train import fused_loss\n"
                                 "def f():\n    import datasets\n")
    monkeypatch.setitem(LOCAL, "benchmarks", fake)
    modules, sites = walk_imports([fake / "gpu.py"])
    found = {(s.package, s.function_level) for s in sites}
    assert ("not_on_the_machine_pkg", False) in found
    assert ("datasets", True) in found
    covered = set(LENT_MACHINE) | {import_name(d) for d in kit_wheels()}
    assert "not_on_the_machine_pkg" not in covered


# Requirements of a kit wheel that the checks never import: speculators' Eagle3DraftModel is imported with
# its data-pipeline module stubbed (benchmarks/vs_speculators.py), and speculators/models, config, model,
# losses and proposals import none of these at module level (its CLI, trainer and data generation do).
NOT_IMPORTED = {"speculators": {import_name(n) for n in (
    "aiohttp", "click", "datasets", "httpx", "openai", "protobuf", "pydantic-settings", "rich", "torchaudio",
    "torchvision", "typer", "hs-connectors")}}


@pytest.mark.skipif(not WHEELS.is_dir() or not any(WHEELS.glob("*.whl")),
                    reason="gpu_kit/wheels not built (`make gpu-kit`)")
def test_the_built_kit_holds_the_list_and_covers_its_own_requirements():
    """gpu_kit/wheels: one wheel per WHEELS line at its version, for cp312 manylinux x86_64 or pure
    Python, under 64 MiB; each wheel's requirements (no extras) are in the kit or on the machine."""
    wheels = kit_wheels()
    found = {}
    total = 0
    for whl in WHEELS.glob("*.whl"):
        total += whl.stat().st_size
        name, version, *_, tag = whl.stem.split("-")  # name-version(-build)-python-abi-platform
        found[import_name(name)] = version
        assert tag.endswith("any") or ("x86_64" in tag and "manylinux" in tag), whl.name
        assert "cp312" in whl.name or "py3-none-any" in whl.name, whl.name
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            msg = Parser().parsestr(z.read(meta).decode())
        for req in msg.get_all("Requires-Dist") or []:
            if "extra ==" in req:
                continue
            marker = Requirement(req).marker  # the lent machine: Linux x86_64, CPython 3.12
            if marker is not None and not marker.evaluate({"sys_platform": "linux", "platform_system": "Linux",
                                                           "platform_machine": "x86_64", "python_version": "3.12",
                                                           "implementation_name": "cpython", "extra": ""}):
                continue
            dep = import_name(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
            if dep in NOT_IMPORTED.get(import_name(name), ()):
                continue
            assert dep in found or dep in {import_name(d) for d in wheels} or dep in LENT_MACHINE, \
                f"{whl.name} requires {req}: neither in the kit nor on the machine"
    assert found == {import_name(d): v for d, v in wheels.items()}, "gpu_kit/wheels is stale: `make gpu-kit`"
    assert total < 64 * 2**20


def _python_3_12() -> str | None:
    """A working Python 3.12 on this machine (the lent machine's version), or None."""
    candidates = [shutil.which("python3.12"), *map(str, sorted(Path("/root/.pyenv/versions").glob("3.12*/bin/python3")))]
    for exe in filter(None, candidates):
        try:
            ok = subprocess.run([exe, "-c", "import sys, pip; assert sys.version_info[:2] == (3, 12)"],
                                capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return exe
    return None


PY312 = _python_3_12()


@pytest.mark.skipif(PY312 is None or not WHEELS.is_dir() or not any(WHEELS.glob("*.whl")),
                    reason="needs a Python 3.12 and gpu_kit/wheels (`make gpu-kit`)")
def test_the_kit_installs_offline_into_a_target_folder_and_imports_on_python_3_12(tmp_path):
    """The script's install command, on the interpreter version of the lent machine: no index, no
    dependencies resolved, into a --target folder; then pydantic validates a model from there."""
    site = tmp_path / "site"
    res = subprocess.run([str(PY312), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                          "--no-deps", "--no-compile", "--target", str(site), *map(str, WHEELS.glob("*.whl"))],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    code = ("import pydantic, pydantic_core, typing_extensions; "
            "M = type('M', (pydantic.BaseModel,), {'__annotations__': {'x': int}}); "
            "assert M(x='3').x == 3; print(pydantic.__file__)")
    res = subprocess.run([str(PY312), "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(site))
