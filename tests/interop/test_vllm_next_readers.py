"""vLLM 0.33's own speculators config reader applied to draftsmith's exports, in draftsmith's
environment: ``speculators/algos.py``, ``speculators/base.py`` and the one helper base.py imports
(``transformers_utils/utils.py``, with the ``envs`` / ``logger`` modules it needs) are loaded by
file path from the vLLM 0.33.0 wheel's sources (the ``vllm_next_src`` fixture), never from the
installed vLLM, which stays as it was. Each method's export, built from a tiny target with random
weights, goes through ``SpeculatorsConfig.extract_transformers_pre_trained_config`` and
``extract_vllm_speculative_config``; the results must be the architecture 0.33's model registry
loads, the aux layers, mask token and vocab the draft was built with, and the speculative_config
draftsmith itself hands vLLM (:func:`draftsmith.vllm_bridge.spec_config.for_export`).

Also the release table (:mod:`draftsmith.vllm_bridge.releases`) against 0.33's sources, read
with ``ast``: the methods its config accepts, the model files and architectures it ships.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from draftsmith.methods import get_method
from draftsmith.vllm_bridge import spec_config
from draftsmith.vllm_bridge.releases import architecture_releases, method_releases

from helpers.method_exports import AUX, H, MASK_TOKEN_ID, K, V, build_export, draft_config, tiny_target_config
from helpers.vllm_sources import literal_values, registered_architectures

RELEASE = "0.33.0"
SPECULATORS = "vllm.transformers_utils.configs.speculators"
# the module vLLM 0.33's registry loads each method's draft from (tests/unit/test_vllm_releases.py
# pins the tensor names each of these files loads)
MODEL_MODULE = {"eagle3": "llama_eagle3", "peagle": "llama_eagle3", "dflash": "qwen3_dflash",
                "dflash2": "qwen3_dflash2", "dspark": "qwen3_dspark"}


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def _load(src: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, src / (name.replace(".", "/") + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def speculators_config(vllm_next_src):
    """vLLM 0.33's ``SpeculatorsConfig``. Its packages are empty stand-ins whose ``__path__`` is
    the 0.33 tree (their ``__init__`` files, which import the engine, are not run); the installed
    vLLM's modules are set aside while loading and put back after."""
    for needed in ("vllm/envs.py", "vllm/logger.py", "vllm/logging_utils/__init__.py"):  # utils.py's imports
        if not (vllm_next_src / needed).is_file():
            pytest.skip(f"{vllm_next_src} has no {needed} (vllm/transformers_utils/utils.py imports it): "
                        "rebuild it with `make interop`")
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_vllm(name)}
    try:
        for package in ("vllm", "vllm.transformers_utils", "vllm.transformers_utils.configs", SPECULATORS):
            module = types.ModuleType(package)
            module.__path__ = [str(vllm_next_src / package.replace(".", "/"))]
            sys.modules[package] = module
        _load(vllm_next_src, "vllm.transformers_utils.utils")
        _load(vllm_next_src, f"{SPECULATORS}.algos")
        base = _load(vllm_next_src, f"{SPECULATORS}.base")
        tree = Path(vllm_next_src).resolve()
        outside = [f"{n}: {m.__file__}" for n, m in sys.modules.items()
                   if _is_vllm(n) and getattr(m, "__file__", None) and not Path(m.__file__).resolve().is_relative_to(tree)]
        assert not outside, f"modules loaded from outside {vllm_next_src}: {outside}"
        return base.SpeculatorsConfig
    finally:
        for name in [n for n in sys.modules if _is_vllm(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("exports")
    return {m: build_export(m, where / m) for m in MODEL_MODULE}


@pytest.fixture(scope="module")
def registry(vllm_next_src) -> dict[str, tuple[str, str]]:
    return registered_architectures(vllm_next_src / "vllm" / "model_executor" / "models" / "registry.py")


def _speculators_config(exports: dict[str, Path], method: str) -> dict:
    config = json.loads((exports[method] / "config.json").read_text())
    if "speculators_model_type" not in config:
        pytest.skip(f"the {method} export is not in speculators format (architectures {config.get('architectures')}): "
                    "vLLM reads it without the speculators reader")
    return config


@pytest.mark.parametrize("method", MODEL_MODULE)
def test_vllm_033_reads_the_draft_config_it_was_built_with(speculators_config, exports, registry, method):
    config = _speculators_config(exports, method)
    pre = speculators_config.extract_transformers_pre_trained_config(copy.deepcopy(config))
    built = draft_config(method, tiny_target_config())

    (arch,) = pre["architectures"]
    assert registry.get(arch, ("?", "?"))[0] == MODEL_MODULE[method], (arch, registry.get(arch))
    assert pre["eagle_aux_hidden_state_layer_ids"] == AUX
    assert pre["draft_vocab_size"] == built.draft_vocab_size
    assert pre["target_hidden_size"] == H
    assert pre["max_position_embeddings"] >= tiny_target_config().max_position_embeddings
    if method == "eagle3":
        assert pre["norm_before_residual"] == built.norm_before_residual
    if method == "peagle":
        assert pre["pard_token"] == MASK_TOKEN_ID
    if method in ("dflash", "dflash2"):
        selector = built.selector_fields() if method == "dflash2" else {}
        assert pre["dflash_config"] == {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": [a - 1 for a in AUX],
                                        "sample_from_anchor": False, "causal": False, **selector}
    if method == "dspark":
        assert pre["target_layer_ids"] == [a - 1 for a in AUX]
        assert (pre["mask_token_id"], pre["markov_rank"]) == (MASK_TOKEN_ID, built.markov_rank)
    made = speculators_config(**pre)  # what vLLM builds from it: a PretrainedConfig holding every key
    assert (made.model_type, made.hidden_size, made.vocab_size) == ("speculators", H, V)


@pytest.mark.parametrize("method", MODEL_MODULE)
def test_vllm_033_derives_the_speculative_config_draftsmith_asks_for(speculators_config, exports, method):
    config = _speculators_config(exports, method)
    derived = speculators_config.extract_vllm_speculative_config(copy.deepcopy(config))
    ours = spec_config.for_export(get_method(method), str(exports[method]), K)
    assert derived == {k: v for k, v in ours.items() if k != "model"}
    assert derived["num_speculative_tokens"] == K


def test_vllm_033_refuses_a_config_without_the_speculators_keys(speculators_config, exports):
    config = json.loads((exports["eagle3"] / "config.json").read_text())
    del config["speculators_config"]["verifier"]
    with pytest.raises(ValueError, match="Invalid speculators config structure"):
        speculators_config.extract_vllm_speculative_config(config)


def test_the_release_table_matches_vllm_033_sources(vllm_next_src, registry):
    vllm = vllm_next_src / "vllm"
    accepted = literal_values(vllm / "config" / "speculative.py", "SpeculativeMethod")
    for method, served in method_releases().items():
        vllm_method = get_method(method).vllm_method
        if RELEASE in served:
            assert vllm_method in accepted, method
        else:
            assert vllm_method not in accepted, method
            assert not (vllm / "model_executor" / "models" / f"{method}.py").exists(), method
    for arch, served in architecture_releases().items():
        assert (arch in registry) == (RELEASE in served), arch
