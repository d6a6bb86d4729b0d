"""A method plug-in (an entry point in the ``draftsmith.methods`` group) fails alone: one whose
import fails, that names a missing module, registers a taken name, registers twice or registers
nothing is left out with one logged warning naming its entry point and distribution; every other
method (EAGLE-3 included) keeps working, and asking for it is the one-line UnknownMethodError
naming the plug-in and why it was not loaded. Two built-in packages registering one name stay a
programming error.

The plug-ins are real: a package and its ``*.dist-info`` (``entry_points.txt``) written to a
temporary folder put on ``sys.path``; the registry runs its load again on a copy of the
process's registry."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import draftsmith.methods as methods
from draftsmith.cli import main
from draftsmith.methods import DraftMethodSpec, UnknownMethodError, get_method, method_of_export, register

from helpers import REPO

BUILTIN = ("eagle3", "medusa", "mlp_speculator", "dflash", "peagle", "dspark", "dflash2", "xpress", "mtp")
EAGLE3_RECIPE = REPO / "recipes" / "smollm2_135m.yaml"  # draft.method: eagle3 (the default)

# a plug-in package registering the method NAME (its parts are not needed to register it)
REGISTERS = '''
from draftsmith.methods import DraftMethodSpec, register

register(DraftMethodSpec(name="{name}", package=__name__, vllm_method="medusa", servable=False))
'''


def install(root: Path, dist: str, entry_point: str, files: dict[str, str] | None = None) -> None:
    """``root/<dist>-0.1.dist-info`` declaring ``entry_point`` (``name = module``) in the
    ``draftsmith.methods`` group, and ``files`` (path under ``root`` -> text)."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[draftsmith.methods]\n{entry_point}\n")
    for path, text in (files or {}).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text).lstrip())


@pytest.fixture
def fresh(monkeypatch, caplog):
    """The registry loads again (on a copy of this process's, built-ins already imported), with
    whatever plug-ins the test installs first; the plug-in modules it imports are forgotten after."""
    methods.registered_methods()
    monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))
    monkeypatch.setattr(methods, "_STATE", {"loaded": False, "loading": False})
    monkeypatch.setattr(methods, "_NOT_LOADED", {})
    caplog.set_level(logging.WARNING, logger="draftsmith.methods")
    modules = set(sys.modules)

    def use(*roots: Path) -> None:
        for root in reversed(roots):  # the first root is first on sys.path
            monkeypatch.syspath_prepend(str(root))

    yield use
    for name in set(sys.modules) - modules:
        if name.split(".")[0].endswith("_draft"):
            del sys.modules[name]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "draftsmith.methods" and r.levelno == logging.WARNING]


MISSING = ("method plug-in 'toy' (entry point draftsmith.methods: toy = toy_draft.method from distribution "
           "toy-draft 0.1) was not loaded: ModuleNotFoundError: No module named 'toy_draft'")


def test_a_plugin_naming_a_missing_module_is_one_warning_and_the_others_work(tmp_path, fresh, caplog):
    install(tmp_path, "toy-draft", "toy = toy_draft.method")
    fresh(tmp_path)
    assert methods.registered_methods() == BUILTIN
    assert get_method("eagle3").name == "eagle3"
    assert methods.registered_methods() == BUILTIN  # loaded once: no second warning
    assert warnings_of(caplog) == [MISSING]
    assert methods.plugin_load_failure("toy") == MISSING and methods.plugin_load_failure("eagle3") is None


