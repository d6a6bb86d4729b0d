"""Every command line prints its help and documents each flag with its default: each
``draftsmith`` subcommand (as ``draftsmith --help`` lists them), each training launch point
(``python -m draftsmith.train``, ``train/eagle3.py``) and each other module run with ``python -m`` (a
``__main__`` block: the demo, the shard tools, ...). Each runs in-process with ``--help``; the parsers it builds are
recorded and checked."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import sys

import pytest

from draftsmith.cli import STAGES, main
from draftsmith.runtime import HelpFormatter

from helpers import REPO
from helpers.recipes import RECIPES

# run as `python -m` but not a command line: it runs the command it is given (procs.py)
NOT_COMMAND_LINES = {"draftsmith.procs"}
# command lines whose flags lack a help text or hide their default today: (undocumented flags,
# defaults not shown), by subcommand or module name (without its package: modules move); the tests
# fail when one is fixed, so that it leaves this list
KNOWN_GAPS = {
    "serve-bench": (["--num-prompts-per-level", "--max-new-tokens", "--no-ngram", "--out-dir"], []),
    "demo": (["--run-dir"], []),
    "bench data-memory": (["--ranks", "--batch-size"], []),
    "bench regenerate": (["--max-new-tokens", "--prompts", "--target"], []),
}
# `draftsmith train` reads the recipe's method before its flags (`draftsmith train RECIPE --help`)
NEEDS_RECIPE = {"train": str(REPO / "recipes" / "smollm2_135m.yaml")}


def subcommands() -> list[str]:
    """The subcommands ``draftsmith --help`` lists, and ``bench``'s benchmarks (``bench memory``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    names = re.findall(r"^  (\S+) ", out.getvalue().split("subcommands:")[1], re.M)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--help"]) == 0
    return names + [f"bench {b}" for b in re.findall(r"^  (\S+) ", out.getvalue().split("benchmarks:")[1], re.M)]


# the training launch points: `accelerate launch -m draftsmith.train` and the published file
ENTRY_SCRIPTS = ["train/__main__.py", "train/eagle3.py"]
# the modules of the draftsmith subcommands (draftsmith.cli.<stage>, the dispatcher's own ones and itself)
SUBCOMMAND_MODULES = {module for module, _ in STAGES.values()} | {
    f"draftsmith.cli.{m}" for m in ("train", "recipe", "verify", "bench", "__init__", "__main__")}


def python_m_modules() -> list[str]:
    """Package modules with a ``__main__`` block (``python -m draftsmith.<module>``) that are not
    a ``draftsmith`` subcommand, a training launch point or the command line itself."""
    found = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        # benchmarks/ run as `draftsmith bench <name>` (covered by SUBCOMMANDS)
        if rel.parts[0] in ("tests", "scripts", "benchmarks", "runs", "docs", "recipes", "build") or rel.parts[0].startswith("."):
            continue
        if str(rel) in ENTRY_SCRIPTS or 'if __name__ == "__main__"' not in path.read_text():
            continue
        module = "draftsmith." + ".".join(rel.with_suffix("").parts)
        if module not in NOT_COMMAND_LINES | SUBCOMMAND_MODULES:
            found.append(module)
    return found


SUBCOMMANDS = subcommands()
MODULES = python_m_modules()


def run_help(run) -> tuple[str, list[argparse.ArgumentParser]]:
    """``(stdout, parsers)`` of ``run()`` given ``--help``: it exits 0 (or returns 0) after
    printing a usage; ``parsers`` are those it parsed arguments with."""
    parsers = []
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        parsers.append(self)
        return parse_known_args(self, *args, **kwargs)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_known_args", recording)
        mp.setattr(sys, "argv", list(sys.argv))  # commands rename themselves through sys.argv[0]
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            sys.exit(run())
    assert exit_.value.code in (0, None), out.getvalue()
    assert "usage:" in out.getvalue()
    return out.getvalue(), parsers


