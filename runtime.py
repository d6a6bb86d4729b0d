"""The ``--dtype`` choice shared by the commands that run or write models."""

from __future__ import annotations

from typing import Any


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
