"""The wheel a user installs: built from the checkout (``pip wheel``), installed into a folder
outside it, and run from another directory with nothing but the wheel's code (the venv's
packages as its dependencies, no network). It holds every package (found by setup.py) and the
data the code opens beside itself (recipes, launchers, target configs, prompt sets); a shipped
recipe is named without a path (``draftsmith train gptoss120b --dry-run``); every registered
method loads and builds; one method trains a step from the installed code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith.methods import registered_methods
from draftsmith.recipe import dump_recipe

from helpers import REPO
from helpers.recipes import small_recipe

# top-level folders whose modules are not in the wheel: tests, draftsmith's own benchmarks and
# maintainer scripts (setup.py's EXCLUDE), outputs
OUTSIDE = {"tests", "benchmarks", "scripts", "runs", "build", "dist", "outputs", "wandb", "__pycache__"}
# what the copy of the checkout the wheel is built from leaves out: outputs, caches, the venv
NOT_SOURCES = shutil.ignore_patterns(".*", "runs", "build", "dist", "outputs", "wandb", "*.egg-info",
                                     "__pycache__", "*.whl")
# the data the wheel carries: the shipped recipes, launchers, target configs and prompt sets
DATA = ["recipes/*.yaml", "recipes/accelerate/*.yaml", "recipes/targets/README.md",
        "recipes/targets/**/config.json", "data_prep/prompts/*.jsonl"]

# one tiny config of each registered method (tests/unit/test_registry.py's geometries)
H, V = 32, 64
TINY_CONFIGS = {
    "eagle3": dict(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   vocab_size=V, draft_vocab_size=48, aux_layer_ids=[0, 1, 2]),
    "medusa": dict(hidden_size=H, vocab_size=V, num_heads=2, num_layers=1),
    "mlp_speculator": dict(emb_dim=H, inner_dim=H, vocab_size=V, n_predict=2),
    "dflash": dict(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, vocab_size=V, draft_vocab_size=48, aux_layer_ids=[1, 2, 3], block_size=4,
                   mask_token_id=5, num_target_layers=6),
    "peagle": dict(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   vocab_size=V, draft_vocab_size=48, aux_layer_ids=[0, 1, 2], num_layers=2, num_depths=3,
                   mask_token_id=5),
    "dspark": dict(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, vocab_size=V, draft_vocab_size=48, aux_layer_ids=[1, 2, 3], block_size=4,
                   mask_token_id=5, num_target_layers=6, markov_rank=8),
    "dflash2": dict(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2, 3], block_size=4,
                    mask_token_id=5, num_target_layers=6, conv_group_size=8, selector_rank=4, selector_top_k=3),
    "xpress": dict(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2, 3], block_size=4,
                   mask_token_id=5, num_target_layers=6, xpress_rank=4, xpress_topc=8),
    # a DeepSeek-V3 target's MTP layer: MLA and a MoE of 4 experts in 2 groups
    "mtp": dict(family="deepseek_v3", target_config={
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": H, "vocab_size": V,
        "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "intermediate_size": 64, "moe_intermediate_size": 16,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}),
}

# run by the installed code: where it was imported from, every shipped recipe by name, the
# lookups of the files beside the code, an unknown recipe's error, every method built
CHECK = r"""
import contextlib, io, json, sys
from pathlib import Path

site, configs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
import draftsmith
from draftsmith.cli import main
from draftsmith.data_prep.conversations import BUILTIN_DIR
from draftsmith.target import TARGETS_DIR
from draftsmith.methods import get_method, registered_methods
from draftsmith.resources import shipped_recipe_names
from draftsmith.train.launchers import resolve_launcher_path

out = {"package": draftsmith.__file__, "recipes": shipped_recipe_names(), "validate": {}, "methods": {}}
from draftsmith.recipe import load_recipe
from draftsmith.vllm_bridge.releases import check_vllm_serves_method, installed_vllm_version
out["unserved"] = {}
for name in out["recipes"]:
    with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.redirect_stderr(io.StringIO()) as err:
        rc = main(["recipe", "validate", name])
    out["validate"][name] = [rc, text.getvalue().strip(), err.getvalue().strip()]
    try:  # a recipe for another vLLM release (XPress: 0.33 on) is refused in one line
        check_vllm_serves_method(load_recipe(name).draft.method, installed_vllm_version())
    except ValueError as exc:
        out["unserved"][name] = str(exc)
with contextlib.redirect_stderr(io.StringIO()) as text:
    out["unknown"] = [main(["recipe", "validate", "no_such_recipe"]), text.getvalue()]
out["files"] = {"targets": str(TARGETS_DIR), "prompts": str(BUILTIN_DIR),
                "launcher": str(resolve_launcher_path("recipes/accelerate/fsdp_8gpu.yaml"))}
for name in registered_methods():
    spec = get_method(name)
    model = spec.model_class(spec.config_class(**configs[name]))
    out["methods"][name] = {"params": sum(p.numel() for p in model.parameters()),
                            "training_method": spec.training_method.name,
                            "proposer_factory": spec.proposer_factory is not None}