def walk(parser: argparse.ArgumentParser):
    """``parser`` and each of its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)


def flag_name(parser: argparse.ArgumentParser, root: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``--flag``, or ``sub: --flag`` for a flag of a subcommand of ``root``."""
    sub = parser.prog.removeprefix(root.prog).strip()
    return f"{sub}: {action.option_strings[0]}" if sub else action.option_strings[0]


def undocumented_flags(parsers: list[argparse.ArgumentParser]) -> list[str]:
    return [flag_name(p, parser, a) for parser in parsers for p in walk(parser) for a in p._actions
            if a.option_strings and not (a.help and a.help.strip())]


def defaults_not_shown(parsers: list[argparse.ArgumentParser]) -> list[str]:
    """Flags with a default worth showing whose help text does not show it (HelpFormatter
    appends ``(default: X)`` unless the default is None, False or ``[]``, or the help says it)."""
    missing = []
    for parser in parsers:
        for p in walk(parser):
            text = " ".join(p.format_help().split())
            for a in p._actions:
                if (not a.option_strings or a.help in (None, argparse.SUPPRESS) or a.default in (None, False, [])
                        or a.default is argparse.SUPPRESS or "(default" in a.help):
                    continue
                if f"(default: {' '.join(str(a.default).split())})" not in text:
                    missing.append(flag_name(p, parser, a))
    return missing


def command_help(command: str):
    argv = command.split()
    return run_help(lambda: main([*argv, *([NEEDS_RECIPE[command]] if command in NEEDS_RECIPE else []), "--help"]))


def test_the_command_list_is_complete():
    # the stages, train, recipe, verify, bench and its memory benchmark; a recipe for train is shipped
    assert {"prepare", "train", "export", "recipe", "verify", "proxy", "adapt", "bench memory", "bench gpu",
            "bench regenerate", "bench hidden-states", "bench data-memory"} <= set(SUBCOMMANDS)
    assert len(SUBCOMMANDS) >= 18 and all((REPO / script).is_file() for script in ENTRY_SCRIPTS)
    assert {"demo", "hidden_states"} <= {m.rsplit(".")[-1] for m in MODULES}
    assert REPO / "recipes" / "smollm2_135m.yaml" in RECIPES


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_prints_its_help_and_documents_each_flag_with_its_default(command):
    out, parsers = command_help(command)
    if command == "bench":  # a list of benchmarks, not a parser
        assert "memory" in out and parsers == []
        return
    assert parsers, f"draftsmith {command} --help parsed nothing"
    assert (undocumented_flags(parsers), defaults_not_shown(parsers)) == KNOWN_GAPS.get(command, ([], []))


@pytest.mark.parametrize("command", SUBCOMMANDS + ["recipe show", "recipe validate", "recipe schema"])
def test_every_subcommand_prints_its_help_with_no_other_argument(command):
    # `draftsmith train --help` included: no recipe needed to learn the flags (the recipe's method
    # adds its own description: `draftsmith train RECIPE --help`, above)
    out, _ = run_help(lambda: main([*command.split(), "--help"]))
    assert out.startswith("usage: ")


@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_every_training_entry_script_prints_its_help_and_documents_each_flag(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    out, parsers = run_help(lambda: runpy.run_path(str(REPO / script), run_name="__main__"))
    assert parsers and "--run-dir" in out
    assert (undocumented_flags(parsers), defaults_not_shown(parsers)) == ([], [])


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy runs an imported module again
def test_every_python_m_module_prints_its_help_and_documents_each_flag(module, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    _, parsers = run_help(lambda: runpy.run_module(module, run_name="__main__"))
    assert parsers
    gaps = KNOWN_GAPS.get(module.rsplit(".")[-1], ([], []))
    assert (undocumented_flags(parsers), defaults_not_shown(parsers)) == gaps


def test_the_checks_see_an_undocumented_flag_and_a_hidden_default():
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    p.add_argument("--k", type=int, default=3)
    plain = argparse.ArgumentParser(prog="y")  # the default formatter shows no defaults
    plain.add_argument("--k", type=int, default=3, help="draft tokens")
    assert undocumented_flags([p]) == ["--k"] and defaults_not_shown([plain]) == ["--k"]


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
