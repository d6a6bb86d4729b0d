"""The traffic log file of ``draftsmith proxy``: JSON lines (:mod:`draftsmith.traffic_log`) appended
by a writer thread through a ``RotatingFileHandler``, so disk use is bounded (``traffic.jsonl``, ``.1``,
... ``.N``; about ``(N + 1) * max_bytes`` bytes). A failed or dropped write is counted, never raised."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_MAX_BYTES = 100 * 2**20
DEFAULT_BACKUPS = 5
WARN_EVERY_S = 60.0  # at most one stderr warning per this many seconds about lines not written
LOG_FILE_MODE = 0o600  # the log holds users' prompts and replies: readable by the proxy's user only


class _Warner:
    """Warnings on stderr at a bounded rate: the first at once, then at most one per
    :data:`WARN_EVERY_S` seconds with the count of what happened since the last one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._unreported = 0

    def __call__(self, what: str) -> None:
        with self._lock:
            self._unreported += 1
            now = time.monotonic()
            if now - self._last < WARN_EVERY_S:
                return
            count, self._unreported, self._last = self._unreported, 0, now
        print(f"draftsmith proxy: traffic log: {what}" + (f" ({count} lines not written since the last warning)"
              if count > 1 else "") + "; serving goes on, counts in GET /draftsmith/status", file=sys.stderr, flush=True)


class _CountingRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A ``RotatingFileHandler`` that counts failed writes (a full disk, a removed directory, a
    file it may not write) instead of printing a traceback per line, and creates its files with
    mode :data:`LOG_FILE_MODE` (rotated files keep it: rotation renames)."""

    failed_writes = 0
    warn: Callable[[str], None] = staticmethod(lambda what: None)

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_FILE_MODE)
        os.fchmod(fd, LOG_FILE_MODE)  # an existing file too (umask never widens it, but an older file may be wider)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed_writes += 1
        self.warn(f"write failed ({sys.exc_info()[1]!r})")


class TrafficLog:
    """The traffic log: JSON lines appended by a dedicated, non-propagating logger through a
    ``RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups)``.

    :meth:`submit` only queues a function that builds the record. The writer thread calls it,
    encodes the line and writes it, so the event loop never waits on JSON or the disk. Lines
    are ASCII JSON, so the handler's size check (in characters) is exact in bytes. A queue
    holds at most ``queue_size`` records; past that, records are dropped and counted.

    Raises:
        ValueError: ``max_bytes`` < 1 or ``backups`` < 1 (either would switch rotation off and
            leave the log unbounded), or another open :class:`TrafficLog` on the same ``path``.
    """

    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS,
                 queue_size: int = 10_000):
        if max_bytes < 1 or backups < 1:
            raise ValueError(f"traffic log rotation needs max_bytes >= 1 and backups >= 1 "
                             f"(got {max_bytes}, {backups}): the log would grow without bound")
        self.path = Path(path).expanduser().resolve()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._logger = logging.getLogger(f"draftsmith.proxy.traffic:{self.path}")
        if self._logger.handlers:
            raise ValueError(f"{self.path}: already open as a traffic log in this process")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler = _CountingRotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=backups,
                                                     encoding="utf-8", delay=True)
        self._warn = self._handler.warn = _Warner()
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)
        self.logged = 0
        self.dropped = 0  # queue full or log closed (counted on the event loop's thread)
        self.build_errors = 0  # a record that could not be built or encoded (writer thread)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="draftsmith-traffic-log", daemon=True)
        self._thread.start()

    @property
    def write_errors(self) -> int:
        """Lines not written: failed writes, records that could not be built, drops."""
        return self._handler.failed_writes + self.build_errors + self.dropped

    def error_counts(self) -> dict[str, int]:
        """Lines not written, by cause: ``failed_writes`` (the file: disk full, permissions),
        ``dropped`` (the queue was full or the log closed), ``build_errors`` (a record that could not be encoded)."""
        return {"failed_writes": self._handler.failed_writes, "dropped": self.dropped, "build_errors": self.build_errors}

    def submit(self, make_record: Callable[[], dict[str, Any]]) -> None:
        """Queue ``make_record`` (called on the writer thread). Never blocks and never raises."""
        if self._closed:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(make_record)
        except queue.Full:
            self.dropped += 1
            self._warn("the writer is behind (queue full): line dropped")

    def _write_loop(self) -> None:
        while True:
            make_record = self._queue.get()
            try:
                if make_record is None:
                    return
                line = json.dumps(make_record(), separators=(",", ":"))
                failed_before = self._handler.failed_writes
                self._logger.info(line)  # the handler catches its own write errors (handleError)
                if self._handler.failed_writes == failed_before:
                    self.logged += 1
            except Exception as exc:  # noqa: BLE001  (a bad record must not stop the writer thread)
                self.build_errors += 1
                self._warn(f"a record could not be encoded ({exc!r})")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Block until every record submitted so far is written (or counted as failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer thread and close the file. Later submissions are dropped."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._logger.removeHandler(self._handler)
        try:
            self._handler.close()  # flushes: on a full disk that fails too, and is counted like any write
        except OSError:
            self._handler.failed_writes += 1
