"""An OpenAI-compatible proxy in front of ``vllm serve``. It logs the completions it serves, which
``draftsmith adapt`` trains on, and it swaps the upstream server (a new draft) without failing a
request.

    draftsmith proxy --upstream http://127.0.0.1:8001 --port 8000 --log traffic.jsonl
    draftsmith proxy --target DIR --draft RUN/export/eagle3 [--recipe RECIPE] [--k 3] [vLLM engine flags]
    curl -X POST localhost:8000/draftsmith/swap -d '{"draft": "RUN2/export/eagle3"}'   # managed mode
    curl -X POST localhost:8000/draftsmith/swap -d '{"upstream": "http://127.0.0.1:8002"}'
    curl localhost:8000/draftsmith/status

Forwarding: every request (any method, any path) goes unchanged to the current upstream. The
client gets the upstream's status, body and headers back unchanged, apart from the hop-by-hop
headers (``Host``, ``Content-Length``, ``Transfer-Encoding``, ``Connection``, ``Keep-Alive``, ...).
Server-sent events (``"stream": true``) are passed on chunk by chunk as they arrive. The proxy
never retries a request, so no request is answered twice. An upstream that cannot be reached
gets an OpenAI-style error with status 502.

Traffic log: one JSON line is appended per ``POST /v1/chat/completions`` or ``/v1/completions``,
written once the response has finished, through :class:`draftsmith.serve.traffic_writer.TrafficLog`
(rotated, written on its own thread; a failed write is counted and never fails a request). The
line's schema is :mod:`draftsmith.traffic_log`, which ``draftsmith adapt`` reads back. The log never
holds a header (``Authorization`` included), the request body's ``api_key``, or the admin token.
Access logging is off for the same reason: aiohttp's access log holds ``User-Agent`` and ``Referer``.

Swap guarantee (:meth:`TrafficProxy.swap`): from the instant of the swap every new request goes to
the new upstream. Requests already running on the old one finish there, streaming ones
included. The old upstream is retired (in managed mode, its server is stopped) only once none of
its requests is still in flight. So no request fails, or is answered twice, because of a swap.

Admin endpoints, on the same port under ``/draftsmith/`` (no OpenAI path starts with it):
``POST /draftsmith/swap`` (``{"upstream": URL}``, or in managed mode ``{"draft": EXPORT_DIR,
"k": K}``) answers once the old upstream has drained. ``GET /draftsmith/status`` returns the
current upstream, the in-flight count per upstream and the counters. With ``--admin-token`` (or
``DRAFTSMITH_PROXY_ADMIN_TOKEN``) they need the header ``X-Draftsmith-Admin: TOKEN`` and answer
403 without it. Without a token, anyone who reaches the port can swap, so keep the default
``--host 127.0.0.1`` or set a token.

Managed mode (``--draft``): the proxy owns its ``vllm serve`` processes (:mod:`draftsmith.vllm_bridge.server`).
A draft swap starts a second server with the new draft, using the same target, engine flags and
served model name, so clients' ``"model"`` still matches. The proxy waits for its ``/health``,
swaps, drains the old server and then stops it. For a while both servers run, so on a GPU the
engine flags must leave room for two of them (e.g. ``--gpu-memory-utilization 0.45`` or
``--kv-cache-memory-gib``). If the new server fails to start, the old one keeps serving and the
swap answers 500 with the new server's log tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import inspect
import itertools
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL


from ..traffic_log import LOGGED_ENDPOINTS, exchange_record, json_or_none
from ..vllm_bridge.server import ServerStartError
from ..vllm_bridge.weight_update import WeightUpdateError
from .managed import ManagedServers
from .traffic_writer import TrafficLog

ADMIN_PREFIX = "/draftsmith/"
ADMIN_HEADER = "X-Draftsmith-Admin"
ADMIN_TOKEN_ENV = "DRAFTSMITH_PROXY_ADMIN_TOKEN"
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20  # 413 beyond it; aiohttp's default (1 MiB) is below a long-context request
DEFAULT_UPSTREAM_TIMEOUT_S = 600.0  # 504 (or an error event mid-stream) when the upstream sends nothing for this long
RESTART_BACKOFF_S = 30.0  # managed mode: seconds between attempts to restart a dead server
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CLIENT_CLOSED_REQUEST = 499  # logged status of a request its client left before the upstream answered (nginx's code)
# hop-by-hop headers (RFC 9110 section 7.6.1) and the framing the proxy recomputes itself
HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                        "proxy-authenticate", "proxy-authorization", "te", "trailer", "upgrade"})


def end_to_end_headers(headers: Any) -> CIMultiDict:
    """``headers`` without the hop-by-hop ones (:data:`HOP_BY_HOP` and any named by ``Connection``),
    repeated headers kept."""
    drop = HOP_BY_HOP | {h.strip().lower() for h in headers.get("Connection", "").split(",") if h.strip()}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def error_response(status: int, message: str, kind: str, **headers: str) -> web.Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "code"}}`` with HTTP ``status``."""
    return web.json_response({"error": {"message": f"draftsmith proxy: {message}", "type": kind, "code": status}},
                             status=status, headers=headers or None)


