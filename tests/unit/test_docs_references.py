"""References to documentation: every ``docs/<name>.md`` a tracked file names exists, every
relative ``.md`` link in README.md and docs/ resolves, and no file names a document that is not
part of the repository (notes kept outside it, which users do not have)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# files whose text is read: source, tests, recipes, build and documentation files
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".sh", ".json", ".ini"}
TEXT_NAMES = {"Makefile", "README", "run"}
DOCS_PATH = re.compile(r"docs/([A-Za-z0-9_.\-/]+?\.md)\b")
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
# Documents outside the repository; the names are assembled so that this file does not name them.
OUTSIDE_DOCS = ("SPEC", "SPEC" + "_DFLASH_PEAGLE", "GPU", "GPU" + "_REVIEW", "REVIEW" + "_ARCHITECTURE", "STYLE")
FORBIDDEN = re.compile(
    r"\b(?:" + "|".join(re.escape(n) for n in OUTSIDE_DOCS) + r")\.md\b"  # e.g. the spec file's name
    + r"|\bSPEC(?: section| \d)"  # a spec section cited without the file name
    + r"|\.\./shared/"  # the folder those notes live in
)


def tracked_files(root: Path) -> list[Path]:
    """Text files git tracks under ``root``, plus every ``docs/*.md`` on disk (new pages)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    paths = {root / p for p in out.split("\0") if p}
    paths |= set((root / "docs").glob("*.md"))
    return sorted(p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES))


def reference_problems(root: Path, files: list[Path]) -> list[str]:
    """One line per missing ``docs/*.md`` target, broken relative ``.md`` link in a Markdown
    file, or mention of a document kept outside the repository."""
    problems = []
    for path in files:
        rel = path.relative_to(root)
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for m in DOCS_PATH.finditer(line):
                if not (root / "docs" / m.group(1)).is_file():
                    problems.append(f"{rel}:{n}: names docs/{m.group(1)}, which does not exist")
            if path.suffix == ".md":
                for m in MD_LINK.finditer(line):
                    target = m.group(1)
                    if "://" not in target and not (path.parent / target).is_file():
                        problems.append(f"{rel}:{n}: links {target}, which does not exist")
            for m in FORBIDDEN.finditer(line):
                problems.append(f"{rel}:{n}: names {m.group(0)!r}, a document outside the repository")
    return problems


@pytest.fixture(scope="module")
def files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return tracked_files(ROOT)


def test_every_docs_reference_resolves_and_no_outside_document_is_named(files):
    assert files, "git ls-files listed nothing"
    problems = reference_problems(ROOT, files)
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_looks_for(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# Here\n\nSee [gone](gone.md) and [here](here.md#here).\n")
    spec, docs, shared = OUTSIDE_DOCS[0], "docs" + "/", ".." + "/shared/"  # assembled: this file is scanned too
    bad = tmp_path / "mod.py"
    bad.write_text(f'"""Formats ({docs}here.md, "Here"); details in {docs}missing.md.\n'
                   f'Formats as {spec}.md section 3 gives them; {spec} section 2; '
                   f'{OUTSIDE_DOCS[2]}.md; {shared}data."""\n')
    good = tmp_path / "ok.py"
    good.write_text(f'SPEC_COUNTERS = {{}}  # {docs}here.md, "Here"; a GPU test\n')
    problems = reference_problems(tmp_path, [bad, good, tmp_path / "docs" / "here.md"])
    assert len(problems) == 6, problems
    assert any("missing.md" in p for p in problems)
    assert any("gone.md" in p for p in problems)
    assert sum("outside the repository" in p for p in problems) == 4
    assert not any(p.startswith("ok.py") or "here.md, which" in p for p in problems)
