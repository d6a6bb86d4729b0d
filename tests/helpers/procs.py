"""Processes a test started: are they (or their group) still alive, and kill what is left. psutil is
imported on use (the tests that need it skip without it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


DEATH_TIMEOUT_S = 30.0  # how long killed processes' descendants may take to die


def alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors_after_kill(proc: subprocess.Popen, descendants: list) -> list:
    """SIGKILL ``proc``, reap it, and return its ``descendants`` still alive after
    :data:`DEATH_TIMEOUT_S` seconds (empty as soon as all are gone)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + DEATH_TIMEOUT_S
    while time.monotonic() < deadline:
        left = [p for p in descendants if alive(p)]
        if not left:
            return []
        time.sleep(0.5)
    left = [p for p in descendants if alive(p)]
    report = [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
    kill_all(left)  # never leave them running on the machine
    return report


def kill_all(processes: list) -> None:
    import psutil

    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def group_alive(pgid: int) -> bool:
    """A live (non-zombie) process is left in group ``pgid`` (a container's PID 1 may never
    reap killed orphans, so ``killpg(pgid, 0)`` alone would count zombies)."""
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False
