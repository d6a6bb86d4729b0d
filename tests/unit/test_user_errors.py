"""A user's mistake gets one line naming what they typed, where, and how to fix it, and the exit
code argparse would give (2: a usage error: a malformed flag or ``--set``, an invalid recipe) or
the one the command gives its runtime failures (1: a path that does not exist, a Hub target or
dataset this machine cannot reach), never a traceback. Each case runs ``draftsmith`` in-process
(:func:`draftsmith.cli.main`) with the Hub offline; docs/reliability.md, "Bad inputs tried",
lists the same inputs with their messages."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.cli import STAGES, main

from helpers import REPO
from helpers.tiny import TINY_AUX

RECIPE = str(REPO / "recipes" / "smollm2_135m.yaml")
NO_SUCH_MODEL = "draftsmith-tests/no-such-model"  # a valid repo id that is never cached


@pytest.fixture(autouse=True)
def argv(monkeypatch):
    """``main`` renames ``sys.argv`` for the stage it runs: restored after each test."""
    monkeypatch.setattr(sys, "argv", ["draftsmith"])


@pytest.fixture
def offline(monkeypatch):
    """The Hub unreachable at once (no network wait), as on an offline machine."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``draftsmith ARGV`` (a ``SystemExit`` is an exit code)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def last_line(err: str) -> str:
    """The message: the last line of stderr (argparse prints its usage above it; a stage logs)."""
    return err.strip().splitlines()[-1]


# --- --set ------------------------------------------------------------------------------------

MALFORMED_SET = ("--set data.aux_layer_ids=[1,2: the value is not valid YAML (expected ',' or ']', but got "
                 "'<stream end>', line 1 column 5); write it as YAML, e.g. --set 'data.aux_layer_ids=[1, 2, 3]' "
                 "(quote the argument)")


@pytest.mark.parametrize("command", [["recipe", "validate", RECIPE], ["train", RECIPE],
                                     ["prepare", RECIPE, "--run-dir", "RUN"]], ids=lambda c: c[0])
def test_a_malformed_set_value_names_the_set_argument(command, tmp_path, capsys):
    argv = [tmp_path / "run" if a == "RUN" else a for a in command]
    code, _, err = run(capsys, *map(str, argv), "--set", "data.aux_layer_ids=[1,2")
    assert (code, err) == (2, MALFORMED_SET + "\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "--set train.lr=-1: train.lr: Input should be greater than 0"),
    ("train.lrr=1", "--set train.lrr=1: train.lrr: unknown key"),
    ("train.lr", "--set train.lr: expected KEY=VALUE, e.g. --set train.lr=3e-4"),
])
def test_a_set_mistake_is_blamed_on_the_set_argument_not_the_recipe_file(override, message, capsys):
    code, out, err = run(capsys, "recipe", "validate", RECIPE, "--set", override)
    assert (code, err, out) == (2, message + "\n", "")


