"""One writer per run directory: an advisory lock file, ``RUN_DIR/.draftsmith.lock``.

Every command that writes into a run directory (``prepare``, ``train``, ``adapt``, ``export``
into the run) holds the lock while it works:

    with run_dir_lock(run_dir, "draftsmith prepare recipes/x.yaml"):
        ...

The lock file is JSON: the holder's ``pid``, ``host``, ``command`` and ``since`` (UTC). It is
created with ``O_CREAT | O_EXCL``, so of two commands started together one gets it. A second
command is refused with one line naming the holder (:class:`RunDirLockedError`). A lock left by
a process that died (same host, no such pid) is taken over with one warning. A lock from
another host cannot be checked from here: it is refused, naming the host and the file to delete
once that process is known to be gone.

The processes a holder starts (the data-stage children of ``train``, torchrun ranks) are covered
by it: the holder exports :data:`ENV` (``path:pid``), and a process that finds the lock held by
the pid named there proceeds without taking it. Within one process the lock is re-entrant.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("draftsmith.run_lock")

LOCK_FILE = ".draftsmith.lock"
ENV = "DRAFTSMITH_RUN_LOCK"
_held: dict[str, int] = {}  # lock path -> nesting depth, in this process


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory's lock; one line naming it."""


def lock_path(run_dir: Path | str) -> Path:
    """``RUN_DIR/.draftsmith.lock``."""
    return Path(run_dir) / LOCK_FILE


def read_lock(run_dir: Path | str) -> dict[str, Any] | None:
    """The lock file's fields, or None when there is none (an unreadable one: ``{}``)."""
    try:
        text = lock_path(run_dir).read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (killed, not yet reaped by its parent) holds nothing
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def holder_text(info: dict[str, Any]) -> str:
    """``pid 123 on host h (draftsmith train ...), since ...`` for a lock's fields."""
    cmd = info.get("command") or "unknown command"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} ({cmd}), since {info.get('since', '?')}"


def _covered(path: Path, info: dict[str, Any]) -> bool:
    """Whether this process is covered by the holder: it is the holder, or the holder named
    itself in :data:`ENV` of an ancestor that started this process."""
    if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
        return True
    inherited = os.environ.get(ENV, "")
    want_path, _, want_pid = inherited.rpartition(":")
    return bool(inherited) and want_path == str(path.resolve()) and want_pid == str(info.get("pid"))


def _create(path: Path, command: str) -> bool:
    """Create the lock file exclusively; False when it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    since = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with os.fdopen(fd, "w") as fh:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "command": command, "since": since}, fh)
    return True


def acquire(run_dir: Path | str, command: str) -> bool:
    """Take ``run_dir``'s lock for this process (creating ``run_dir``). Returns True when this
    call took it (release it with :func:`release`), False when this process was already
    covered (re-entrant, or a child of the holder).

    Raises:
        RunDirLockedError: a live process (or one on another host) holds it.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(run_dir)
    key = str(path.resolve())
    if key in _held:
        _held[key] += 1
        return True
    for _ in range(3):  # a stale lock is moved aside, then created afresh; another may win the race
        if _create(path, command):
            _held[key] = 1
            os.environ[ENV] = f"{key}:{os.getpid()}"
            return True
        info = read_lock(run_dir)
        if info is None:
            continue  # released meanwhile
        if _covered(path, info):
            return False
        pid, host = info.get("pid"), info.get("host")
        if isinstance(pid, int) and host == socket.gethostname() and not _alive(pid):
            log.warning("%s: taking over the lock of %s, which is no longer running", run_dir,
                        holder_text(info))
            with contextlib.suppress(FileNotFoundError):
                aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
                os.replace(path, aside)
                aside.unlink()
            continue
        if host != socket.gethostname() and isinstance(pid, int):
            raise RunDirLockedError(
                f"{run_dir} is in use by {holder_text(info)}: its lock {path} was taken on another host, "
                f"where this one cannot check it; wait for that command, or delete {path} once it is known to "
                f"have stopped")
        if not info:
            raise RunDirLockedError(f"{path}: an unreadable lock file; delete it if no draftsmith command is "
                                    f"working in {run_dir}")
        raise RunDirLockedError(f"{run_dir} is in use by {holder_text(info)}; wait for it to finish or "
                                f"stop it (a lock left by a process that died is taken over)")
    raise RunDirLockedError(f"{path}: could not take the lock (another command keeps taking it)")


def release(run_dir: Path | str) -> None:
    """Give back a lock :func:`acquire` took (the file is removed when the outermost holder of
    this process releases it)."""
    path = lock_path(run_dir)
    key = str(path.resolve())
    depth = _held.get(key, 0)
    if depth > 1:
        _held[key] = depth - 1
        return
    _held.pop(key, None)
    info = read_lock(run_dir)
    if info and info.get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    if os.environ.get(ENV, "").startswith(f"{key}:"):
        os.environ.pop(ENV, None)


@contextlib.contextmanager
def run_dir_lock(run_dir: Path | str, command: str) -> Iterator[None]:
    """Hold ``run_dir``'s lock around a block (see the module docstring).

    Raises:
        RunDirLockedError: another live process holds it (one line naming pid, host and command).
    """
    took = acquire(run_dir, command)
    try:
        yield
    finally:
        if took:
            release(run_dir)


def command_line(argv: list[str] | None = None, prog: str = "draftsmith") -> str:
    """The command a lock names: ``prog`` and its arguments (``sys.argv[1:]`` by default), shell
    quoted, cut at 300 characters."""
    import shlex
    import sys

    args = sys.argv[1:] if argv is None else argv
    return " ".join([prog, *map(shlex.quote, map(str, args))])[:300]
