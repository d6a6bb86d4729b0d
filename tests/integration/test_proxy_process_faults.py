"""``draftsmith proxy`` when an upstream process dies: SIGKILLed mid-stream (the stream ends with an
error event, the proxy keeps serving), and a managed server whose process dies (503 until the
restarted one is healthy). The upstreams are the OpenAI stub of ``benchmarks/stub_openai.py`` in
their own processes: no vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import aiohttp

from benchmarks.proxy_load import start_stub
from draftsmith.serve import managed as managed_module
from draftsmith.serve.proxy import ManagedServers
from draftsmith.vllm_bridge.server import ServerOptions
from helpers.proxy import body, proxy_on, records, sse_events, stub


def test_an_upstream_killed_mid_stream_ends_the_stream_with_an_error_event_and_the_proxy_keeps_serving(tmp_path):
    log_path = tmp_path / "traffic.jsonl"
    proc, url = start_stub(tokens=200, token_rate=10)  # 20 s of stream: killed long before its end

    async def scenario():
        async with stub() as spare, proxy_on(url, log_path) as (proxy, purl), aiohttp.ClientSession() as client:
            async with client.post(purl + "/v1/chat/completions", json=body("cut", stream=True)) as r:
                first = await r.content.readany()
                os.kill(proc.pid, signal.SIGKILL)
                killed = time.monotonic()
                rest = await r.content.read()
                ended_after = time.monotonic() - killed
            async with client.post(purl + "/v1/chat/completions", json=body("dead")) as r:
                dead = r.status, await r.json()
            await proxy.swap(spare.url)
            async with client.post(purl + "/v1/chat/completions", json=body("after")) as r:
                after = r.status
            proxy.log.flush()
            return first + rest, ended_after, dead, after

    try:
        raw, ended_after, dead, after = asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait()
    events = sse_events(raw)
    assert ended_after < 5
    assert json.loads(events[-1])["error"]["code"] == 502 and "[DONE]" not in events  # an error, not a clean end
    assert dead[0] == 502 and dead[1]["error"]["type"] == "BadGateway"
    assert after == 200
    cut, unreachable, fine = records(log_path)
    assert (cut["status"], cut["error"], cut["choices"][0]["finish_reason"]) == (200, "upstream_disconnected", None)
    assert cut["choices"][0]["text"].startswith("tok0")
    assert (unreachable["status"], unreachable["error"], unreachable["choices"]) == (502, "upstream_unreachable", [])
    assert (fine["status"], fine["error"]) == (200, None)


def test_a_managed_server_that_dies_is_restarted_and_the_proxy_answers_503_until_it_is_healthy(tmp_path, monkeypatch):
    started: list = []

    @contextlib.contextmanager
    def stub_server(target, spec, opts, log_path):  # a vllm serve stand-in: the stub in its own process
        proc, url = start_stub()
        started.append(proc)
        try:
            yield {"base_url": url, "port": int(url.rsplit(":", 1)[1]), "pgid": proc.pid, "command": ["stub"],
                   "alive": lambda: proc.poll() is None}
        finally:
            proc.kill()
            proc.wait()

    monkeypatch.setattr(managed_module, "vllm_server", stub_server)
    monkeypatch.setattr(managed_module, "draft_speculative_config",
                        lambda draft, target, k, *_: {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})
    servers = ManagedServers(tmp_path / "target", ServerOptions(), 3, tmp_path / "servers")
    first = servers.start_blocking(tmp_path / "draft")

    async def scenario():
        async with proxy_on(first["base_url"], tmp_path / "traffic.jsonl", servers=servers) as (proxy, purl), \
                aiohttp.ClientSession() as client:
            async with client.post(purl + "/v1/chat/completions", json=body("before")) as r:
                before = r.status
            started[0].kill()
            started[0].wait()
            statuses, deadline = [], time.monotonic() + 60
            while time.monotonic() < deadline:
                async with client.post(purl + "/v1/chat/completions", json=body("during")) as r:
                    statuses.append((r.status, r.headers.get("Retry-After"), (await r.json()).get("error")))
                if statuses[-1][0] == 200:
                    break
                await asyncio.sleep(0.2)
            proxy.log.flush()
            return before, statuses, proxy.status()

    try:
        before, statuses, status = asyncio.run(scenario())
    finally:
        servers.close_blocking()
    assert before == 200 and statuses[-1][0] == 200 and len(started) == 2
    assert {s for s, _, _ in statuses[:-1]} == {503}
    assert all(retry == "10" and "being restarted" in err["message"] for _, retry, err in statuses[:-1])
    assert status["counters"]["restarts"] == 1 and status["upstream"]["base_url"] != first["base_url"]
    assert list(status["servers"]) == [status["upstream"]["base_url"]]  # the dead one is retired
    logged = records(tmp_path / "traffic.jsonl")
    assert [r["error"] for r in logged if r["status"] == 503] == ["upstream_restarting"] * (len(statuses) - 1)
