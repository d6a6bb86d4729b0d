"""Children of a SIGKILLed process die with it (``data_prep/procs.py``): plain multiprocessing
children (fork and spawn), vLLM's EngineCore under ``draftsmith prepare``, and the vLLM server."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from draftsmith.data_prep import procs

from helpers.tiny import CPU_VLLM, write_jsonl
from helpers.recipes import tiny_recipe

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")

DEATH_TIMEOUT_S = 30.0


def alive(p) -> bool:
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


def assert_engine_processes_die_with(proc: subprocess.Popen, descendants: list) -> None:
    """``descendants`` include vLLM's engine processes, and none of them outlives a SIGKILL of ``proc``."""
    assert any("EngineCore" in " ".join(p.cmdline()) or "spawn_main" in " ".join(p.cmdline())
               for p in descendants), [p.cmdline() for p in descendants]
    assert survivors_after_kill(proc, descendants) == []


def kill_all(processes: list) -> None:
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def wait_for(pred, timeout_s: float, proc: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"process exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}:\n{log.read_text()[-4000:]}")


PARENT = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from draftsmith.data_prep.procs import install_child_reaper

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


@pytest.mark.vllm
@pytest.mark.integration
@needs_vllm
def test_sigkilled_prepare_leaves_no_vllm_engine_running(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"id": f"p{i}", "prompt": f"Tell me a long story about topic {i}."} for i in range(64)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=1)
    recipe.data.regenerate.engine = "vllm"
    recipe.data.regenerate.max_new_tokens = 512  # long enough to be killed while generating
    recipe.vllm = recipe.vllm.model_copy(update=dict(CPU_VLLM, max_model_len=1024))
    from draftsmith.recipe import dump_recipe

    run = tmp_path / "run"
    run.mkdir()
    dump_recipe(recipe, tmp_path / "recipe.yaml")
    log = tmp_path / "prepare.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "draftsmith.data_prep.prepare", str(tmp_path / "recipe.yaml"),
                                 "--run-dir", str(run), "--stage", "target", "--stage", "regenerate"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        # the cache is opened once the engine is up, right before the first batch is generated
        wait_for(lambda: (run / "data" / "regen.jsonl").exists(), 600, proc, log, "regeneration to start")
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert_engine_processes_die_with(proc, descendants)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


OWNER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from draftsmith.recipe import VllmConfig
    from draftsmith.vllm_server import ServerOptions, vllm_server

    opts = ServerOptions(engine=VllmConfig(**json.loads(sys.argv[3])))
    with vllm_server(Path(sys.argv[1]), None, opts, Path(sys.argv[2])) as server:
        Path(sys.argv[4]).write_text(str(server["pgid"]))
        time.sleep(600)
""")


@pytest.mark.vllm
@pytest.mark.integration
@needs_vllm
def test_sigkilled_owner_of_a_vllm_server_leaves_no_server_running(tiny_target, tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text(OWNER)
    engine = json.dumps(dict(CPU_VLLM, max_model_len=512))
    log, pgid = tmp_path / "server.log", tmp_path / "pgid"
    with (tmp_path / "owner.log").open("w") as out:
        proc = subprocess.Popen([sys.executable, str(owner), str(tiny_target), str(log), engine, str(pgid)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: pgid.exists() and pgid.read_text().strip(), 600, proc, log, "the server to become healthy")
        server = psutil.Process(int(pgid.read_text()))
        descendants = [server] + server.children(recursive=True)
        assert_engine_processes_die_with(proc, descendants)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