def upstream_error(exc: BaseException) -> str:
    """The ``error`` of a traffic log record (:data:`draftsmith.traffic_log.ERRORS`) for an
    exception raised while talking to the upstream."""
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp.ServerTimeoutError is one too
        return "upstream_timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "upstream_unreachable"
    return "upstream_disconnected"


def checked_base_url(base_url: str) -> str:
    """``base_url`` without a trailing slash.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    url = URL(base_url)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"upstream {base_url!r} is not an http(s) URL like http://127.0.0.1:8001")
    return base_url.rstrip("/")


@dataclass
class Upstream:
    """One upstream server and the requests the proxy has running on it."""

    base_url: str
    label: str
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def describe(self) -> dict[str, str]:
        return {"label": self.label, "base_url": self.base_url}


class _AdminError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class TrafficProxy:
    """The proxy (see the module docstring). ``upstream`` is the first upstream's base URL, and
    ``log`` is where served completions are logged (None: no log). If ``admin_token`` is set,
    the admin endpoints require it. ``allowed_upstreams``: the base URLs ``POST /draftsmith/swap``
    may name besides ``upstream`` (the command line's ``--upstream`` flags; a URL from the network
    is never dialled otherwise). If ``servers`` is set, the proxy is in managed mode: it accepts
    draft swaps, stops a retired upstream's server and restarts a server that died.
    ``max_request_bytes``: larger bodies get 413. ``upstream_timeout_s``: seconds the upstream may
    stay silent (before its headers or between two chunks) before the request gets 504, or a
    stream an error event.

    Raises:
        ValueError: ``upstream`` (or an allowed one) is not an http(s) URL.
    """

    def __init__(self, upstream: str, log: TrafficLog | None = None, *, label: str | None = None,
                 admin_token: str | None = None, servers: ManagedServers | None = None,
                 allowed_upstreams: list[str] | tuple[str, ...] = (),
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S):
        self.log, self.admin_token, self.servers = log, admin_token, servers
        self.max_request_bytes, self.upstream_timeout_s = max_request_bytes, upstream_timeout_s
        self._labels = itertools.count()
        self._current = self._upstream(upstream, label)
        self.allowed_upstreams = {self._current.base_url, *(checked_base_url(u) for u in allowed_upstreams)}
        self._draining: list[Upstream] = []
        self._swap_lock = asyncio.Lock()  # one swap at a time
        self._admin_lock = asyncio.Lock()  # one admin swap (or restart) at a time: at most two managed servers
        self._restart: asyncio.Task | None = None  # managed mode: the restart of a dead server under way
        self._restart_not_before = 0.0  # monotonic seconds: no new restart attempt before (after a failed one)
        self._restart_error: str | None = None
        self.counters = {"requests": 0, "upstream_errors": 0, "swaps": 0, "rejected": 0, "restarts": 0,
                         "restart_failures": 0}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._admin_tasks: set[asyncio.Task] = set()

    def _upstream(self, base_url: str, label: str | None) -> Upstream:
        return Upstream(checked_base_url(base_url), label or f"upstream-{next(self._labels)}")

    @property
    def upstream(self) -> dict[str, str]:
        """The upstream new requests go to: ``{"label", "base_url"}``."""
        return self._current.describe()

    def app(self) -> web.Application:
        """The aiohttp application: the admin routes under :data:`ADMIN_PREFIX`, then everything
        else forwarded; it opens the upstream session on start-up and closes it on clean-up."""
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._admin_guard])
        app.router.add_post(ADMIN_PREFIX + "swap", self._admin_swap)
        app.router.add_get(ADMIN_PREFIX + "status", self._admin_status)
        app.router.add_route("*", ADMIN_PREFIX + "{tail:.*}", self._admin_unknown)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            # generations may run for minutes (no total); silence past upstream_timeout_s is a hung upstream
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.upstream_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),  # vLLM queues requests itself
            auto_decompress=False,  # bodies pass through as the upstream encoded them
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),  # only the client's
            cookie_jar=aiohttp.DummyCookieJar())  # one session serves every client: never share cookies

    async def _close_session(self, app: web.Application) -> None:
        await self._session.close()

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> str:
        """Listen on ``host``:``port`` (0: a free port) and return the proxy's base URL.

        Raises:
            OSError: the address is in use or cannot be bound.
        """
        # handler_cancellation: a client that leaves cancels its handler, which drops the upstream
        # connection, so vLLM aborts the generation (as it does for its own clients)
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        return f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"

    async def close(self) -> None:
        """Stop listening, after the requests in flight have finished (aiohttp's shutdown timeout,
        seconds), and close the upstream session. The log and managed servers belong to their creator."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def swap(self, base_url: str, label: str | None = None,
                   on_retire: Callable[[dict[str, str]], Any] | None = None) -> dict[str, Any]:
        """Send every new request to ``base_url``, from this call on. Then wait until the old
        upstream has no request in flight and call ``on_retire(old)`` (sync or async; ``old`` is
        ``{"label", "base_url"}``). Swaps run one at a time.

        Returns ``{"old": {"label", "base_url"}, "new": {...}, "drained_s": seconds spent waiting}``.

        Raises:
            ValueError: ``base_url`` is not an http(s) URL.
            Whatever ``on_retire`` raises: the swap has happened by then.
        """
        async with self._swap_lock:
            new = self._upstream(base_url, label)
            old, self._current = self._current, new
            self.counters["swaps"] += 1
            self._draining.append(old)
            started = time.monotonic()
            try:
                await old.idle.wait()
            finally:
                self._draining.remove(old)
            drained_s = time.monotonic() - started
            if on_retire is not None:
                result = on_retire(old.describe())
                if inspect.isawaitable(result):
                    await result
            return {"old": old.describe(), "new": new.describe(), "drained_s": drained_s}

    def status(self) -> dict[str, Any]:
        """The current upstream, the in-flight requests per upstream, the counters (requests
        forwarded, lines logged, upstream errors, log write errors, swaps), the log file and the
        managed servers."""
        log = self.log
        return {"upstream": self._current.describe(),
                "in_flight": {u.label: u.in_flight for u in [self._current, *self._draining]},
                "counters": {**self.counters, "logged": log.logged if log else 0,
                             "log_write_errors": log.write_errors if log else 0,
                             **({f"log_{k}": v for k, v in log.error_counts().items()} if log else {})},
                "log": str(log.path) if log else None,
                "servers": self.servers.describe() if self.servers else None,
                "restarting": self._restart is not None and not self._restart.done(),
                "restart_error": self._restart_error}

    # ------------------------------------------------------------------ forwarding

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        endpoint = LOGGED_ENDPOINTS.get(request.path) if request.method == "POST" else None
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.counters["rejected"] += 1
            return error_response(413, f"request body over {self.max_request_bytes} bytes (--max-request-bytes)",
                                  "RequestTooLarge")
        if endpoint is not None and not isinstance(json_or_none(body), dict):  # never a completion: not forwarded
            self.counters["rejected"] += 1
            return error_response(400, f"the body of POST {request.path} must be a JSON object", "BadRequest")
        upstream = self._current  # chosen and entered with no await between: a swap cannot slip in
        if self._upstream_is_down(upstream):  # managed mode, its server died: a restart is under way
            self.counters["rejected"] += 1
            self._log(endpoint, body, upstream, 503, [], "", False, False, received, "upstream_restarting")
            return self._restarting_response(upstream)
        upstream.enter()
        self.counters["requests"] += 1
        status, parts, encoding, streamed, complete, error = CLIENT_CLOSED_REQUEST, [], "", False, False, None
        response: web.StreamResponse | None = None
        try:
            async with self._session.request(request.method, URL(upstream.base_url + request.raw_path, encoded=True),
                                             data=body or None, headers=end_to_end_headers(request.headers),
                                             allow_redirects=False) as up:
                status, encoding = up.status, up.headers.get("Content-Encoding", "")
                headers = end_to_end_headers(up.headers)
                if up.content_type != "text/event-stream":
                    payload = await up.read()
                    parts.append(payload)
                    complete = True
                    return web.Response(status=up.status, reason=up.reason, body=payload, headers=headers)
                streamed = True
                response = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    if endpoint is not None:  # only a logged reply is kept (for its log line)
                        parts.append(chunk)
                    try:
                        await response.write(chunk)  # waits while the client's socket is full: memory stays bounded
                    except ConnectionResetError:  # the client left: stop reading, so the upstream aborts
                        error = "client_disconnected"
                        return response
                complete = True
                return response
        except asyncio.CancelledError:  # the client left (aiohttp cancels the handler): the upstream request goes too
            error = "client_disconnected"
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.counters["upstream_errors"] += 1
            error = upstream_error(exc)
            if response is not None:  # the stream had begun: it ends with an error event where the upstream stopped
                await self._end_stream_with_error(response, upstream, error)
                return response
            if error == "upstream_unreachable" and self._upstream_is_down(upstream):
                status = 503
                return self._restarting_response(upstream)
            status, kind, what = self._upstream_failure(error, f" ({type(exc).__name__})")
            return error_response(status, f"upstream {upstream.label} {what}", kind)
        finally:
            upstream.leave()
            self._log(endpoint, body, upstream, status, parts, encoding, streamed, complete, received, error)

    def _log(self, endpoint: str | None, body: bytes, upstream: Upstream, status: int, parts: list[bytes],
             encoding: str, streamed: bool, complete: bool, received: float, error: str | None) -> None:
        """Queue the traffic log line of a finished exchange on a logged endpoint (built on the writer thread)."""
        if endpoint is None or self.log is None:
            return
        self.log.submit(functools.partial(
            exchange_record, record_id=uuid.uuid4().hex, endpoint=endpoint, request_body=body,
            upstream=upstream.label, status=status, response_body=b"".join(parts), content_encoding=encoding,
            streamed=streamed, complete=complete, finished=time.time(), latency_s=time.monotonic() - received,
            error=error))

    def _upstream_failure(self, error: str, cause: str = "") -> tuple[int, str, str]:
        """``(HTTP status, OpenAI error type, what the upstream did)`` for a failure
        (:func:`upstream_error`); ``cause`` is appended where the upstream was unreachable or hung up."""
        if error == "upstream_timeout":
            return 504, "GatewayTimeout", f"sent nothing for {self.upstream_timeout_s:g} s"
        if error == "upstream_unreachable":
            return 502, "BadGateway", f"could not be reached{cause}"
        return 502, "BadGateway", f"closed the connection{cause}"

    @staticmethod
    def _restarting_response(upstream: Upstream) -> web.Response:
        return error_response(503, f"upstream {upstream.label} died and is being restarted", "ServiceUnavailable",
                              **{"Retry-After": "10"})

    async def _end_stream_with_error(self, response: web.StreamResponse, upstream: Upstream, error: str) -> None:
        """End a stream the upstream broke off with an OpenAI-style error event (clients' SDKs raise on
        it) instead of a silent end that reads like a finished reply; no ``[DONE]`` follows."""
        code, kind, what = self._upstream_failure(error)
        event = {"error": {"message": f"draftsmith proxy: upstream {upstream.label} {what} mid-stream",
                           "type": kind, "code": code}}
        with contextlib.suppress(ConnectionResetError, RuntimeError):  # the client may be gone too
            await response.write(f"data: {json.dumps(event)}\n\n".encode())

    # ------------------------------------------------------------------ managed servers that die

    def _upstream_is_down(self, upstream: Upstream) -> bool:
        """Managed mode: whether ``upstream`` (the current one) is a server whose process has died;
        starts its restart when none is under way and the backoff after a failed one has passed."""
        if self.servers is None or upstream is not self._current or self.servers.alive(upstream.base_url):
            return False
        restarting = self._restart is not None and not self._restart.done()
        if not restarting and time.monotonic() >= self._restart_not_before:
            self._restart = asyncio.ensure_future(self._restart_server(upstream))
        return True

    async def _restart_server(self, dead: Upstream) -> None:
        """Start a server with the dead one's draft and k, then swap to it (the dead one is retired)."""
        info = self.servers.info(dead.base_url)
        async with self._admin_lock:  # no admin swap while restarting (it answers 409)
            if info is None or dead is not self._current:
                return
            print(f"draftsmith proxy: the server of {dead.label} ({dead.base_url}) died; restarting it "
                  f"with {info['draft']}", file=sys.stderr, flush=True)
            try:
                server = await self.servers.start(Path(info["draft"]), info["k"])
            except (ServerStartError, ValueError) as exc:
                self.counters["restart_failures"] += 1
                self._restart_error = str(exc).splitlines()[0]
                self._restart_not_before = time.monotonic() + RESTART_BACKOFF_S
                print(f"draftsmith proxy: restart failed ({self._restart_error}); answering 503, next attempt "
                      f"in {RESTART_BACKOFF_S:g} s", file=sys.stderr, flush=True)
                return
            self._restart_error = None
            self.counters["restarts"] += 1
            await self.swap(server["base_url"], on_retire=self._retire)

    # ------------------------------------------------------------------ admin

    @web.middleware
    async def _admin_guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Admin paths: the token check, and an :class:`_AdminError` answered as ``{"error": ...}``."""
        if not request.path.startswith(ADMIN_PREFIX):
            return await handler(request)
        try:
            given = request.headers.get(ADMIN_HEADER, "")
            if self.admin_token is not None and not hmac.compare_digest(given.encode(), self.admin_token.encode()):
                raise _AdminError(403, f"admin endpoints need the header {ADMIN_HEADER}")
            return await handler(request)
        except _AdminError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)

    async def _admin_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _admin_unknown(self, request: web.Request) -> web.Response:
        raise _AdminError(404, f"no admin endpoint {request.method} {request.path} "
                               f"(POST {ADMIN_PREFIX}swap, GET {ADMIN_PREFIX}status)")

    async def _admin_swap(self, request: web.Request) -> web.Response:
        body = json_or_none(await request.read())
        if not isinstance(body, dict) or ("draft" in body) == ("upstream" in body):
            raise _AdminError(400, 'the body names one of {"upstream": URL} or {"draft": EXPORT_DIR}')
        if self._admin_tasks or self._admin_lock.locked():  # checked and claimed with no await between
            raise _AdminError(409, "a swap (or a restart of a dead server) is running; retry once it has answered")
        # the swap runs to its end even if the admin client leaves (aiohttp then cancels this handler):
        # a swap cut between switch and retirement would leave the old server running
        task = asyncio.ensure_future(self._admin_swap_in_turn(body))
        self._admin_tasks.add(task)
        task.add_done_callback(self._admin_tasks.discard)
        return web.json_response(await asyncio.shield(task))

    async def _admin_swap_in_turn(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self._admin_lock:
            if "draft" in body:
                return await self._swap_draft(body)
            try:
                url = checked_base_url(str(body["upstream"]))
            except ValueError as exc:
                raise _AdminError(400, str(exc)) from None
            if url not in self.allowed_upstreams:  # the proxy never dials a URL it was sent over the network
                raise _AdminError(403, f"upstream {url} was not given on the command line (--upstream); "
                                       f"allowed: {', '.join(sorted(self.allowed_upstreams))}")
            return await self.swap(url, on_retire=self._retire)

    async def _swap_draft(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.servers is None:
            raise _AdminError(400, "draft swaps need managed mode (start the proxy with --target and --draft)")
        k = body.get("k")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise _AdminError(400, f"k must be a positive integer, not {k!r}")
        draft = Path(str(body["draft"]))
        try:  # first into the running server (no second server, no extra GPU memory), where vLLM can
            updated, why_not = await self.servers.update_in_place(self._current.base_url, draft, k)
        except ValueError as exc:
            raise _AdminError(400, str(exc)) from None
        except WeightUpdateError as exc:
            raise _AdminError(500, f"in-place draft update failed: {exc}") from None
        if updated is not None:
            self.counters["swaps"] += 1
            return {"mode": "in_place", "upstream": self._current.describe(), "draft": updated["draft"],
                    "k": updated["k"], "update_s": updated["update_s"]}
        try:
            server = await self.servers.start(draft, k)
        except ValueError as exc:
            raise _AdminError(400, str(exc)) from None
        except ServerStartError as exc:  # the old server keeps serving
            raise _AdminError(500, str(exc)) from None
        result = await self.swap(server["base_url"], on_retire=self._retire)
        return {**result, "mode": "two_servers", "in_place_not_used": why_not, "draft": server["draft"],
                "k": server["k"], "server_log": server["log"]}

    async def _retire(self, old: dict[str, str]) -> None:
        if self.servers is not None:
            await self.servers.stop(old["base_url"])


# --------------------------------------------------------------------------- command line


async def serve(proxy: TrafficProxy, host: str, port: int) -> None:
    """Run ``proxy`` on ``host``:``port`` until SIGINT, SIGTERM or SIGHUP."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    url = await proxy.start(host, port)
    print(f"draftsmith proxy: {url} -> {proxy.upstream['base_url']} ({proxy.upstream['label']}); "
          f"traffic log {proxy.log.path if proxy.log else 'off'}", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.close()
