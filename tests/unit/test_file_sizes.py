"""No package module is longer than 650 lines: each file does one job (issue 42). The test suite,
benchmarks/ and scripts/ are not package files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = {"tests", "benchmarks", "scripts", "runs", "docs", "recipes", ".venv", "build"}
MAX_LINES = 650


def package_files(root: Path = ROOT) -> list[Path]:
    """The package's ``.py`` files: every one under ``root`` outside :data:`OUTSIDE` and hidden folders."""
    return sorted(p for p in root.rglob("*.py")
                  if not (set(p.relative_to(root).parts[:-1]) & OUTSIDE)
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def too_long(root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """``"<file>: <lines> lines"`` for each package file over ``limit`` lines."""
    lengths = {p: len(p.read_text().splitlines()) for p in package_files(root)}
    return [f"{p.relative_to(root)}: {n} lines" for p, n in lengths.items() if n > limit]


def test_no_package_file_is_over_650_lines():
    assert package_files(), "no package files found"
    assert too_long() == []


def test_the_checker_sees_a_long_file_and_skips_the_folders_outside(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "train" / "short.py").write_text("x = 1\n" * MAX_LINES)
    for outside in ("tests", "benchmarks", "scripts", ".venv"):
        (tmp_path / outside).mkdir()
        (tmp_path / outside / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert too_long(tmp_path) == [f"train/long.py: {MAX_LINES + 1} lines"]


def test_the_readme_stays_a_front_page():
    # the house plan lives in docs/developer.md; the README keeps set-up, the GPU start and the commands
    assert len((ROOT / "README.md").read_bytes()) < 10_000
