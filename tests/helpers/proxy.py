"""In-process pieces of the proxy tests: the OpenAI stub of ``benchmarks/stub_openai.py`` as an async
context, the proxy on a free port, the log's records, request bodies and SSE events."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from benchmarks.stub_openai import StubOpenAI
from draftsmith.serve.proxy import TrafficLog, TrafficProxy


@contextlib.asynccontextmanager
async def stub(**kwargs):
    s = StubOpenAI(**kwargs)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


@contextlib.asynccontextmanager
async def proxy_on(upstream: str, log_path: Path | None, **kwargs):
    """``(proxy, base URL)``; the log is closed (fully written) when the block exits."""
    log = TrafficLog(log_path, max_bytes=2**20, backups=2) if log_path is not None else None
    proxy = TrafficProxy(upstream, log, **kwargs)
    try:
        yield proxy, await proxy.start("127.0.0.1", 0)
    finally:
        await proxy.close()
        if log is not None:
            log.close()


def records(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []


def body(user: str, stream: bool = False, **extra) -> dict:
    return {"model": "m", "user": user, "stream": stream, "messages": [{"role": "user", "content": "hi"}], **extra}


def sse_events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