def test_asking_for_the_failed_plugin_names_it_and_its_load_failure(tmp_path, fresh):
    install(tmp_path, "toy-draft", "toy = toy_draft.method")
    fresh(tmp_path)
    with pytest.raises(UnknownMethodError) as exc:
        get_method("toy")
    assert str(exc.value) == (f"draft method 'toy' is not available: {MISSING}; fix or uninstall that plug-in "
                              f"(registered: {', '.join(BUILTIN)})")
    # another unknown name, or an export no method recognises, mentions the plug-in left out
    with pytest.raises(UnknownMethodError, match=r"unknown draft method 'eagle4'; registered: eagle3, .*, mtp; "
                                                 r"method plug-ins not loaded: 'toy'$"):
        get_method("eagle4")
    with pytest.raises(UnknownMethodError, match=r"is no registered draft format \(eagle3, .*, mtp; method "
                                                 r"plug-ins not loaded: 'toy'\)$"):
        method_of_export({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_a_plugin_whose_import_fails_is_left_out_and_a_good_one_beside_it_loads(tmp_path, fresh, caplog):
    install(tmp_path, "broken-draft", "broken = broken_draft",
            {"broken_draft/__init__.py": REGISTERS.format(name="broken") + "import not_installed_dependency\n"})
    install(tmp_path, "good-draft", "good = good_draft", {"good_draft/__init__.py": REGISTERS.format(name="good")})
    fresh(tmp_path)
    assert methods.registered_methods() == (*BUILTIN, "good")  # what broken registered before failing is dropped
    assert warnings_of(caplog) == [
        "method plug-in 'broken' (entry point draftsmith.methods: broken = broken_draft from distribution "
        "broken-draft 0.1) was not loaded: ModuleNotFoundError: No module named 'not_installed_dependency'"]
    assert get_method("good").package == "good_draft"


def test_a_plugin_raising_at_import_is_one_line_of_its_error(tmp_path, fresh, caplog):
    install(tmp_path, "bad-draft", "bad = bad_draft", {"bad_draft/__init__.py": "raise RuntimeError('no GPU\\nhere')\n"})
    fresh(tmp_path)
    assert methods.registered_methods() == BUILTIN
    assert warnings_of(caplog) == [
        "method plug-in 'bad' (entry point draftsmith.methods: bad = bad_draft from distribution bad-draft 0.1) "
        "was not loaded: RuntimeError: no GPU; here"]


def test_a_plugin_taking_a_builtin_name_is_a_warning_and_the_builtin_stays(tmp_path, fresh, caplog):
    install(tmp_path, "clash-draft", "dflash = clash_draft", {"clash_draft/__init__.py": REGISTERS.format(name="dflash")})
    fresh(tmp_path)
    dflash = get_method("dflash")
    assert methods.registered_methods() == BUILTIN and dflash.package == "draftsmith.models.dflash"
    assert warnings_of(caplog) == [
        "method plug-in 'dflash' (entry point draftsmith.methods: dflash = clash_draft from distribution "
        "clash-draft 0.1) was not loaded: ValueError: draft method 'dflash' is registered by both "
        "draftsmith.models.dflash and clash_draft"]


def test_two_plugins_of_one_name_the_first_wins(tmp_path, fresh, caplog):
    first, second = tmp_path / "first", tmp_path / "second"
    install(first, "one-draft", "toy = one_draft", {"one_draft/__init__.py": REGISTERS.format(name="toy")})
    install(second, "two-draft", "toy = two_draft", {"two_draft/__init__.py": REGISTERS.format(name="toy")})
    fresh(first, second)
    assert methods.registered_methods() == (*BUILTIN, "toy") and get_method("toy").package == "one_draft"
    assert warnings_of(caplog) == [
        "method plug-in 'toy' (entry point draftsmith.methods: toy = two_draft from distribution two-draft 0.1) "
        "was not loaded: ValueError: draft method 'toy' is registered by both one_draft and two_draft"]


def test_a_plugin_registering_twice_or_nothing_is_left_out(tmp_path, fresh, caplog):
    install(tmp_path, "twice-draft", "twice = twice_draft",
            {"twice_draft/__init__.py": REGISTERS.format(name="twice") + REGISTERS.format(name="twice")})
    install(tmp_path, "empty-draft", "empty = empty_draft", {"empty_draft/__init__.py": '"""registers nothing"""\n'})
    fresh(tmp_path)
    assert methods.registered_methods() == BUILTIN
    assert sorted(warnings_of(caplog)) == [
        "method plug-in 'empty' (entry point draftsmith.methods: empty = empty_draft from distribution empty-draft "
        "0.1) was not loaded: importing empty_draft registered no draft method (its package calls "
        "draftsmith.methods.register(DraftMethodSpec(...)))",
        "method plug-in 'twice' (entry point draftsmith.methods: twice = twice_draft from distribution twice-draft "
        "0.1) was not loaded: ValueError: draft method 'twice' is registered twice by twice_draft"]


def test_a_plugin_imported_before_the_registry_does_not_displace_a_builtin(fresh, caplog):
    builtin = get_method("dflash")
    del methods._REGISTRY["dflash"]  # as before the built-in package was imported
    register(DraftMethodSpec(name="dflash", package="early_draft", vllm_method="dflash", servable=False))
    assert register(builtin) is builtin and get_method("dflash") is builtin
    assert warnings_of(caplog) == ["draft method 'dflash' is registered by both early_draft and "
                                   "draftsmith.models.dflash: early_draft's is dropped"]


def test_two_builtins_of_one_name_are_a_programming_error(fresh):
    with pytest.raises(ValueError, match="^draft method 'eagle3' is registered by both draftsmith.models.eagle3 "
                                         "and draftsmith.models.medusa$"):
        register(DraftMethodSpec(name="eagle3", package="draftsmith.models.medusa", vllm_method="eagle3", servable=True))


def test_entry_points_that_cannot_be_read_are_one_warning(fresh, caplog, monkeypatch):
    import importlib.metadata

    def unreadable(**_):
        raise OSError("bad METADATA")

    monkeypatch.setattr(importlib.metadata, "entry_points", unreadable)
    assert methods.registered_methods() == BUILTIN
    assert warnings_of(caplog) == ["method plug-ins (entry points draftsmith.methods) were not loaded: cannot read "
                                   "the installed packages' entry points: OSError: bad METADATA"]


def test_eagle3_commands_work_in_process_while_a_broken_plugin_is_installed(tmp_path, fresh, caplog, capsys):
    install(tmp_path, "toy-draft", "toy = toy_draft.method")
    fresh(tmp_path)
    assert main(["recipe", "validate", str(EAGLE3_RECIPE)]) == 0
    assert "valid (eagle3" in capsys.readouterr().out
    # `train RECIPE --help` asks the registry for EAGLE-3's training method (its flags and help text)
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(EAGLE3_RECIPE), "--help"])
    assert exit_.value.code in (0, None)
    assert get_method("eagle3").training_method.help_text.split()[0] in capsys.readouterr().out
    assert warnings_of(caplog) == [MISSING]


def test_a_fresh_draftsmith_process_with_a_broken_plugin_prints_one_warning_line(tmp_path):
    install(tmp_path, "toy-draft", "toy = toy_draft.method")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "recipe", "validate", str(EAGLE3_RECIPE)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "valid (eagle3" in proc.stdout
    assert proc.stderr.strip().splitlines() == [MISSING]
