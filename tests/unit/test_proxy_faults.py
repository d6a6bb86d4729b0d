"""``draftsmith proxy`` when things break, in-process: an upstream that hangs, clients that leave or
read slowly, a traffic log that cannot be written, oversized and malformed requests, unknown
models, bad swaps, the in-place draft swap. The upstream is the OpenAI stub of
``benchmarks/stub_openai.py``: no vLLM. (An upstream SIGKILLed mid-stream and a managed server that
dies: tests/integration/test_proxy_process_faults.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import time
from pathlib import Path

import aiohttp
import pytest

from draftsmith.serve import managed as managed_module
from draftsmith.cli.proxy import main
from draftsmith.serve.proxy import ManagedServers, TrafficLog, TrafficProxy
from draftsmith.vllm_bridge.server import ServerOptions
from helpers.proxy import body, proxy_on, records, sse_events, stub


def test_an_upstream_that_hangs_gets_504_and_a_stream_that_hangs_ends_with_an_error_event(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with stub() as s, proxy_on(s.url, log_path, upstream_timeout_s=0.5) as (proxy, purl), \
                aiohttp.ClientSession() as client:
            t0 = time.monotonic()
            async with client.post(purl + "/v1/chat/completions", json=body("hang", stub_hang="before")) as r:
                plain = r.status, await r.json(), time.monotonic() - t0
            t0 = time.monotonic()
            async with client.post(purl + "/v1/chat/completions",
                                   json=body("hang2", stream=True, stub_hang="after_first")) as r:
                streamed = r.status, await r.read(), time.monotonic() - t0
            await asyncio.sleep(0.2)
            proxy.log.flush()
            return plain, streamed, s.active

    plain, streamed, active = asyncio.run(scenario())
    assert plain[0] == 504 and plain[1]["error"]["type"] == "GatewayTimeout" and plain[2] < 5
    assert streamed[0] == 200 and streamed[2] < 5
    events = sse_events(streamed[1])
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "tok0"
    assert json.loads(events[-1])["error"]["code"] == 504
    assert active == 0  # the proxy hung up on both: nothing left running upstream
    assert [(r["status"], r["error"]) for r in records(log_path)] == [(504, "upstream_timeout"), (200, "upstream_timeout")]


def test_clients_leaving_mid_stream_cancel_their_upstream_requests(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with stub(tokens=1000, token_rate=50) as s, proxy_on(s.url, log_path) as (proxy, purl):
            async def leave(i: int) -> None:
                async with aiohttp.ClientSession() as client:
                    async with client.post(purl + "/v1/chat/completions", json=body(f"gone{i}", stream=True)) as r:
                        await r.content.readany()
                        r.close()  # the client hangs up after the first bytes

            await asyncio.gather(*(leave(i) for i in range(20)))
            deadline = time.monotonic() + 10
            while s.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            proxy.log.flush()
            return s.active, s.cancelled, proxy.status()["in_flight"]

    active, cancelled, in_flight = asyncio.run(scenario())
    assert (active, cancelled) == (0, 20)  # no upstream request outlives its client
    assert set(in_flight.values()) == {0}
    logged = records(log_path)
    assert len(logged) == 20 and {r["error"] for r in logged} == {"client_disconnected"}


def test_a_slow_reader_holds_the_upstream_back_instead_of_filling_the_proxys_memory(tmp_path):
    async def scenario():
        # ~150 MB of stream if nothing pushed back
        async with stub(tokens=1_000_000) as s, proxy_on(s.url, None) as (proxy, purl), aiohttp.ClientSession() as client:
            async with client.post(purl + "/v1/chat/completions", json=body("slow", stream=True)) as r:
                await r.content.readany()
                await asyncio.sleep(2.0)  # the client reads nothing: socket buffers fill, then writes wait
                stalled = s.bytes_sent
                await asyncio.sleep(1.0)
                still = s.bytes_sent
                read = len(await r.content.read(2**20))
                r.close()
            return stalled, still, read

    stalled, still, read = asyncio.run(scenario())
    assert stalled < 32 * 2**20  # kernel buffers of two loopback hops and aiohttp's, not the whole reply
    assert still - stalled < 2**20  # and it stays there while the client does not read
    assert read > 0


def test_a_log_on_a_full_disk_never_fails_a_request_is_counted_and_warned_about_at_a_bounded_rate(tmp_path, capsys):
    log_path = tmp_path / "traffic.jsonl"
    log_path.symlink_to("/dev/full")  # every write: ENOSPC

    async def scenario():
        async with stub() as s, proxy_on(s.url, log_path) as (proxy, purl), aiohttp.ClientSession() as client:
            statuses = []
            for i in range(30):
                async with client.post(purl + "/v1/chat/completions", json=body(f"f{i}")) as r:
                    statuses.append(r.status)
            proxy.log.flush()
            async with client.get(purl + "/draftsmith/status") as r:
                return statuses, await r.json()

    statuses, status = asyncio.run(scenario())
    assert statuses == [200] * 30
    assert status["counters"]["logged"] == 0 and status["counters"]["log_failed_writes"] == 30
    err = capsys.readouterr().err
    assert err.count("traffic log: write failed") == 1 and "No space left on device" in err


def test_traffic_log_files_are_readable_by_their_owner_only(tmp_path):
    log_path = tmp_path / "traffic.jsonl"
    old = os.umask(0o022)  # the usual umask: files would be world-readable without the proxy's mode
    try:
        async def scenario():
            async with stub(tokens=50) as s:
                log = TrafficLog(log_path, max_bytes=2000, backups=3)
                proxy = TrafficProxy(s.url, log)
                purl = await proxy.start("127.0.0.1", 0)
                try:
                    async with aiohttp.ClientSession() as client:
                        for i in range(10):
                            async with client.post(purl + "/v1/chat/completions", json=body(f"p{i}")) as r:
                                assert r.status == 200
                finally:
                    await proxy.close()
                    log.close()

        asyncio.run(scenario())
    finally:
        os.umask(old)
    files = sorted(tmp_path.glob("traffic.jsonl*"))
    assert len(files) == 4  # rotated
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}


def test_bad_requests_get_json_errors_and_are_never_logged_as_completions(tmp_path):
    log_path = tmp_path / "traffic.jsonl"

    async def scenario():
        async with stub() as s, stub() as other, \
                proxy_on(s.url, log_path, max_request_bytes=4096, admin_token="t") as (proxy, purl), \
                aiohttp.ClientSession(headers={"X-Draftsmith-Admin": "t"}) as client:
            out = {}
            big = body("big")
            big["messages"][0]["content"] = "x" * 8192
            async with client.post(purl + "/v1/chat/completions", json=big) as r:
                out["too_big"] = r.status, await r.json()
            async with client.post(purl + "/v1/chat/completions", data=b'{"model": "m", "messages": [',
                                   headers={"Content-Type": "application/json"}) as r:
                out["malformed"] = r.status, await r.json()
            async with client.post(purl + "/v1/chat/completions", json={**body("who"), "model": "nobody"}) as r:
                out["unknown_model"] = r.status, await r.json()
            async with client.post(purl + "/draftsmith/swap", json={"upstream": other.url}) as r:
                out["not_allowed"] = r.status, await r.json()
            async with client.post(purl + "/draftsmith/swap", json={"draft": str(tmp_path)}) as r:
                out["unmanaged_draft"] = r.status, await r.json()
            async with client.post(purl + "/draftsmith/swap", data=b"{oops") as r:
                out["bad_swap_body"] = r.status, await r.json()
            async with client.post(purl + "/v1/chat/completions", json=body("fine")) as r:
                out["fine"] = r.status, (await r.json())["choices"][0]["message"]["content"]
            proxy.log.flush()
            return out, s.received, other.received, proxy.upstream["base_url"] == s.url

    out, received, other_received, unchanged = asyncio.run(scenario())
    assert out["too_big"][0] == 413 and "--max-request-bytes" in out["too_big"][1]["error"]["message"]
    assert out["malformed"][0] == 400 and out["malformed"][1]["error"]["type"] == "BadRequest"
    assert out["unknown_model"] == (404, {"error": {"message": "The model `nobody` does not exist.",
                                                    "type": "NotFoundError", "param": "model", "code": 404}})
    assert out["not_allowed"][0] == 403 and "not given on the command line" in out["not_allowed"][1]["error"]
    assert out["unmanaged_draft"][0] == 400 and "managed mode" in out["unmanaged_draft"][1]["error"]
    assert out["bad_swap_body"][0] == 400
    assert out["fine"][0] == 200 and unchanged and other_received == 0
    assert received == 2  # only the unknown model and the fine request were forwarded
    logged = records(log_path)
    assert [(r["status"], r["choices"]) for r in logged[:1]] == [(404, [])]
    assert [r["status"] for r in logged] == [404, 200]


def test_a_swap_to_a_folder_that_is_not_an_export_and_a_swap_during_a_swap_get_json_errors(tmp_path, monkeypatch):
    release = asyncio.Event()
    starts = []

    @contextlib.contextmanager
    def fake_server(target, spec, opts, log_path):
        starts.append(spec["model"])
        yield {"base_url": upstreams[len(starts) - 1], "port": 0, "pgid": 0, "command": ["stub"]}

    upstreams: list[str] = []

    async def slow_start(self, draft, k=None):  # the first swap's server takes until `release`
        await release.wait()
        return self.start_blocking(draft, k)

    monkeypatch.setattr(managed_module, "vllm_server", fake_server)
    (tmp_path / "not-an-export").mkdir()

    async def scenario():
        async with stub() as a, stub() as b:
            upstreams.extend([a.url, b.url])
            servers = ManagedServers(tmp_path / "target", ServerOptions(), 3, tmp_path / "servers")
            monkeypatch.setattr(managed_module, "draft_speculative_config", managed_module.draft_speculative_config)
            async with proxy_on(a.url, tmp_path / "traffic.jsonl", servers=servers) as (proxy, purl), \
                    aiohttp.ClientSession() as client:
                async with client.post(purl + "/draftsmith/swap", json={"draft": str(tmp_path / "not-an-export")}) as r:
                    not_export = r.status, await r.json()
                monkeypatch.setattr(managed_module, "draft_speculative_config",
                                    lambda d, t, k, *_: {"method": "eagle3", "model": str(d), "num_speculative_tokens": k})
                monkeypatch.setattr(ManagedServers, "start", slow_start)
                first = asyncio.ensure_future(client.post(purl + "/draftsmith/swap", json={"draft": "d1"}))
                await asyncio.sleep(0.3)
                async with client.post(purl + "/draftsmith/swap", json={"draft": "d2"}) as r:
                    during = r.status, await r.json()
                async with client.post(purl + "/v1/chat/completions", json=body("mid-swap")) as r:
                    served_mid = r.status
                release.set()
                async with await first as r:
                    done = r.status
                servers.close_blocking()
                return not_export, during, served_mid, done, a.received

    not_export, during, served_mid, done, a_received = asyncio.run(scenario())
    assert not_export[0] == 400 and "config.json" in not_export[1]["error"]
    assert during[0] == 409 and "a swap" in during[1]["error"]
    assert served_mid == 200 and a_received == 1  # served as before while the first swap ran
    assert done == 200 and starts == ["d1"]


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1"])
def test_a_proxy_reachable_from_other_machines_refuses_to_start_without_an_admin_token(host, tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_PROXY_ADMIN_TOKEN", raising=False)
    code = main(["--upstream", "http://127.0.0.1:9", "--host", host, "--log", str(tmp_path / "t.jsonl")])
    assert code == 2 and "--admin-token" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("supported", [True, False])
def test_a_draft_swap_updates_the_running_server_in_place_when_vllm_can_else_starts_a_second_one(
        supported, tmp_path, monkeypatch):
    from draftsmith.vllm_bridge import weight_update

    starts, updates = [], []

    @contextlib.contextmanager
    def fake_server(target, spec, opts, log_path):
        starts.append(spec["model"])
        yield {"base_url": urls[len(starts) - 1], "port": 0, "pgid": 0, "command": ["stub"]}

    urls: list[str] = []
    monkeypatch.setattr(managed_module, "vllm_server", fake_server)
    monkeypatch.setattr(managed_module, "draft_speculative_config",
                        lambda d, t, k, *_: {"method": "eagle3", "model": str(d), "num_speculative_tokens": k})
    monkeypatch.setattr(weight_update, "draft_weight_update_support",
                        lambda url: (supported, "" if supported else "vLLM says no: supports_draft_weight_updates False"))
    monkeypatch.setattr(weight_update, "update_draft_weights",
                        lambda url, d: updates.append((url, str(d))) or {"served": {}, "seconds": 0.5})
    monkeypatch.setattr(weight_update, "served_draft_matches", lambda url, d: (url, str(d)) == updates[-1])

    async def scenario():
        async with stub() as a, stub() as b, stub() as c:
            urls.extend([a.url, b.url, c.url])
            servers = ManagedServers(tmp_path / "target", ServerOptions(inplace_swap=True), 3, tmp_path / "servers")
            first = servers.start_blocking(Path("draft-a"))
            async with proxy_on(first["base_url"], None, servers=servers) as (proxy, purl), \
                    aiohttp.ClientSession() as client:
                async with client.post(purl + "/draftsmith/swap", json={"draft": "draft-b"}) as r:
                    swapped = r.status, await r.json()
                async with client.post(purl + "/draftsmith/swap", json={"draft": "draft-c", "k": 5}) as r:
                    other_k = r.status, await r.json()
                described = servers.describe()
            servers.close_blocking()
            return swapped, other_k, described

    (code, result), (code_k, result_k), described = asyncio.run(scenario())
    assert code == 200 and code_k == 200
    if supported:
        assert result["mode"] == "in_place" and result["draft"] == "draft-b" and result["update_s"] == 0.5
        assert updates == [(urls[0], "draft-b")]  # into the running server: no second one started for it
        assert starts[:1] == ["draft-a"]
    else:
        assert result["mode"] == "two_servers" and "supports_draft_weight_updates False" in result["in_place_not_used"]
        assert updates == [] and starts[:2] == ["draft-a", "draft-b"]
    # k is a server-level setting: another k always takes a second server
    assert result_k["mode"] == "two_servers" and "k 5 differs" in result_k["in_place_not_used"]
    assert [d["draft"] for d in described.values()] == ["draft-c"]
