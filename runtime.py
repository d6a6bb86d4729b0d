"""What every draftsmith command line shares: its help layout (:class:`HelpFormatter`), its log
format (:func:`setup_logging`) and the ``--dtype`` choice of the commands that run or write models."""

from __future__ import annotations

import argparse
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The help layout of every draftsmith command line: the description as written (usage
    examples keep their lines) and each flag's default appended, unless it has none (None,
    False, ``[]``) or its help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "(default" in text:
            return text
        return super()._get_help_string(action)


def setup_logging() -> None:
    """The log format of every draftsmith command line (INFO and up, to stderr); call it once,
    first thing in a ``main``."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


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