out["modules"] = sorted({m.__file__ for k, m in sys.modules.items()
                         if k.split(".")[0] == "draftsmith" and getattr(m, "__file__", None)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """``{"wheel", "site", "cwd", "env"}``: the wheel built from a copy of the checkout (its
    sources, not its outputs) and installed with ``pip install --target``; ``env`` runs the venv's
    Python on that folder alone (the venv's editable install must not win), offline."""
    root = tmp_path_factory.mktemp("wheel").resolve()  # the installed code resolves its own path
    src, dist, site, cwd = root / "src", root / "dist", root / "site", root / "cwd"
    shutil.copytree(REPO, src, ignore=NOT_SOURCES)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    done = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    done = subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return {"wheel": wheel, "site": site, "cwd": cwd, "env": env}


def run(installed: dict, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([*map(str, args)], cwd=installed["cwd"], env=installed["env"], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def package_folders() -> list[Path]:
    """The checkout's folders (relative) that hold modules of the package: all but the
    checkout-only ones, outputs and hidden folders (.venv, .git)."""
    found = []
    for folder, dirs, files in os.walk(REPO):
        rel = Path(folder).relative_to(REPO)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not (rel == Path(".") and d in OUTSIDE)]
        if any(f.endswith(".py") for f in files):
            found.append(rel)
    return sorted(found)


def test_the_wheel_holds_every_package_and_the_data_beside_it(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    folders = package_folders()
    assert [str(f) for f in folders if not (REPO / f / "__init__.py").is_file()] == []  # find_packages skips those
    modules = {f"draftsmith/{p.relative_to(REPO)}" for f in folders for p in (REPO / f).glob("*.py")}
    modules.discard("draftsmith/setup.py")
    assert sorted(modules - names) == []
    assert sorted(n for n in names if n.endswith(".py")) == sorted(modules)  # no tests/, benchmarks/, setup.py
    data = {f"draftsmith/{p.relative_to(REPO)}" for pattern in DATA for p in REPO.glob(pattern)}
    assert len([d for d in data if d.startswith("draftsmith/recipes/targets/")]) >= 5
    assert sorted(data - names) == []


def test_the_installed_code_runs_from_outside_the_checkout(installed, tmp_path):
    site = installed["site"]
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps(TINY_CONFIGS))
    (tmp_path / "check.py").write_text(CHECK)
    out = json.loads(run(installed, sys.executable, tmp_path / "check.py", site, configs).stdout.splitlines()[-1])

    assert Path(out["package"]) == site / "draftsmith" / "__init__.py"  # not the checkout's editable install
    assert [m for m in out["modules"] if not m.startswith(str(site))] == []
    shipped = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert out["recipes"] == shipped
    unserved = out["unserved"]
    assert {k: v for k, v in out["validate"].items()
            if k not in unserved and (v[0] != 0 or not v[1].startswith(f"{k}: valid"))} == {}
    assert all(out["validate"][k][0] == 2 and why in out["validate"][k][2] for k, why in unserved.items())
    rc, err = out["unknown"]
    assert rc == 2 and "no_such_recipe: no such recipe file, nor a shipped recipe" in err and "gptoss120b_dflash" in err
    assert out["files"] == {"targets": str(site / "draftsmith/recipes/targets"),
                            "prompts": str(site / "draftsmith/data_prep/prompts"),
                            "launcher": str(site / "draftsmith/recipes/accelerate/fsdp_8gpu.yaml")}
    assert set(TINY_CONFIGS) == set(registered_methods()), "a method without a tiny config here"
    assert {k: (v["training_method"], v["proposer_factory"]) for k, v in out["methods"].items()} == \
        {k: (k, True) for k in registered_methods()}


@pytest.mark.parametrize("name, command", [
    ("gptoss120b", ["bin/draftsmith", "train", "gptoss120b", "--dry-run"]),  # the console script, by name
    ("llama3_1_8b", [sys.executable, "-m", "draftsmith.cli", "train", "recipes/llama3_1_8b.yaml", "--dry-run"]),
], ids=["gptoss120b", "llama3_1_8b"])
def test_offline_train_dry_run_of_a_shipped_recipe(installed, name, command):
    # the recipe, its launcher and its target's config.json all come from inside the wheel
    site = installed["site"]
    shipped = site / "draftsmith" / "recipes"
    if command[0] == "bin/draftsmith":
        command = [site / "bin" / "draftsmith", *command[1:]]
    done = run(installed, *command)
    assert f"using the shipped {shipped / name}.yaml" in done.stderr
    target = {"gptoss120b": "openai/gpt-oss-120b", "llama3_1_8b": "meta-llama/Llama-3.1-8B-Instruct"}[name]
    assert f"(config: {shipped / 'targets' / target / 'config.json'})" in done.stdout
    assert f"launcher         {shipped / 'accelerate'}/" in done.stdout
    assert "per-GPU memory" in done.stdout


def test_one_training_step_from_the_installed_code(installed, tiny_target, tmp_path):
    # EAGLE-3 on the tiny target: the data stages (tokenise, vocab, hidden states) and one step
    recipe = small_recipe(tiny_target, tmp_path)
    recipe.name, recipe.train.max_steps, recipe.train.batch_size = "tiny", 1, 2
    dump_recipe(recipe, tmp_path / "tiny.yaml")
    run_dir = tmp_path / "run"
    done = run(installed, sys.executable, "-m", "draftsmith.cli", "train", tmp_path / "tiny.yaml", "--run-dir", run_dir)
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["steps"] == 1 and Path(result["checkpoint"]) == run_dir / "checkpoints" / "step-1"
    assert (run_dir / "checkpoints" / "step-1" / "draft_config.json").is_file()


def test_a_file_that_exists_wins_over_the_shipped_recipe_of_its_name(tmp_path, monkeypatch, caplog):
    from draftsmith.recipe import load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "gptoss120b.yaml").write_text("name: mine\n")
    with caplog.at_level("INFO", logger="draftsmith.recipe"):
        assert load_recipe("recipes/gptoss120b.yaml").name == "mine"
        assert caplog.messages == []
        assert load_recipe("gptoss120b.yaml").name == "gptoss120b"  # no such file here: the shipped one
    assert caplog.messages == [f"recipe gptoss120b.yaml: no such file here; using the shipped "
                               f"{REPO / 'recipes' / 'gptoss120b.yaml'}"]
