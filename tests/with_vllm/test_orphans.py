"""Children of a SIGKILLed process die with it (``procs.py``): plain multiprocessing
children (fork and spawn), vLLM's EngineCore under ``draftsmith prepare``, and the vLLM server."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers.tiny import CPU_VLLM, write_jsonl
from helpers.recipes import tiny_recipe
from helpers.procs import survivors_after_kill

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def assert_engine_processes_die_with(proc: subprocess.Popen, descendants: list) -> None:
    """``descendants`` include vLLM's engine processes, and none of them outlives a SIGKILL of ``proc``."""
    assert any("EngineCore" in " ".join(p.cmdline()) or "spawn_main" in " ".join(p.cmdline())
               for p in descendants), [p.cmdline() for p in descendants]
    assert survivors_after_kill(proc, descendants) == []


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
        proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli.prepare", str(tmp_path / "recipe.yaml"),
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
    from draftsmith.vllm_bridge.server import ServerOptions, vllm_server

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