def test_a_mistake_in_the_file_is_still_the_files(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: -1\n")
    code, _, err = run(capsys, "recipe", "validate", str(recipe), "--set", "train.batch_size=4")
    assert (code, err) == (2, f"{recipe}: invalid recipe: train.lr: Input should be greater than 0\n")


# --- recipe files -------------------------------------------------------------------------------

HOW = ("a recipe maps sections (target:, data:, draft:, train:, ...) to their keys: start from a shipped "
       "one, e.g. recipes/smollm2_135m.yaml")


@pytest.mark.parametrize("text, what", [
    ("", "an empty recipe (no keys)"),
    ("# only a comment\n", "an empty recipe (no keys)"),
    ("{}\n", "an empty recipe (no keys)"),
    ("- target\n- data\n", "a YAML list, not a mapping of keys"),
    ("smollm2\n", "a single YAML value ('smollm2'), not a mapping of keys"),
    ("0\n", "a single YAML value (0), not a mapping of keys"),
], ids=["empty", "comments", "braces", "list", "string", "zero"])
def test_an_empty_or_keyless_recipe_file_is_refused_naming_the_file(text, what, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code, out, err = run(capsys, "recipe", "validate", str(recipe))
    assert (code, out, err) == (2, "", f"{recipe}: {what}; {HOW}\n")
    assert run(capsys, "train", str(recipe))[0] == 2


# --- paths that do not exist --------------------------------------------------------------------

def test_export_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    code, _, err = run(capsys, "export", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert (code, err) == (1, f"error: {tmp_path / 'nope'}: no such checkpoint or run directory; pass "
                              "RUN_DIR/checkpoints/step-N or the RUN_DIR of `draftsmith train`\n")


def test_verify_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    code, out, err = run(capsys, "verify", str(tmp_path / "nope"))
    assert (code, out) == (1, "")
    assert err == (f"error: {tmp_path / 'nope'}: no such directory; pass a run directory (draftsmith prepare ... "
                   "--run-dir RUN_DIR) or a shard directory holding manifest.json\n")


def test_acceptance_of_paths_that_do_not_exist_says_so(tmp_path, capsys):
    code, _, err = run(capsys, "acceptance", "--target", str(tmp_path / "nope"), "--draft", str(tmp_path))
    assert (code, err) == (1, f"error: --target {tmp_path / 'nope'}: no such directory; pass a model folder or a "
                              "Hub repo id (ORG/NAME)\n")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    code, _, err = run(capsys, "acceptance", "--target", str(target), "--draft", str(tmp_path / "nope"))
    assert (code, err) == (1, f"error: --draft {tmp_path / 'nope'}: no such directory; pass the folder "
                              "`draftsmith export` wrote\n")
    # the bundled default target is named as every other command names it, and resolved to its folder
    code, _, err = run(capsys, "acceptance", "--target", "embedded:SmolLM2-135M-Instruct", "--draft", str(tmp_path / "nope"))
    assert (code, err) == (1, f"error: --draft {tmp_path / 'nope'}: no such directory; pass the folder "
                              "`draftsmith export` wrote\n")


def test_hub_of_a_draft_that_does_not_exist_says_so(tmp_path, capsys):
    code, _, err = run(capsys, "hub", str(tmp_path / "nope"), "--out", str(tmp_path / "hub"), "--repo-id", "a/b")
    assert (code, err) == (1, f"error: {tmp_path / 'nope'}: no such directory; pass the folder `draftsmith export` "
                              "wrote\n")


def test_a_missing_local_target_path_says_the_path_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "models" / "llama"
    code, _, err = run(capsys, "prepare", RECIPE, "--run-dir", str(tmp_path / "run"),
                       "--set", f"target.name_or_path={missing}")
    assert code == 1
    assert last_line(err) == (f"error: target {missing}: no such directory; fix the path (or name a Hub repo id, "
                              "ORG/NAME)")
    assert "SmolLM2" not in err and "Repo id" not in err


# --- the Hub unreachable --------------------------------------------------------------------------

def test_acceptance_with_a_hub_target_that_cannot_be_reached(offline, capsys):
    code, _, err = run(capsys, "acceptance", "--target", NO_SUCH_MODEL, "--method", "ngram")
    assert code == 1
    assert re.fullmatch(
        rf"error: --target {NO_SUCH_MODEL}: no such local directory, and the Hub cannot serve it here \(\w+: [^\n]+\); "
        rf"download it where the Hub is reachable \(`hf download {NO_SUCH_MODEL} --local-dir DIR`, after "
        r"`hf auth login` for a gated model\) and pass --target DIR\n", err), err


def test_prepare_with_a_hub_dataset_that_cannot_be_reached(offline, tiny_target, tmp_path, capsys):
    source = "draftsmith-tests/no-such-dataset"
    code, _, err = run(capsys, "prepare", RECIPE, "--run-dir", str(tmp_path / "run"),
                       "--set", f"target.name_or_path={tiny_target}", "--set", f"data.aux_layer_ids={TINY_AUX}",
                       "--set", f"data.sources=[{{path: {source}}}]", "--set", "data.regenerate.enabled=false",
                       "--set", "data.eval_prompts=null")
    assert code == 1
    assert re.fullmatch(
        rf"error: {source}: cannot load the Hub dataset \(split 'train'; \w+: [^\n]+\); check the id and split, or "
        rf"download it where the Hub is reachable \(`hf download {source} --repo-type dataset --local-dir DIR`, "
        r"after `hf auth login` for a gated one\) and name its data file as the source path", last_line(err)), err


def test_a_missing_local_data_file_says_no_such_file(tmp_path):
    from draftsmith.data_prep.conversations import DataError, load_records

    for missing in (str(tmp_path / "data.jsonl"), "data/train.jsonl"):  # the second is also a valid repo id
        with pytest.raises(DataError) as err:
            load_records(missing)
        assert str(err.value) == (f"{missing}: no such file; fix the source path (a local JSON/JSONL/Parquet/CSV "
                                  "file, or a Hub dataset id ORG/NAME)")


# --- simulate -------------------------------------------------------------------------------------

@pytest.fixture
def fake_draft(tmp_path) -> Path:
    """A folder that passes for an export until its config is read."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    return draft


def test_simulate_temperatures_must_be_numbers(fake_draft, tmp_path, capsys):
    code, _, err = run(capsys, "simulate", "--draft", str(fake_draft), "--data", str(tmp_path),
                       "--temperatures", "0,hot")
    assert code == 2
    assert last_line(err) == ("draftsmith simulate: error: argument --temperatures: 'hot' in '0,hot' is not a number; "
                              "give comma-separated temperatures, e.g. --temperatures 0,0.7")


def test_simulate_names_the_draft_and_data_as_given(fake_draft, tmp_path, capsys):
    code, _, err = run(capsys, "simulate", "--draft", str(tmp_path / "nope"), "--data", str(tmp_path))
    assert (code, err) == (1, f"error: --draft {tmp_path / 'nope'}: no such directory; pass an export (draftsmith "
                              "export) or a checkpoint (RUN_DIR/checkpoints/step-N)\n")
    code, _, err = run(capsys, "simulate", "--draft", str(fake_draft), "--data", str(tmp_path / "nope"))
    assert (code, err) == (1, f"error: --data {tmp_path / 'nope'}: no such directory; pass the RUN_DIR/data folder "
                              "`draftsmith prepare RECIPE --run-dir RUN_DIR` wrote\n")
    code, _, err = run(capsys, "simulate", "--draft", str(fake_draft), "--data", str(fake_draft))
    assert (code, err) == (1, f"error: --data {fake_draft}: not a prepared data folder (no target.json); pass the "
                              "RUN_DIR/data folder `draftsmith prepare RECIPE --run-dir RUN_DIR` wrote\n")


def test_simulate_errors_name_the_data_folder_not_a_temporary_one(tiny_target, fake_draft, tmp_path, capsys):
    data = tmp_path / "data"  # half prepared: the target stage ran, the vocab stage did not
    data.mkdir()
    (data / "target.json").write_text(json.dumps({"path": str(tiny_target), "name_or_path": str(tiny_target),
                                                  "vocab_size": 512, "hidden_size": 128, "aux_layer_ids": TINY_AUX}))
    code, _, err = run(capsys, "simulate", "--draft", str(fake_draft), "--data", str(data))
    assert code == 1
    assert last_line(err) == f"error: {data.resolve() / 'vocab.safetensors'} missing: run the vocab stage first"
    assert "draftsmith-sim-" not in err and "init_from" not in err


# --- the messages name draftsmith's commands ------------------------------------------------------

def test_data_prepared_for_another_recipe_names_the_prepare_command_not_no_prepare(tmp_path):
    from draftsmith.data_prep.conversations import DataError
    from draftsmith.layout import RunLayout
    from draftsmith.recipe import load_recipe
    from draftsmith.train.method_base import check_draft_vocab_size

    paths = RunLayout(tmp_path).data
    paths.root.mkdir(parents=True)
    save_file({"d2t": torch.zeros(8, dtype=torch.long), "t2d": torch.ones(64, dtype=torch.bool)}, str(paths.vocab))
    with pytest.raises(DataError) as err:
        check_draft_vocab_size(load_recipe(None, ["data.draft_vocab_size=16"]), paths)
    assert "--no-prepare" not in str(err.value)
    assert f"draftsmith prepare RECIPE --run-dir {tmp_path} --overwrite-data" in str(err.value)


def test_no_prepare_names_the_draftsmith_prepare_command(tmp_path):
    from draftsmith.recipe import load_recipe
    from draftsmith.train.method_base import DataNotPreparedError, ensure_prepared

    with pytest.raises(DataNotPreparedError) as err:
        ensure_prepared(load_recipe(None), tmp_path, "r.yaml", allow=False)
    assert f"run: draftsmith prepare r.yaml --run-dir {tmp_path}   (or drop --no-prepare)" in str(err.value)


def test_the_serving_report_names_the_serve_bench_command(tmp_path):
    from draftsmith.eval.report import write_report

    with pytest.raises(FileNotFoundError, match=rf"run `draftsmith serve-bench \.\.\. --out-dir {tmp_path}` first"):
        write_report(tmp_path)


# the files and `python -m` modules of the subcommands: a message or help text names the subcommand
STAGE_MODULES = {module for module, _ in STAGES.values()}
# the stage modules whose docstring is a subcommand's --help description: those its cli module imports
HELP_MODULES = {value.__name__ for module in STAGE_MODULES for value in vars(importlib.import_module(module)).values()
                if inspect.ismodule(value) and value.__name__.startswith("draftsmith.")}
MODULE_NAMES = re.compile(r"python -m (" + "|".join(re.escape(m) for m in STAGE_MODULES) + r")\b|\b("
                          + "|".join(re.escape(m.removeprefix("draftsmith.").replace(".", "/")) + r"\.py"
                                     for m in STAGE_MODULES) + ")")


def user_facing_strings(path: Path, module_doc: bool):
    """``(line, text)`` of the strings of ``path`` a user reads: the module docstring where it is a
    command's ``--help`` description (``module_doc``), and every other string constant but
    function and class docstrings and the module paths the code imports or launches (a constant
    that is only a dotted module name)."""
    tree = ast.parse(path.read_text())
    skip = set() if module_doc or not ast.get_docstring(tree) else {id(tree.body[0].value)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body[0] if node.body else None
            if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant):
                skip.add(id(body.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if not re.fullmatch(r"[\w.]+", node.value):
                yield node.lineno, node.value


def test_no_message_or_help_names_a_module_where_a_draftsmith_subcommand_exists():
    found = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", "benchmarks", "scripts", "build") or rel.parts[0].startswith("."):
            continue
        module = "draftsmith." + ".".join(rel.with_suffix("").parts)
        command = module in STAGE_MODULES | HELP_MODULES or str(rel) == "train/eagle3.py"
        for line, text in user_facing_strings(path, module_doc=command):
            for hit in MODULE_NAMES.finditer(text):
                found.append(f"{rel}:{line}: {hit.group(0)}")
    assert found == []


# --- the Hub repo id ------------------------------------------------------------------------------

def test_hub_refuses_a_repo_id_the_hub_would_refuse(tmp_path, capsys):
    code, _, err = run(capsys, "hub", str(tmp_path), "--out", str(tmp_path / "hub"), "--repo-id", "not a repo id")
    assert code == 2
    assert last_line(err).startswith("draftsmith hub: error: argument --repo-id: 'not a repo id' is not a Hub "
                                     "repo id (")
    assert last_line(err).endswith("); e.g. --repo-id USER/NAME")
    assert not (tmp_path / "hub").exists()


def test_draftsmith_train_errors_name_the_command_typed_not_the_entry_script(tmp_path, capsys):
    code, _, err = run(capsys, "train", RECIPE, "--run-dir", str(tmp_path / "run"), "--no-prepare")
    assert code == 1 and "Traceback" not in err
    assert last_line(err).startswith("draftsmith train: error: ") and "train/eagle3.py" not in err, err
    assert f"run: draftsmith prepare {RECIPE} --run-dir {tmp_path / 'run'}" in last_line(err)


# --- help and typos -------------------------------------------------------------------------------

def test_train_help_needs_no_recipe(capsys):
    code, out, err = run(capsys, "train", "--help")
    assert (code, err) == (0, "")
    assert out.startswith("usage: draftsmith train ") and "--no-prepare" in out and "--set KEY=VALUE" in out
    code, _, err = run(capsys, "train")
    assert code == 2 and last_line(err) == "draftsmith train: error: the following arguments are required: recipe"


def test_a_malformed_jsonl_line_says_at_column_once(tmp_path):
    from draftsmith.data_prep.conversations import iter_rows

    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a\tb"}\n')  # a raw tab inside a JSON string
    (i, row), = iter_rows(str(f))
    assert str(row) == f"{f}:1: malformed JSON (Invalid control character at column 14)"
