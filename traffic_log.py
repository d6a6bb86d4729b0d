"""The traffic log's line schema: written by ``draftsmith proxy`` (:mod:`draftsmith.serve.proxy`),
read back as training data by :mod:`draftsmith.data_prep.traffic` (``draftsmith adapt``). Both import
it from here, so writer and reader cannot drift apart.

Traffic log: one JSON line is appended per ``POST /v1/chat/completions`` or ``/v1/completions``,
written once the response has finished. Lines go through a ``RotatingFileHandler``, so disk use
is bounded (``traffic.jsonl``, ``.1``, ... ``.N``; about ``(N + 1) * --max-bytes`` bytes)::

    {"version": 1, "id": uuid4 hex, "time": unix seconds when the response finished,
     "endpoint": "chat" | "completions", "model": the request's "model" | null,
     "upstream": label of the upstream that answered ("upstream-0", ...),
     "status": upstream HTTP status | 502 (upstream not reached) | 503 (managed upstream restarting)
               | 504 (upstream silent past --upstream-timeout) | 499 (client left before the answer),
     "request": the client's JSON body without a top-level "api_key" | null (not JSON),
     "choices": [{"index": i, "text": full completion text, "finish_reason": str | null}],
     "usage": the upstream's usage object | null, "latency_s": seconds from receipt to finish,
     "error": null | one of ERRORS: why the exchange did not finish normally}

Streamed replies are logged as the concatenation of their deltas. ``choices`` is ``[]`` for a
status other than 200 and for a body that cannot be parsed. A stream cut short, by the client
leaving or by the upstream failing, is logged with what arrived and ``"finish_reason": null``.
A client that leaves also closes the proxy's upstream connection, so vLLM aborts the generation.
``error`` says which failure cut an exchange (:data:`ERRORS`); readers that predate it ignore it.
JSON encoding and file writes run on a writer thread. A failed or dropped write is counted
(``/draftsmith/status``) and never fails a request. The log never holds a header
(``Authorization`` included), the request body's ``api_key``, or the admin token. Access logging
is off for the same reason: aiohttp's access log holds ``User-Agent`` and ``Referer``.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from typing import Any

LOG_VERSION = 1  # the "version" of every traffic log line; a reader skips lines of another version
LOGGED_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}  # path -> "endpoint"
# "error" of a record: the upstream could not be reached / closed the connection mid-answer / sent
# nothing for --upstream-timeout seconds / was being restarted (managed mode); the client left
ERRORS = ("upstream_unreachable", "upstream_disconnected", "upstream_timeout", "upstream_restarting",
          "client_disconnected")


def json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None


def _decoded(body: bytes, content_encoding: str) -> bytes:
    """The body as the upstream meant it (gzip / deflate undone), for the log only."""
    if content_encoding.lower() in ("gzip", "deflate"):
        with contextlib.suppress(zlib.error):
            return zlib.decompress(body, 32 + zlib.MAX_WBITS)  # 32: zlib or gzip header, detected
    return body


def _sse_events(body: bytes) -> list[str]:
    """The ``data`` of each server-sent event in ``body`` (multi-line data joined by newlines)."""
    events, data = [], []
    for line in body.decode("utf-8", errors="replace").splitlines():
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append("\n".join(data))
    return events


def response_choices(endpoint: str, body: bytes, streamed: bool) -> tuple[list[dict[str, Any]], Any]:
    """``(choices, usage)`` of an OpenAI response ``body`` for the log.

    ``endpoint`` is ``"chat"`` (text from ``message.content``, or the concatenated
    ``delta.content`` of a stream) or ``"completions"`` (``text``). ``streamed``: ``body`` is a
    stream of server-sent events. ``choices`` is ``[{"index", "text", "finish_reason"}]`` sorted
    by index, or ``[]`` when ``body`` cannot be parsed. ``usage`` is the last usage object sent,
    or None.
    """
    if not streamed:
        payload = json_or_none(body)
        if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
            return [], None
        out = []
        for i, c in enumerate(payload["choices"]):
            if not isinstance(c, dict):
                continue
            text = (c.get("message") or {}).get("content") if endpoint == "chat" else c.get("text")
            out.append({"index": c.get("index", i), "text": text if isinstance(text, str) else "",
                        "finish_reason": c.get("finish_reason")})
        return sorted(out, key=lambda c: c["index"]), payload.get("usage")
    texts: dict[int, list[str]] = {}
    finish: dict[int, Any] = {}
    usage = None
    for data in _sse_events(body):
        chunk = json_or_none(data.encode()) if data != "[DONE]" else None
        if not isinstance(chunk, dict):
            continue
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            if not isinstance(c, dict):
                continue
            i = c.get("index", 0)
            piece = (c.get("delta") or {}).get("content") if endpoint == "chat" else c.get("text")
            texts.setdefault(i, []).append(piece if isinstance(piece, str) else "")
            if c.get("finish_reason") is not None:
                finish[i] = c["finish_reason"]
    return [{"index": i, "text": "".join(texts[i]), "finish_reason": finish.get(i)} for i in sorted(texts)], usage


def exchange_record(*, record_id: str, endpoint: str, request_body: bytes, upstream: str, status: int,
                    response_body: bytes, content_encoding: str, streamed: bool, complete: bool,
                    finished: float, latency_s: float, error: str | None = None) -> dict[str, Any]:
    """One traffic log line (the schema in this module's docstring) for a finished exchange.

    ``finished`` is unix seconds and ``latency_s`` is seconds. ``complete`` is False for a stream
    cut short (every ``finish_reason`` is then null). The request body loses its top-level
    ``api_key``, and headers are never part of the record. ``error``: None or one of :data:`ERRORS`.
    """
    request = json_or_none(request_body)
    if isinstance(request, dict):
        request = {k: v for k, v in request.items() if k != "api_key"}
    choices, usage = [], None
    if status == 200:
        choices, usage = response_choices(endpoint, _decoded(response_body, content_encoding), streamed)
        if not complete:
            choices = [{**c, "finish_reason": None} for c in choices]
    model = request.get("model") if isinstance(request, dict) else None
    return {"version": LOG_VERSION, "id": record_id, "time": finished, "endpoint": endpoint,
            "model": model if isinstance(model, str) else None, "upstream": upstream, "status": status,
            "request": request, "choices": choices, "usage": usage, "latency_s": latency_s, "error": error}
