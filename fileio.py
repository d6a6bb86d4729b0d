"""Atomic, disk-full-aware file writes shared by the stages (manifests, markers, the
regeneration cache, ``metrics.jsonl``) and a full disk recognised anywhere (checkpoints).

:func:`atomic_file` / :func:`atomic_write_bytes` write to a temp file beside the target
(:func:`temp_path`), fsync it and rename it over the target, so a killed process leaves the old
file or the new one, never a torn one. A full disk or quota (:func:`is_disk_full`) becomes a
one-line :class:`DiskFullError` naming the file and the bytes it needs, with the partial temp
file removed (:func:`removed_on_error`); :func:`check_free_space` refuses a write up front. The
hidden-state shards stream through the same temp file, guard and writes
(:class:`draftsmith.data_prep.shards.ShardWriter`).

:class:`ShardError` lives here because :class:`DiskFullError` is one (the stages' error
handlers catch a full disk as a shard error); the shard format that raises it for everything
else is :mod:`draftsmith.data_prep.shards`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator


class ShardError(RuntimeError):
    """A shard disagrees with its manifest (shape, dtype, checksum) or is unreadable."""


class DiskFullError(ShardError):
    """A shard or manifest did not fit on the disk; the message (one line) names the file and
    the bytes it needs. The partial file is removed; finished shards and the manifest are
    intact, so a rerun after freeing space resumes."""


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` or an exception in its cause / context chain is a full disk or quota:
    an ``OSError`` with ``ENOSPC`` / ``EDQUOT``, or a library error that wraps one in its
    message (safetensors reports ``No space left on device`` in a ``SafetensorError``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if any(os.strerror(e) in str(exc) for e in _DISK_FULL_ERRNOS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def check_free_space(directory: Path | str, need_bytes: int, what: str) -> None:
    """Refuse to start writing ``what`` (``need_bytes`` bytes) into ``directory`` when its
    file system has less free space (``shutil.disk_usage``).

    Raises:
        DiskFullError: one line naming ``directory``, ``what`` and both byte counts.
    """
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise DiskFullError(f"{directory}: {what} needs {need_bytes} bytes but the disk has {free} free; "
                            "free space and rerun (finished files are kept)")


def temp_path(path: Path) -> Path:
    """Where ``path`` is written before its atomic rename (one per process)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def removed_on_error(tmp: Path, path: Path, need_bytes: int | None) -> Iterator[None]:
    """Remove ``tmp`` when the body raises; a full disk becomes :class:`DiskFullError`
    (``need_bytes`` None: the bytes written before the disk filled are named)."""
    try:
        yield
    except BaseException as exc:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            free = shutil.disk_usage(path.parent).free
            need = (f"needs {need_bytes} bytes" if need_bytes is not None
                    else f"needs more than the {written} bytes written")
            raise DiskFullError(f"{path}: disk full: the file {need}, {free} free after removing "
                                "its partial write; free space and rerun (finished files are kept)") from exc
        raise


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than it is given)."""
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def atomic_file(path: Path, need_bytes: int | None = None) -> Iterator["_FdWriter"]:
    """Write ``path`` atomically: the body writes to the yielded binary file (a temp file beside
    ``path``), which is then fsynced and renamed over ``path``; if the body raises, ``path`` is
    left as it was and the temp file removed. Every file draftsmith rewrites in place goes
    through here (manifests, markers, the regeneration cache, ``metrics.jsonl``); shards stream
    through :class:`~draftsmith.data_prep.shards.ShardWriter`.

    Raises:
        DiskFullError: the disk filled up (one line naming ``path`` and ``need_bytes``, or the
            bytes written so far when not given).
    """
    tmp = temp_path(path)
    with removed_on_error(tmp, path, need_bytes):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fh = _FdWriter(fd)
            yield fh
            fh.flush()
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)


class _FdWriter:
    """Binary writes to a descriptor through ``os.write``, buffered in 1 MiB pieces; nothing is
    written after :func:`atomic_file` closes the descriptor (no flush at garbage collection)."""

    BUFFER = 1 << 20

    def __init__(self, fd: int):
        self._fd, self._buf = fd, bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        if len(self._buf) >= self.BUFFER:
            self.flush()
        return len(data)

    def flush(self) -> None:
        write_all(self._fd, memoryview(self._buf))
        self._buf.clear()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_file`.

    Raises:
        DiskFullError: the disk filled up (``path`` is left as it was, the temp file removed).
    """
    with atomic_file(path, len(data)) as fh:
        fh.write(data)


def tree_bytes(path: Path) -> int:
    """Bytes of ``path``: a file's size, or the sizes of the regular files under a directory
    (symlinks not followed); 0 when it does not exist."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return path.stat().st_size if path.is_file() else 0
