"""Every command line of the data-prep, train and export/eval stages documents each flag and
shows its defaults (built without running: each module's build_parser())."""

from __future__ import annotations

import argparse

import pytest

from draftsmith.cli import HelpFormatter, build_recipe_parser
from draftsmith.data_prep import prepare, synthesize
from draftsmith.eval import bench_gpu, bench_hidden_states, compare_drafts, export, spec_decode
from draftsmith.train import method_base

PARSERS = {
    "prepare": prepare.build_parser,
    "synthesize": synthesize.build_parser,
    "train": lambda: method_base.build_parser("train/<method>.py"),
    "export": export.build_parser,
    "spec-decode": spec_decode.build_parser,
    "compare": compare_drafts.build_parser,
    "bench-hidden-states": bench_hidden_states.build_parser,
    "bench-gpu": bench_gpu.build_parser,
    "recipe": build_recipe_parser,
}


def walk(parser: argparse.ArgumentParser, name: str):
    """``(command name, parser)`` for ``parser`` and each of its subcommands."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from walk(sub, f"{name} {sub_name}")


def commands():
    return [c for name, build in PARSERS.items() for c in walk(build(), name)]


@pytest.mark.parametrize("name, parser", commands(), ids=[c[0] for c in commands()])
def test_every_flag_has_help_text(name, parser):
    undocumented = [a.option_strings[0] for a in parser._actions
                    if a.option_strings and not (a.help and a.help.strip())]
    assert undocumented == [], f"{name}: flags without help="


@pytest.mark.parametrize("name, parser", commands(), ids=[c[0] for c in commands()])
def test_help_shows_defaults_and_keeps_the_description_layout(name, parser):
    assert parser.formatter_class is HelpFormatter


def test_help_appends_a_default_only_where_there_is_one():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--k", type=int, default=3, help="draft tokens")
    p.add_argument("--zero", type=int, default=0, help="a zero default")
    p.add_argument("--out", help="output file")
    p.add_argument("--legacy", action="store_true", help="old layout")
    p.add_argument("--n", default=5, help="count (default: %(default)s)")
    text = " ".join(p.format_help().split())
    assert "draft tokens (default: 3)" in text and "a zero default (default: 0)" in text
    assert "output file (default" not in text and "old layout (default" not in text
    assert text.count("(default: 5)") == 1
