"""The aux layer ids every stage reads come from one rule (target/facts.py ``aux_layer_ids``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith.target import aux_layer_ids

ROOT = Path(__file__).resolve().parents[2]


def test_default_is_vllm_rule_and_recipe_ids_are_checked():
    assert aux_layer_ids(None, 36) == [2, 18, 33]  # vLLM: (2, N // 2, N - 3)
    assert aux_layer_ids([], 36) == [2, 18, 33]
    assert aux_layer_ids([30, 1, 12], 36) == [1, 12, 30]
    with pytest.raises(ValueError, match="out of range"):
        aux_layer_ids([1, 2, 36], 36)
    with pytest.raises(ValueError, match="exactly 3"):
        aux_layer_ids([1, 2], 36)


def test_no_stage_writes_the_rule_again():
    """Only target/facts.py spells ``N // 2`` / ``N - 3``, and only it (and the dry run's "is this
    the default" report) calls ``default_aux_layer_ids``: a copy elsewhere would drift."""
    callers = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith((".venv", "tests/", "build/")) or rel == "target/facts.py":
            continue
        text = path.read_text()
        if re.search(r"default_aux_layer_ids\(", text) and rel != "train/dry_run.py":
            callers.append(rel)
        if re.search(r"num_(hidden_)?layers\s*//\s*2", text):
            callers.append(rel)
    assert callers == []
