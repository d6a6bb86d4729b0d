"""The process reaper: children of a SIGKILLed parent die (fork and spawn), reaping is idempotent
and leaves other threads' children alone, and a bound command runs after arming."""

from __future__ import annotations
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from draftsmith import procs

from helpers.procs import alive, kill_all, survivors_after_kill


psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

PARENT = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from draftsmith.procs import install_child_reaper

    def sleep():
        time.sleep(600)

    if __name__ == "__main__":
        if sys.argv[2] == "reaper":
            install_child_reaper()
        kids = [mp.get_context(sys.argv[1]).Process(target=sleep) for _ in range(2)]
        for k in kids:
            k.start()
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_children_die_with_a_sigkilled_parent(tmp_path, method):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)

    def start(mode: str):
        proc = subprocess.Popen([sys.executable, str(script), method, mode], stdout=subprocess.PIPE, text=True)
        return proc, [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]

    proc, kids = start("reaper")
    assert len(kids) == 2 and survivors_after_kill(proc, kids) == []
    # without the reaper the children outlive their parent (what the reaper is for)
    proc, kids = start("plain")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)
    left = [p for p in kids if alive(p)]
    kill_all(left)
    assert len(left) == 2


def test_reaper_is_idempotent_and_leaves_other_threads_children_alone():
    procs.install_child_reaper()
    procs.install_child_reaper()
    import multiprocessing.context as ctx

    assert ctx.SpawnProcess._Popen.__name__ == "_Popen"
    assert ctx.SpawnProcess._Popen.__closure__ is not None
    p = ctx.SpawnProcess(target=print)
    procs._bind_spawned(p)
    procs._bind_spawned(p)  # not wrapped twice
    assert p._target.func is procs._run_bound and p._target.args == (os.getpid(), print)
    import threading

    q = ctx.SpawnProcess(target=print)
    t = threading.Thread(target=procs._bind_spawned, args=(q,))
    t.start()
    t.join()
    assert q._target is print  # started off the main thread: would die with that thread, so unbound


def test_bound_command_runs_the_command_after_arming(tmp_path):
    out = subprocess.run(procs.bound_command([sys.executable, "-m", "json.tool", "--help"]), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "json" in out.stdout
