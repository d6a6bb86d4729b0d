"""``draftsmith proxy`` (serve/proxy.py) over real HTTP on loopback. Fake OpenAI upstreams,
written here, name themselves in every answer and echo the request. The proxy runs in-process on a
free port. No vLLM, no network."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from draftsmith.serve import managed as managed_module
from draftsmith.cli.proxy import main
from draftsmith.serve.proxy import ManagedServers, TrafficLog, TrafficProxy
from draftsmith.vllm_bridge.server import ServerOptions, ServerStartError, free_port

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
PIECES = 4  # content deltas per streamed reply
FINISHED = web.RequestKey("finished", bool)  # FakeUpstream counted this answer as done


def reply_text(upstream: str, rid: str) -> str:
    return f"{upstream} answers {rid}"


class FakeUpstream:
    """An OpenAI server: chat (plain and SSE), completions, models, health. The body's ``rid``
    names the request, ``delay`` (seconds) slows the answer, ``fail`` answers 500. It records
    what it received, when each answer finished, the headers it got and the exact SSE bytes it sent."""

    def __init__(self, name: str):
        self.name = name
        self.received: list[tuple[str, float]] = []  # (rid, monotonic seconds)
        self.completed: list[tuple[str, float]] = []
        self.headers: list[dict[str, str]] = []
        self.sent: dict[str, bytes] = {}
        self.cancelled: list[str] = []  # requests whose connection closed before the answer (vLLM aborts them)
        self.active = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _body(self, request: web.Request) -> dict | None:
        self.headers.append(dict(request.headers))
        try:
            body = json.loads(await request.read())
        except ValueError:
            return None
        self.received.append((body.get("rid", "?"), time.monotonic()))
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if body is None:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        self.active += 1
        rid = body.get("rid", "?")
        try:
            if body.get("fail"):
                await asyncio.sleep(body.get("delay", 0))
                return web.json_response({"error": {"message": f"{self.name} failed {rid}"}}, status=500)
            text = reply_text(self.name, rid)
            if not body.get("stream"):
                await asyncio.sleep(body.get("delay", 0))
                return web.json_response({
                    "id": f"chatcmpl-{rid}", "object": "chat.completion", "model": body.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}], "usage": USAGE})
            return await self._stream(request, body, rid, text)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self._finish(request, rid)

    def _finish(self, request: web.Request, rid: str) -> None:
        """Count an answer as done: once, and for a stream before its last bytes go out (the proxy
        cannot have read the whole answer before this runs, whatever the scheduling)."""
        if not request.get(FINISHED):
            request[FINISHED] = True
            self.active -= 1
            self.completed.append((rid, time.monotonic()))

    async def _stream(self, request: web.Request, body: dict, rid: str, text: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        sent = bytearray()

        async def event(payload) -> None:
            data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
            sent.extend(data)
            await resp.write(data)

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "model": body.get("model"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        await event(chunk({"role": "assistant", "content": ""}))
        first, second, rest = text.split(" ", 2)
        pieces = [first, " " + second, " " + rest, ""]  # PIECES deltas, the last one empty
        for piece in pieces:
            await asyncio.sleep(body.get("delay", 0) / PIECES)
            await event(chunk({"content": piece}))
        await event(chunk({}, "length" if body.get("max_tokens") == 3 else "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "choices": [], "usage": USAGE})
        await event("[DONE]")
        self.sent[rid] = bytes(sent)
        self._finish(request, rid)
        await resp.write_eof()
        return resp

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body is None:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        self.completed.append((body.get("rid", "?"), time.monotonic()))
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                                  "choices": [{"index": 0, "text": f"{body['prompt']} -> {self.name}",
                                               "finish_reason": "length"}], "usage": USAGE})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}], "served_by": self.name,
                                  "query": request.query_string})


@contextlib.asynccontextmanager
async def upstreams(*names: str):
    fakes = [FakeUpstream(n) for n in names]
    for f in fakes:
        await f.start()
    try:
        yield fakes
    finally:
        for f in fakes:
            await f.close()


@contextlib.asynccontextmanager
async def running_proxy(log_path: Path, upstream: str, max_bytes: int = 2**20, backups: int = 2, **kwargs):
    """``(proxy, base URL)``; the log is closed (so fully written) when the block exits."""
    log = TrafficLog(log_path, max_bytes=max_bytes, backups=backups)
    proxy = TrafficProxy(upstream, log, **kwargs)
    try:
        yield proxy, await proxy.start("127.0.0.1", 0)
    finally:
        await proxy.close()
        log.close()


def log_lines(log_path: Path) -> list[dict]:
    """Every record of the log and its rotated files, oldest first."""
    rotated = sorted(log_path.parent.glob(log_path.name + ".*"), key=lambda p: int(p.suffix[1:]), reverse=True)
    files = rotated + ([log_path] if log_path.exists() else [])
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


async def ask(client: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


def chat(rid: str, **extra) -> dict:
    return {"model": "m", "rid": rid, "messages": [{"role": "user", "content": f"question {rid}"}], **extra}


def streamed_text(raw: bytes) -> str:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                out.append(c["delta"].get("content", ""))
    return "".join(out)


def test_plain_chat_and_completions_pass_through_and_each_logs_one_line(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (_, url), aiohttp.ClientSession() as client:
            direct = await (await client.post(a.url + "/v1/chat/completions", json=chat("r0"))).read()
            before = time.time()
            body = chat("r1", temperature=0.7, top_p=0.9, max_tokens=64, n=1, seed=5, stop=["\n\n"], delay=0.05)
            async with client.post(url + "/v1/chat/completions", json=body) as r:
                chat_status, chat_type, chat_raw = r.status, r.content_type, await r.read()
            async with client.post(url + "/v1/completions",
                                   json={"model": "m", "rid": "r2", "prompt": "2+2=", "max_tokens": 3}) as r:
                completion = await r.json()
            after = time.time()
        return direct, chat_status, chat_type, chat_raw, completion, before, after

    direct, status, ctype, raw, completion, before, after = asyncio.run(scenario())
    assert status == 200 and ctype == "application/json"
    assert raw == direct.replace(b"r0", b"r1")  # the upstream's bytes, unchanged
    assert completion["choices"][0]["text"] == "2+2= -> A"
    lines = log_lines(log_path)
    assert [r["endpoint"] for r in lines] == ["chat", "completions"]
    chat_line, completion_line = lines
    assert set(chat_line) == {"version", "id", "time", "endpoint", "model", "upstream", "status", "request",
                              "choices", "usage", "latency_s", "error"}
    assert chat_line["error"] is None and completion_line["error"] is None
    assert chat_line["version"] == 1 and len(chat_line["id"]) == 32 and chat_line["id"] != completion_line["id"]
    assert before <= chat_line["time"] <= after and 0.05 <= chat_line["latency_s"] < 5
    assert chat_line["model"] == "m" and chat_line["upstream"] == "upstream-0" and chat_line["status"] == 200
    assert chat_line["choices"] == [{"index": 0, "text": "A answers r1", "finish_reason": "stop"}]
    assert chat_line["usage"] == USAGE
    assert {k: chat_line["request"][k] for k in ("temperature", "top_p", "max_tokens", "n", "seed", "stop")} == \
        {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "n": 1, "seed": 5, "stop": ["\n\n"]}
    assert chat_line["request"]["messages"] == [{"role": "user", "content": "question r1"}]
    assert completion_line["choices"] == [{"index": 0, "text": "2+2= -> A", "finish_reason": "length"}]
    assert completion_line["request"]["prompt"] == "2+2=" and completion_line["usage"] == USAGE


def test_streamed_chat_reaches_the_client_byte_for_byte_and_logs_the_joined_text(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (_, url), aiohttp.ClientSession() as client:
            body = chat("s1", stream=True, stream_options={"include_usage": True}, delay=0.08)
            async with client.post(url + "/v1/chat/completions", json=body) as r:
                arrivals, raw = [], b""
                async for chunk in r.content.iter_any():
                    arrivals.append(time.monotonic())
                    raw += chunk
                return r.status, r.content_type, raw, arrivals, a.sent["s1"]

    status, ctype, raw, arrivals, sent = asyncio.run(scenario())
    assert status == 200 and ctype == "text/event-stream"
    assert raw == sent and raw.endswith(b"data: [DONE]\n\n")
    assert len(arrivals) > 1 and arrivals[-1] - arrivals[0] > 0.03  # passed on as it came, not buffered
    (line,) = log_lines(log_path)
    assert line["choices"] == [{"index": 0, "text": "A answers s1", "finish_reason": "stop"}]
    assert line["usage"] == USAGE and line["request"]["stream"] is True and line["status"] == 200


def test_an_upstream_error_is_passed_through_and_a_body_that_is_not_json_is_refused_unforwarded_and_unlogged(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (proxy, url), aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/chat/completions", json=chat("e1", fail=True)) as r:
                failed = r.status, await r.json()
            async with client.post(url + "/v1/completions", data=b"not json {",
                                   headers={"Content-Type": "text/plain"}) as r:
                not_json = r.status, await r.json()
            async with client.post(url + "/v1/chat/completions", json=chat("ok")) as r:
                after = r.status, await r.json()
            return failed, not_json, after, proxy.status()["counters"]

    failed, not_json, after, counters = asyncio.run(scenario())
    assert failed == (500, {"error": {"message": "A failed e1"}})
    assert not_json[0] == 400 and not_json[1]["error"]["type"] == "BadRequest"
    assert "must be a JSON object" in not_json[1]["error"]["message"]
    assert after[0] == 200 and after[1]["choices"][0]["message"]["content"] == "A answers ok"
    lines = log_lines(log_path)
    assert [(r["status"], r["choices"], r["usage"]) for r in lines] == [(500, [], None), (200, lines[1]["choices"], USAGE)]
    assert lines[0]["request"]["rid"] == "e1" and lines[1]["request"]["rid"] == "ok"
    assert counters["requests"] == 2 and counters["rejected"] == 1 and counters["upstream_errors"] == 0


def test_unreachable_upstream_answers_502_is_logged_and_the_proxy_keeps_serving(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("B") as (b,), running_proxy(log_path, f"http://127.0.0.1:{free_port()}") as (proxy, url), aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/chat/completions", json=chat("x1")) as r:
                unreachable = r.status, await r.json()
            await proxy.swap(b.url, label="B")
            async with client.post(url + "/v1/chat/completions", json=chat("x2")) as r:
                after = r.status, await r.json()
            return unreachable, after, proxy.status()["counters"]

    unreachable, after, counters = asyncio.run(scenario())
    assert unreachable[0] == 502 and unreachable[1]["error"]["code"] == 502
    assert after[0] == 200 and after[1]["choices"][0]["message"]["content"] == "B answers x2"
    lines = log_lines(log_path)
    assert [(r["status"], r["choices"], r["upstream"]) for r in lines] == \
        [(502, [], "upstream-0"), (200, [{"index": 0, "text": "B answers x2", "finish_reason": "stop"}], "B")]
    assert counters["upstream_errors"] == 1 and counters["swaps"] == 1


def test_other_paths_and_query_strings_are_forwarded_and_not_logged(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (_, url), aiohttp.ClientSession() as client:
            async with client.get(url + "/v1/models?limit=2&after=x") as r:
                models = r.status, await r.json()
            async with client.get(url + "/health") as r:
                health = r.status
            async with client.get(url + "/nowhere") as r:
                missing = r.status
            return models, health, missing

    models, health, missing = asyncio.run(scenario())
    assert models == (200, {"object": "list", "data": [{"id": "m"}], "served_by": "A", "query": "limit=2&after=x"})
    assert health == 200 and missing == 404  # the upstream's own 404
    assert log_lines(log_path) == []


def test_secrets_and_headers_never_reach_the_log(tmp_path):
    log_path = tmp_path / "traffic.jsonl"
    headers = {"Authorization": "Bearer sk-secret", "User-Agent": "agent-marker", "X-Custom": "header-marker"}

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (_, url), aiohttp.ClientSession(headers=headers) as client:
            for body in (chat("p1", api_key="sk-secret"), chat("p2", api_key="sk-secret", stream=True)):
                async with client.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            async with client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi",
                                                                   "api_key": "sk-secret"}) as r:
                assert r.status == 200
            return a.headers

    seen_upstream = asyncio.run(scenario())
    # forwarded (vLLM's --api-key needs it) ...
    assert all(h["Authorization"] == "Bearer sk-secret" and h["X-Custom"] == "header-marker" for h in seen_upstream)
    # ... but written nowhere
    files = list(tmp_path.rglob("*"))
    text = "".join(f.read_text() for f in files if f.is_file())
    assert text.count('"version":1') == 3
    for secret in ("sk-secret", "Bearer", "agent-marker", "header-marker", "Authorization", "api_key"):
        assert secret not in text, secret
    assert all(r["request"]["model"] == "m" for r in log_lines(log_path))


def test_rotation_keeps_at_most_backups_plus_one_files_of_bounded_size(tmp_path):
    log_path = tmp_path / "traffic.jsonl"
    max_bytes, n = 1500, 40

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url, max_bytes=max_bytes, backups=2) as (_, url), aiohttp.ClientSession() as client:
            for i in range(n):
                async with client.post(url + "/v1/chat/completions", json=chat(f"q{i:02d}")) as r:
                    assert r.status == 200

    asyncio.run(scenario())
    files = sorted(p.name for p in tmp_path.glob("traffic.jsonl*"))
    assert files == ["traffic.jsonl", "traffic.jsonl.1", "traffic.jsonl.2"]
    lines = log_lines(log_path)
    longest = max(len(json.dumps(r, separators=(",", ":"))) + 1 for r in lines)
    assert all((tmp_path / f).stat().st_size <= max_bytes + longest for f in files)
    assert sum((tmp_path / f).stat().st_size for f in files) <= 3 * (max_bytes + longest) < n * longest / 2
    rids = [r["request"]["rid"] for r in lines]
    assert rids == [f"q{i:02d}" for i in range(n - len(rids), n)]  # the newest lines, in order


def test_a_failing_log_write_is_counted_and_never_fails_the_request(tmp_path, capsys):
    log_dir = tmp_path / "logs"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_dir / "traffic.jsonl", a.url) as (proxy, url):
            shutil.rmtree(log_dir)
            log_dir.write_text("a file where the log directory was")  # every open of the log now fails
            async with aiohttp.ClientSession() as client:
                for rid in ("w1", "w2"):
                    async with client.post(url + "/v1/chat/completions", json=chat(rid)) as r:
                        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == f"A answers {rid}"
            proxy.log.flush()
            return proxy.status()["counters"]

    counters = asyncio.run(scenario())
    assert counters["logged"] == 0 and counters["log_write_errors"] == 2 and counters["log_failed_writes"] == 2
    assert capsys.readouterr().err.count("traffic log: write failed") == 1  # warnings at a bounded rate


def test_a_client_leaving_mid_stream_logs_the_cut_reply_and_the_proxy_keeps_serving(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (proxy, url), aiohttp.ClientSession() as client:
            r = await client.post(url + "/v1/chat/completions", json=chat("c1", stream=True, delay=0.6))
            first = await r.content.readany()
            r.close()  # drops the connection mid-stream
            deadline = time.monotonic() + 5
            while proxy.status()["counters"]["logged"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            async with client.post(url + "/v1/chat/completions", json=chat("c2", stream=True)) as r2:
                after = r2.status, streamed_text(await r2.read())
            return first, after, proxy.status()

    first, after, status = asyncio.run(scenario())
    assert first.startswith(b"data: ")
    assert after == (200, "A answers c2")
    cut, complete = log_lines(log_path)
    assert cut["request"]["rid"] == "c1" and cut["status"] == 200
    assert cut["choices"][0]["finish_reason"] is None and "A answers c1".startswith(cut["choices"][0]["text"])
    assert cut["choices"][0]["text"] != "A answers c1"
    assert complete["choices"][0]["finish_reason"] == "stop"
    assert status["in_flight"] == {"upstream-0": 0}


def test_a_client_giving_up_on_a_plain_request_aborts_it_upstream_and_logs_499(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A") as (a,), running_proxy(log_path, a.url) as (proxy, url), \
                aiohttp.ClientSession() as client:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ask(client, url, chat("gone", delay=1.0)), timeout=0.2)
            deadline = time.monotonic() + 5
            while (proxy.status()["counters"]["logged"] < 1 or not a.cancelled) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return a.cancelled, proxy.status()

    cancelled, status = asyncio.run(scenario())
    assert cancelled == ["gone"]  # the proxy dropped its upstream connection
    (line,) = log_lines(log_path)
    assert (line["status"], line["choices"], line["request"]["rid"]) == (499, [], "gone")
    assert status["in_flight"] == {"upstream-0": 0} and status["counters"]["upstream_errors"] == 0


def test_swap_under_load_answers_every_request_once_and_retires_the_old_upstream_after_its_last_reply(tmp_path):
    log_path = tmp_path / "traffic.jsonl"
    rng = random.Random(0)
    n = 40
    starts = [rng.uniform(0, 0.4) for _ in range(n)]
    delays = [rng.uniform(0.05, 0.3) for _ in range(n)]

    async def scenario():
        async with upstreams("A", "B") as (a, b), running_proxy(log_path, a.url) as (proxy, url):
            retired = {}

            async def on_retire(old):
                retired.update(old=old, at=time.monotonic(), a_received=len(a.received), a_active=a.active,
                               a_completed=len(a.completed))

            async def one(i, client):
                await asyncio.sleep(starts[i])
                sent_at = time.monotonic()
                stream = i % 3 == 0
                async with client.post(url + "/v1/chat/completions",
                                       json=chat(f"r{i}", delay=delays[i], stream=stream)) as r:
                    return {"i": i, "sent_at": sent_at, "status": r.status, "stream": stream, "raw": await r.read()}

            async with aiohttp.ClientSession() as client:
                tasks = [asyncio.create_task(one(i, client)) for i in range(n)]
                # swap once A holds a request (not after a fixed sleep: on a loaded machine the
                # event loop can wake late, after every request has already reached A)
                deadline = time.monotonic() + 10
                while not a.active and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                swap = asyncio.create_task(proxy.swap(b.url, label="B", on_retire=on_retire))
                await asyncio.sleep(0)  # swap() runs up to its drain: the switch has happened
                swapped_at = time.monotonic()
                at_swap = proxy.status()
                results = await asyncio.gather(*tasks)
                swap_result = await swap
            return a, b, results, swapped_at, at_swap, retired, swap_result

    a, b, results, swapped_at, at_swap, retired, swap_result = asyncio.run(scenario())
    assert at_swap["upstream"]["label"] == "B" and at_swap["in_flight"]["upstream-0"] > 0  # a real drain
    served_by = {rid: "A" for rid, _ in a.received} | {rid: "B" for rid, _ in b.received}
    # every request answered once, completely, by the upstream that received it
    assert Counter(rid for rid, _ in a.received + b.received) == Counter({f"r{i}": 1 for i in range(n)})
    for r in results:
        rid = f"r{r['i']}"
        assert r["status"] == 200, r
        expected = reply_text(served_by[rid], rid)
        if r["stream"]:
            up = a if served_by[rid] == "A" else b
            assert r["raw"] == up.sent[rid] and streamed_text(r["raw"]) == expected
        else:
            assert json.loads(r["raw"])["choices"][0]["message"]["content"] == expected
    assert {served_by[f"r{r['i']}"] for r in results if r["sent_at"] > swapped_at} == {"B"}
    assert 0 < len(a.received) < n and 0 < len(b.received) < n
    # retired only after A's last reply, and A got nothing afterwards
    assert retired["old"] == {"label": "upstream-0", "base_url": a.url}
    assert retired["a_active"] == 0 and retired["a_completed"] == retired["a_received"]
    assert max(t for _, t in a.completed) <= retired["at"]
    assert retired["a_received"] == len(a.received) and max(t for _, t in a.received) < retired["at"]
    assert swap_result["old"]["label"] == "upstream-0" and swap_result["new"] == {"label": "B", "base_url": b.url}
    assert swap_result["drained_s"] > 0
    lines = log_lines(log_path)
    assert len(lines) == n
    assert all(r["upstream"] == ("B" if served_by[r["request"]["rid"]] == "B" else "upstream-0") for r in lines)


def test_admin_swap_endpoint_needs_the_token_and_answers_after_the_drain(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with upstreams("A", "B") as (a, b), \
                running_proxy(log_path, a.url, admin_token="tok", allowed_upstreams=[b.url]) as (_, url), \
                aiohttp.ClientSession() as client:
            refused = []
            for headers in ({}, {"X-Draftsmith-Admin": "wrong"}):
                async with client.post(url + "/draftsmith/swap", json={"upstream": b.url}, headers=headers) as r:
                    refused.append(r.status)
                async with client.get(url + "/draftsmith/status", headers=headers) as r:
                    refused.append(r.status)
            ok = {"X-Draftsmith-Admin": "tok"}
            async with client.post(url + "/draftsmith/swap", json={"draft": "/x"}, headers=ok) as r:
                unmanaged_draft = r.status
            async with client.post(url + "/draftsmith/swap", json={"upstream": "ftp://x"}, headers=ok) as r:
                bad_url = r.status
            async with client.get(url + "/draftsmith/swap", headers=ok) as r:
                wrong_method = r.status, (await r.json())["error"]
            slow = asyncio.create_task(ask(client, url, chat("slow", delay=0.3)))
            await asyncio.sleep(0.1)
            async with client.post(url + "/draftsmith/swap", json={"upstream": b.url}, headers=ok) as r:
                swapped = r.status, await r.json(), time.monotonic()
            slow_reply = (await slow)[1]
            after = (await ask(client, url, chat("next")))[1]["choices"][0]["message"]["content"]
            async with client.get(url + "/draftsmith/status", headers=ok) as r:
                status = await r.json()
            return refused, unmanaged_draft, bad_url, wrong_method, swapped, slow_reply, after, status, a, b

    refused, unmanaged_draft, bad_url, wrong_method, swapped, slow_reply, after, status, a, b = asyncio.run(scenario())
    assert refused == [403, 403, 403, 403]
    assert (unmanaged_draft, bad_url) == (400, 400)
    assert wrong_method[0] == 404 and wrong_method[1].startswith("no admin endpoint GET /draftsmith/swap")
    code, result, answered_at = swapped
    assert code == 200 and result["drained_s"] > 0.1
    assert dict(a.completed)["slow"] <= answered_at  # answered once the request in flight on A had finished
    assert result["old"] == {"label": "upstream-0", "base_url": a.url} and result["new"]["base_url"] == b.url
    assert slow_reply["choices"][0]["message"]["content"] == "A answers slow"
    assert after == "B answers next" and [rid for rid, _ in b.received] == ["next"]
    assert status["upstream"]["base_url"] == b.url and status["in_flight"] == {result["new"]["label"]: 0}
    assert status["counters"]["swaps"] == 1
    assert status["counters"]["requests"] == 2  # admin requests are never forwarded


def test_managed_draft_swap_starts_the_new_server_then_stops_the_old_one_and_a_failed_start_keeps_it(
        tmp_path, monkeypatch):
    events: list[tuple[str, str, float]] = []
    urls: dict[str, str] = {}

    @contextlib.contextmanager
    def fake_vllm_server(target, spec, opts, log_path):
        draft = Path(spec["model"]).name
        assert threading.current_thread() is not threading.main_thread() or draft == "draft-a"
        if draft == "broken":
            raise ServerStartError("vLLM server exited with code 1 before becoming healthy:\nCUDA out of memory")
        events.append(("start", draft, time.monotonic()))
        try:
            yield {"base_url": urls[draft], "port": 0, "pgid": 0, "command": ["vllm", "serve", str(target)]}
        finally:
            events.append(("stop", draft, time.monotonic()))

    monkeypatch.setattr(managed_module, "vllm_server", fake_vllm_server)
    monkeypatch.setattr(managed_module, "draft_speculative_config",
                        lambda draft, target, k, *_: {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})

    async def scenario():
        async with upstreams("A", "B") as (a, b):
            urls.update({"draft-a": a.url, "draft-b": b.url})
            servers = ManagedServers(tmp_path / "target", ServerOptions(), 3, tmp_path / "servers")
            first = servers.start_blocking(tmp_path / "draft-a")
            ok = {"X-Draftsmith-Admin": "t"}
            try:
                async with running_proxy(tmp_path / "traffic.jsonl", first["base_url"], admin_token="t",
                                         servers=servers) as (_, url), aiohttp.ClientSession() as client:
                    async with client.post(url + "/draftsmith/swap", json={"draft": str(tmp_path / "broken")},
                                           headers=ok) as r:
                        failed = r.status, await r.json()
                    still = (await ask(client, url, chat("still-a")))[1]["choices"][0]["message"]["content"]
                    slow = asyncio.create_task(ask(client, url, chat("slow", delay=0.3)))
                    await asyncio.sleep(0.1)
                    async with client.post(url + "/draftsmith/swap", json={"draft": str(tmp_path / "draft-b"),
                                                                           "k": 5}, headers=ok) as r:
                        swapped = r.status, await r.json()
                    slow_reply = (await slow)[1]
                    on_b = (await ask(client, url, chat("on-b")))[1]["choices"][0]["message"]["content"]
                    running = servers.describe()
            finally:
                servers.close_blocking()
            return failed, still, swapped, slow_reply, on_b, running, a

    failed, still, swapped, slow_reply, on_b, running, a = asyncio.run(scenario())
    assert failed[0] == 500 and "CUDA out of memory" in failed[1]["error"]
    assert still == "A answers still-a"
    code, result = swapped
    assert code == 200 and result["draft"].endswith("draft-b") and result["k"] == 5
    assert slow_reply["choices"][0]["message"]["content"] == "A answers slow"
    assert on_b == "B answers on-b"
    assert list(running) == [result["new"]["base_url"]] and running[result["new"]["base_url"]]["k"] == 5
    assert [(e, d) for e, d, _ in events] == [("start", "draft-a"), ("start", "draft-b"), ("stop", "draft-a"),
                                              ("stop", "draft-b")]
    stop_a = next(t for e, d, t in events if (e, d) == ("stop", "draft-a"))
    assert stop_a >= max(t for _, t in a.completed)  # the old server stopped only after its last reply


@pytest.mark.parametrize("argv", [[], ["--upstream", "http://127.0.0.1:1", "--draft", "d"],
                                  ["--upstream", "ftp://127.0.0.1:1"]])
def test_the_command_line_refuses_no_or_two_upstreams_and_a_bad_url(argv, tmp_path, capsys):
    assert main([*argv, "--log", str(tmp_path / "t.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()
