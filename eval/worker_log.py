"""The acceptance worker's log, read when the engine fails: its root cause in one line
(:func:`root_cause`), the error that names it and the kept log (:func:`failure_message`,
:func:`keep_log`)."""

from __future__ import annotations

import itertools
import os
import re
import tempfile
from pathlib import Path


_LOG_PREFIX = re.compile(r"^(?:\([\w.-]+ pid=\d+\)\s+)?(?:\[rank\d+\]:\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)"
                         r"\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?")
_RESOURCE = re.compile(r"less than (?:desired|requested)")
_ERROR = re.compile(r"^(?:[\w.]*(?:Error|Exception)|Error):\s")
_WRAPPER = re.compile(r"root cause|Engine core initialization failed", re.IGNORECASE)  # vLLM's "see above" errors
_PYDANTIC = re.compile(r"ValidationError: \d+ validation errors? for ")  # its errors follow, indented


def root_cause(log_text: str) -> str | None:
    """The line of a vLLM log that says why the run failed, without vLLM's log prefix (``(EngineCore
    pid=7) ERROR 11-29 06:57:00 [core.py:1510] ``): the last resource refusal (``... less than desired
    ...``, ``... less than requested memory for kv ...``), else the last exception line
    (``ValueError: ...``, ``torch.OutOfMemoryError: ...``) that is not one of vLLM's wrappers
    pointing at an earlier one ("See root cause above"), with the indented errors of a pydantic
    ``ValidationError`` (vLLM's config classes) joined to it; None: no such line."""
    bare = [_LOG_PREFIX.sub("", line).rstrip() for line in log_text.splitlines()]
    lines = [line.strip() for line in bare]
    for wanted in (lambda line: _RESOURCE.search(line),
                   lambda line: _ERROR.match(line) and not _WRAPPER.search(line)):
        found = [i for i, line in enumerate(lines) if wanted(line)]
        if found:
            i = found[-1]
            more = [] if not _PYDANTIC.search(lines[i]) else [re.sub(r"\s*\[type=.*$", "", line) for line in
                    itertools.takewhile(lambda b: b.startswith(" "), bare[i + 1:]) if "errors.pydantic.dev" not in line]
            return ": ".join([lines[i], *(line.strip() for line in more)])
    return None


MEMORY_HINT = ("; on CPU pass a CPU recipe (--recipe) or --gpu-memory-utilization 0.2 (there the fraction of RAM "
               "for the KV cache), or set --kv-cache-memory-gib")


def failure_message(method: str, returncode: int | None, log_path: Path) -> str:
    """One line for a failed worker: its exit, the log's :func:`root_cause` (else its last line)
    and where the whole log is."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        text = ""
    cause = root_cause(text) or next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "no output")
    if len(cause) > 1500:
        cause = cause[:1500] + "..."
    how = (f"killed by signal {-returncode}" if returncode is not None and returncode < 0
           else f"exit code {returncode}" + (", no result written" if returncode == 0 else ""))
    if _RESOURCE.search(cause):
        cause = cause.rstrip(".") + MEMORY_HINT
    return f"vLLM run ({method}) failed ({how}): {cause} (full log: {log_path})"


def keep_log(log_path: Path, method: str) -> Path:
    """A copy of the temporary ``log_path`` that outlives its folder (in the system's temporary
    directory, ``draftsmith-acceptance-<method>-*.vllm.log``)."""
    import shutil

    fd, kept = tempfile.mkstemp(prefix=f"draftsmith-acceptance-{method}-", suffix=".vllm.log")
    os.close(fd)
    shutil.copyfile(log_path, kept)
    return Path(kept)
