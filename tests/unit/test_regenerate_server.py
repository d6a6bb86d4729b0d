"""Regeneration through an OpenAI-compatible server (ServerChatEngine), cache fingerprints,
and ids kept distinct across sources. Only the first test starts vLLM; the others use a
fake server (http.server) or a fake engine."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers.tiny import write_jsonl
from helpers.fake_inputs import MULTI
from draftsmith.data_prep import chat_engines, regenerate as regen
from draftsmith.data_prep.prepare import load_sources
from draftsmith.recipe import load_recipe


def cached_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- (a) the real server ---------------------------------------------------------------------


# --- (b) a fake OpenAI-compatible server -------------------------------------------------------

class FakeServer:
    """``/v1/models`` and ``/v1/chat/completions`` on loopback. Chat requests fail with 503
    while ``fail(n)`` (n: the 0-based chat request number) is true; replies echo the turn, or are
    ``answer(body)`` (``(message, finish_reason)``) when given."""

    def __init__(self, fail=lambda n: False, answer=None):
        self.fail, self.answer, self.requests, self.lock = fail, answer, [], threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0,
                                                             "owned_by": "me"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    n = len(outer.requests)
                    outer.requests.append(body)
                if outer.fail(n):
                    self._send(503, {"error": {"message": "overloaded"}}, [("retry-after-ms", "10")])
                    return
                n_asst = sum(m["role"] == "assistant" for m in body["messages"])
                text = f"reply {n_asst + 1} to {body['messages'][-1]['content']}"
                message, finish = (({"role": "assistant", "content": text}, "stop") if outer.answer is None
                                   else outer.answer(body))
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": finish, "message": message}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def start(fail=lambda n: False, answer=None):
        servers.append(FakeServer(fail, answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_client_retries_transient_errors_and_walks_turns(fake_server, tmp_path):
    server = fake_server(fail=lambda n: n < 3)  # the first three requests get 503
    cache = tmp_path / "regen.jsonl"
    records = MULTI + [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    out = regen.regenerate(records, cache, lambda: chat_engines.ServerChatEngine(None, server_urls=[server.url],
                                                                          concurrency=3, max_retries=5),
                           [0.0, 0.5], 16, progress=False,
                           reasoning_effort={"low": 1.0}, harmony=True)
    m = out[0]["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant"]
    assert m[2]["content"] == "reply 1 to Name a colour." and m[4]["content"] == "reply 2 to And another one?"
    # the second turn was asked with the first regenerated reply in the conversation
    second = [r for r in server.requests if r["messages"][-1]["content"] == "And another one?"][-1]
    assert second["messages"][2] == {"role": "assistant", "content": "reply 1 to Name a colour."}
    assert all(r["max_tokens"] == 16 and r["chat_template_kwargs"] == {"reasoning_effort": "low"}
               for r in server.requests)
    assert {r["temperature"] for r in server.requests} == {0.0, 0.5}
    assert len(server.requests) == 3 + 2 + 1 + 5  # three failures retried, then every turn once
    assert sorted(r["id"] for r in cached_rows(cache)) == sorted(r["id"] for r in records)


def test_failing_server_names_its_url_and_keeps_finished_rows(fake_server, tmp_path):
    server = fake_server(fail=lambda n: n >= 2)  # two requests succeed, then always 503
    cache = tmp_path / "regen.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    with pytest.raises(chat_engines.RegenerationRequestError, match=server.url.replace(".", r"\.")):
        regen.regenerate(records, cache, lambda: chat_engines.ServerChatEngine(None, server_urls=[server.url],
                                                                        concurrency=1, max_retries=1),
                         [0.0], 8, progress=False)
    assert [r["id"] for r in cached_rows(cache)] == ["p0", "p1"]  # finished before the failure
    # the rerun (server healthy again) generates only the rest
    server.fail = lambda n: False
    before = len(server.requests)
    out = regen.regenerate(records, cache, lambda: chat_engines.ServerChatEngine(None, server_urls=[server.url]),
                           [0.0], 8, progress=False)
    assert len(server.requests) - before == 3 and [r["id"] for r in out] == [r["id"] for r in records]


def test_a_reply_the_server_cut_marks_its_row_cut(fake_server, tmp_path):
    """``finish_reason == "length"`` on the last turn: the row is ``cut``; a reasoning parser's
    reasoning without an answer is reasoning the cut interrupted (no ``</think>`` put back)."""
    def answer(body):
        q = body["messages"][-1]["content"]
        if q == "think":  # cut inside the reasoning, which the server's parser returned apart
            return {"role": "assistant", "content": None, "reasoning_content": "\nstill"}, "length"
        return {"role": "assistant", "content": f"to {q}"}, "length" if q.startswith("cut") else "stop"

    server = fake_server(answer=answer)
    def user(q):
        return {"role": "user", "content": q}

    records = [{"id": "a", "messages": [user("cut me")]}, {"id": "b", "messages": [user("fine")]},
               {"id": "c", "messages": [user("cut first"), {"role": "assistant", "content": "x"}, user("fine")]},
               {"id": "d", "messages": [user("think")]}]
    out = regen.regenerate(records, tmp_path / "regen.jsonl",
                           lambda: chat_engines.ServerChatEngine(None, server_urls=[server.url], thinking=True),
                           [0.0], 8, progress=False, thinking=True)
    assert [r.get("cut", False) for r in out] == [True, False, False, True]  # c: only an earlier reply was cut
    assert out[3]["messages"][-1] == {"role": "assistant", "content": "<think>\nstill"}  # as generated
    assert {r["id"]: r.get("cut", False) for r in cached_rows(tmp_path / "regen.jsonl")} == {
        "a": True, "b": False, "c": False, "d": True}
    # a rerun reads the rows, their cut included, back from the cache
    again = regen.regenerate(records, tmp_path / "regen.jsonl", lambda: pytest.fail("engine built"), [0.0], 8,
                             progress=False, thinking=True)
    assert again == out


def test_unreachable_server_is_named(tmp_path):
    from draftsmith.vllm_bridge.server import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(chat_engines.RegenerationRequestError, match=url.replace(".", r"\.")):
        chat_engines.ServerChatEngine(None, server_urls=[url], max_retries=0).generate(
            [[{"role": "user", "content": "hi"}]], [0.0], 4)


# --- (c) fingerprints ------------------------------------------------------------------------

class CountingEngine:
    """A fake batched engine: records the conversations it was asked about."""

    def __init__(self):
        self.asked, self.closed = [], False

    def generate(self, conversations, temperatures, max_new_tokens):
        self.asked += [c[-1]["content"] for c in conversations]
        return [f"r{t}" for t in temperatures]

    def close(self):
        self.closed = True


def test_changed_temperature_regenerates_exactly_the_affected_rows(tmp_path, caplog):
    cache = tmp_path / "regen.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(6)]
    base = {"target": "t@abc", "chat_template_sha256": "h", "engine": "vllm"}
    first = CountingEngine()
    regen.regenerate(records, cache, lambda: first, [0.0], 8, progress=False, fingerprint_base=base)
    assert len(first.asked) == 6 and first.closed  # the engine is shut down when regeneration ends

    again = CountingEngine()
    caplog.set_level(logging.INFO, logger="draftsmith")
    out = regen.regenerate(records, cache, lambda: again, [0.0, 0.7], 8, progress=False, fingerprint_base=base)
    assert again.asked == ["q1", "q3", "q5"]  # rows i % 2 == 1 moved to T=0.7
    assert "regenerate: 3 cached rows are stale (temperature changed), 3 to generate" in caplog.text
    rows = cached_rows(cache)
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6  # stale rows replaced, not duplicated
    assert [r["temperature"] for r in out] == [0.0, 0.7] * 3
    assert all(r["fingerprint"]["temperature"] == r["temperature"] for r in out)

    # nothing changed: no engine at all
    regen.regenerate(records, cache, lambda: pytest.fail("engine built"), [0.0, 0.7], 8, progress=False,
                     fingerprint_base=base)
    # switching vLLM in-process <-> server keeps the cache (same engine family) ...
    regen.regenerate(records, cache, lambda: pytest.fail("engine built"), [0.0, 0.7], 8, progress=False,
                     fingerprint_base=dict(base, engine=chat_engines.ENGINE_FAMILY["vllm-server"]))
    # ... another template recomputes everything
    caplog.clear()
    third = CountingEngine()
    regen.regenerate(records, cache, lambda: third, [0.0, 0.7], 8, progress=False,
                     fingerprint_base=dict(base, chat_template_sha256="other"))
    assert len(third.asked) == 6 and "6 cached rows are stale (chat_template_sha256 changed)" in caplog.text


def test_rows_without_a_fingerprint_are_stale(tmp_path, caplog):
    cache = write_jsonl(tmp_path / "regen.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "qa"}, {"role": "assistant", "content": "x"}],
         "temperature": 0.0}])
    records = [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}]} for i in ("a", "b")]
    engine = CountingEngine()
    caplog.set_level(logging.INFO, logger="draftsmith")
    regen.regenerate(records, cache, lambda: engine, [0.0], 8, progress=False)
    assert engine.asked == ["qa", "qb"]
    assert "1 cached rows are stale (no fingerprint), 2 to generate" in caplog.text
    assert [r["id"] for r in cached_rows(cache)] == ["a", "b"]


def test_streaming_windows_read_back_the_cache_and_close_the_engine_before_the_last_window(tmp_path):
    """10 records, windows of 3: cached rows come back from the file in input order, only the
    missing ones are generated, the engine is closed before the last window is handed on, and
    a superseded stale row is compacted away at the end."""
    cache = tmp_path / "regen.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(10)]
    base = {"target": "t", "chat_template_sha256": "h", "engine": "vllm"}
    regen.regenerate(records[::2], cache, CountingEngine, [0.0], 8, progress=False, fingerprint_base=base)
    rows = cached_rows(cache)
    rows[0]["fingerprint"] = dict(rows[0]["fingerprint"], target="other")  # p0 is now stale
    cache.write_text("".join(json.dumps(r) + "\n" for r in rows))

    engine = CountingEngine()
    stream = regen.iter_regenerated(iter(records), cache, lambda: engine, [0.0], 8, progress=False,
                                    fingerprint_base=base, window=3)
    out, closed_at = [], []
    for r in stream:
        out.append(r)
        closed_at.append(engine.closed)
    assert [r["id"] for r in out] == [f"p{i}" for i in range(10)]
    assert engine.asked == ["q0", "q1", "q3", "q5", "q7", "q9"]
    assert [r["messages"][-1]["content"] for r in out] == ["r0.0"] * 10
    assert closed_at == [False] * 9 + [True]  # the last window (p9) is handed on after the close
    final = cached_rows(cache)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in records)  # stale p0 compacted away
    assert next(r for r in final if r["id"] == "p0")["fingerprint"]["target"] == "t"


def test_target_id_uses_the_snapshot_revision_or_a_content_hash(tmp_path):
    snap = tmp_path / "models--x" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    assert regen.target_id("org/x", snap) == "org/x@" + "a" * 40
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    one = regen.target_id("local", local)
    (local / "config.json").write_text('{"a": 1}')
    assert one != regen.target_id("local", local) and one.startswith("local#sha256:")


# --- (d) ids across sources ------------------------------------------------------------------

def test_two_sources_with_the_same_ids_keep_every_row(tmp_path):
    rows = [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in ("a", "b")]
    one = write_jsonl(tmp_path / "one.jsonl", rows)
    two = write_jsonl(tmp_path / "two.jsonl", rows)
    recipe = load_recipe(None, [f"data.sources=[{{path: {one}}}, {{path: {two}}}]"])
    records, _ = load_sources(recipe)
    assert [r["id"] for r in records] == ["0:a", "0:b", "1:a", "1:b"]
    # a single source keeps its ids unchanged
    records, _ = load_sources(load_recipe(None, [f"data.sources=[{{path: {one}}}]"]))
    assert [r["id"] for r in records] == ["a", "b"]
    # both survive regeneration as distinct cache rows
    cache = tmp_path / "regen.jsonl"
    both, _ = load_sources(recipe)
    out = regen.regenerate(both, cache, CountingEngine, [0.0], 8, progress=False)
    assert len(out) == 4 and len(cached_rows(cache)) == 4
