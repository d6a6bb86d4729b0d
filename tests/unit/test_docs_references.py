"""References to documentation: every ``docs/<name>.md`` a tracked file names exists, every
relative ``.md`` link in README.md and docs/ resolves, down to its ``#anchor`` (a heading of the
target, slugged as GitHub renders it), and no file names a document that is not part of the
repository (notes kept outside it, which users do not have)."""

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
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#([^)\s]*))?\)")
SAME_PAGE_LINK = re.compile(r"\]\(#([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
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


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown ``text`` (fenced code skipped): the
    heading lowercased, characters other than letters, digits, ``_``, ``-`` and spaces removed,
    spaces made ``-``; the second heading of the same slug gets ``-1``, the third ``-2``."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


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
                    target, anchor = m.group(1), m.group(2)
                    if "://" in target:
                        continue
                    if not (path.parent / target).is_file():
                        problems.append(f"{rel}:{n}: links {target}, which does not exist")
                    elif anchor and anchor not in heading_anchors((path.parent / target).read_text(encoding="utf-8")):
                        problems.append(f"{rel}:{n}: links {target}#{anchor}, a heading {target} does not have")
                for m in SAME_PAGE_LINK.finditer(line):
                    if m.group(1) not in heading_anchors(text):
                        problems.append(f"{rel}:{n}: links #{m.group(1)}, a heading this page does not have")
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
    (tmp_path / "docs" / "here.md").write_text(
        "# Here\n\n## Memory of `x` (issue 26)\n\nSee [gone](gone.md), [here](here.md#here), "
        "[memory](here.md#memory-of-x-issue-26), [old](here.md#memory-of-x) and [self](#nowhere).\n")
    spec, docs, shared = OUTSIDE_DOCS[0], "docs" + "/", ".." + "/shared/"  # assembled: this file is scanned too
    bad = tmp_path / "mod.py"
    bad.write_text(f'"""Formats ({docs}here.md, "Here"); details in {docs}missing.md.\n'
                   f'Formats as {spec}.md section 3 gives them; {spec} section 2; '
                   f'{OUTSIDE_DOCS[2]}.md; {shared}data."""\n')
    good = tmp_path / "ok.py"
    good.write_text(f'SPEC_COUNTERS = {{}}  # {docs}here.md, "Here"; a GPU test\n')
    problems = reference_problems(tmp_path, [bad, good, tmp_path / "docs" / "here.md"])
    assert len(problems) == 8, problems
    assert any("missing.md" in p for p in problems)
    assert any("gone.md" in p for p in problems)
    assert any("here.md#memory-of-x," in p for p in problems)  # a renamed heading's old anchor
    assert any("#nowhere" in p for p in problems)
    assert not any("issue-26" in p or "here.md#here," in p for p in problems)
    assert sum("outside the repository" in p for p in problems) == 4
    assert not any(p.startswith("ok.py") or "here.md, which" in p for p in problems)
