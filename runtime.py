"""What every draftsmith command line shares: its help layout (:class:`HelpFormatter`), its log
format (:func:`setup_logging`) and the ``--dtype`` choice of the commands that run or write models."""

from __future__ import annotations

import argparse
import re
from typing import Any

# reST inline markup of docstrings (the descriptions of most commands are their module's), left to
# right so that a literal's content is taken as is: ``literal``, :role:`target` (also :py:func:),
# **strong**
_MARKUP = re.compile(r"``(?P<literal>.+?)``"
                     r"|(?<![\w:])(?::[A-Za-z][\w-]*)+:`(?P<role>[^`]+)`"
                     r"|\*\*(?P<strong>[^*\s](?:[^*\n]*[^*\s])?)\*\*", re.S)


def _plain(match: re.Match) -> str:
    if match["literal"] is not None:
        return match["literal"]
    if match["strong"] is not None:
        return match["strong"]
    text = match["role"].strip()
    titled = re.fullmatch(r"(.+?)\s*<[^<>]+>", text, re.S)  # :role:`text <target>`
    if titled:
        return titled[1]
    if text.startswith("~"):  # :role:`~a.b.c`: the last component
        return text[1:].rsplit(".", 1)[-1]
    return text.removeprefix("!")


def plain_text(text: str) -> str:
    """``text`` (a docstring, a help string) without its reST inline markup, as a terminal shows
    it: a literal in double backquotes is its text, a role (:mod:, :func:, :class:, ...) is its
    target (a.b.c; ~a.b.c: c; "text <target>": text), strong emphasis is its text; lines and
    indentation are kept (tests/unit/test_help_text.py)."""
    return _MARKUP.sub(_plain, text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The help layout of every draftsmith command line: the description as written (usage
    examples keep their lines) but in plain text (:func:`plain_text`: most descriptions are module
    docstrings), and each flag's help in plain text with its default appended, unless it has
    none (None, False, ``[]``) or its help already states it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "(default" in text:
            return plain_text(text)
        return plain_text(super()._get_help_string(action))


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
