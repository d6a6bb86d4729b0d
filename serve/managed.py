"""The ``vllm serve`` processes a managed ``draftsmith proxy`` (``--draft``) owns: one per draft, all
serving one target with the same engine options; a swap starts the next one beside the current."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any



from ..vllm_bridge import spec_config
from ..vllm_bridge.server import ServerOptions, ServerStartError, vllm_server
from ..vllm_bridge.spec_config import served_method


def draft_speculative_config(draft: Path, target: Path, k: int, draft_sampling: str = "greedy") -> dict[str, Any]:
    """vLLM's ``speculative_config`` serving the exported ``draft`` with ``k`` draft tokens (drafting
    at T > 0 as ``draft_sampling`` says), once the method's check has confirmed that the export fits
    ``target``.

    Raises:
        ValueError: not an export vLLM serves here (:func:`draftsmith.vllm_bridge.spec_config.served_method`).
        DraftMismatchError (a ValueError): the draft was not trained for ``target``.
    """
    spec = served_method(Path(draft))
    if spec.target_check is not None:
        spec.target_check(Path(draft), Path(target))
    return spec_config.for_export(spec, str(draft), k, draft_sampling)


@dataclass
class _Server:
    stack: contextlib.ExitStack
    info: dict[str, Any]


class ManagedServers:
    """The ``vllm serve`` processes that a managed proxy owns. All of them serve one target, with
    the same engine options (so the same served model name), and each has its own draft.

    The blocking methods run on a worker thread (:func:`asyncio.to_thread`) or before the event
    loop starts. Each server has its own ``ExitStack``, which holds
    :func:`draftsmith.vllm_bridge.server.vllm_server` open until :meth:`stop_blocking`.
    """

    def __init__(self, target: Path, options: ServerOptions, k: int, log_dir: Path, draft_sampling: str = "greedy"):
        self.target, self.options, self.k, self.log_dir = Path(target), options, k, Path(log_dir)
        self.draft_sampling = draft_sampling  # vLLM's draft_sample_method of every server (docs/temperature.md)
        self._servers: dict[str, _Server] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._numbers = itertools.count()

    def start_blocking(self, draft: Path, k: int | None = None) -> dict[str, Any]:
        """Start a server for ``draft`` (``k`` draft tokens, default :attr:`k`) and wait for ``/health``.

        Returns ``{"base_url", "port", "pgid", "command", "alive", "draft", "k", "log", "speculative_config"}``
        (``alive()``: whether the server process is still running).

        Raises:
            ValueError: see :func:`draft_speculative_config`.
            ServerStartError: the server exited or was not healthy in time (the message has its
                log tail), or the proxy closed while the server was starting.
        """
        k = self.k if k is None else k
        spec = draft_speculative_config(Path(draft), self.target, k, self.draft_sampling)
        log_path = self.log_dir / f"server-{next(self._numbers)}.log"
        stack = contextlib.ExitStack()
        server = stack.enter_context(vllm_server(self.target, spec, self.options, log_path))
        info = {**server, "draft": str(draft), "k": k, "log": str(log_path), "speculative_config": spec}
        with self._lock:
            closed = self._closed
            if not closed:
                self._servers[server["base_url"]] = _Server(stack, info)
        if closed:  # close_blocking ran while this server was starting: nobody would stop it
            stack.close()
            raise ServerStartError("the proxy closed while the server was starting")
        return info

    def update_in_place_blocking(self, base_url: str, draft: Path, k: int | None = None) -> tuple[dict[str, Any] | None, str]:
        """Load ``draft``'s weights into the running server at ``base_url`` (vLLM's draft weight
        update, :func:`draftsmith.vllm_bridge.weight_update.update_draft_weights`): no second
        server, no extra GPU memory. Then check that the server holds the new weights.

        Returns:
            ``(info, reason)``: the server's updated :meth:`start_blocking` record and ``""``, or
            ``(None, why not)`` when an in-place update cannot serve this swap: servers started
            without ``inplace_swap``, a ``k`` other than the server's (a server-level setting),
            a server whose vLLM does not update drafts, or an export of another method or
            tensor set than the served one (an update cannot change the architecture). The
            caller then starts a second server.

        Raises:
            ValueError: see :func:`draft_speculative_config` (not a servable export, another target).
            WeightUpdateError: vLLM failed the update, or served other weights afterwards.
        """
        from ..vllm_bridge.weight_update import (WeightUpdateError, draft_weight_update_support,
                                                 served_draft_matches, update_draft_weights)

        with self._lock:
            server = self._servers.get(base_url)
        if server is None or not self.options.inplace_swap:
            return None, "the server was not started for in-place updates (--no-inplace-swap)"
        k = self.k if k is None else k
        if k != server.info["k"]:
            return None, f"k {k} differs from the running server's {server.info['k']} (set when a server starts)"
        spec = draft_speculative_config(Path(draft), self.target, k, self.draft_sampling)
        if spec.get("method") != server.info["speculative_config"].get("method"):
            return None, f"the new draft is served as {spec.get('method')}, the running one as another method"
        supported, reason = draft_weight_update_support(base_url)
        if not supported:
            return None, reason
        try:
            result = update_draft_weights(base_url, Path(draft))
        except ValueError as exc:  # another tensor set: a new architecture needs a new server
            return None, str(exc)
        if not served_draft_matches(base_url, Path(draft)):
            raise WeightUpdateError(f"{base_url}: after the update the server does not hold {draft}'s weights")
        with self._lock:
            server.info.update(draft=str(draft), speculative_config=spec, update_s=result["seconds"])
            return dict(server.info), ""

    async def update_in_place(self, base_url: str, draft: Path, k: int | None = None) -> tuple[dict[str, Any] | None, str]:
        """:meth:`update_in_place_blocking` on a worker thread."""
        return await asyncio.to_thread(self.update_in_place_blocking, base_url, draft, k)

    async def start(self, draft: Path, k: int | None = None) -> dict[str, Any]:
        """:meth:`start_blocking` on a worker thread."""
        return await asyncio.to_thread(self.start_blocking, draft, k)

    def stop_blocking(self, base_url: str) -> bool:
        """Stop the server at ``base_url`` (SIGTERM to its process group, then SIGKILL). Returns
        False when no managed server is at that URL."""
        with self._lock:
            server = self._servers.pop(base_url, None)
        if server is None:
            return False
        server.stack.close()
        return True

    async def stop(self, base_url: str) -> bool:
        """:meth:`stop_blocking` on a worker thread."""
        return await asyncio.to_thread(self.stop_blocking, base_url)

    def alive(self, base_url: str) -> bool:
        """False when the managed server at ``base_url`` has a process and it has exited (True for
        a URL this object does not manage, or a server that cannot tell)."""
        with self._lock:
            server = self._servers.get(base_url)
        check = server.info.get("alive") if server is not None else None
        return True if check is None else bool(check())

    def info(self, base_url: str) -> dict[str, Any] | None:
        """What :meth:`start_blocking` returned for the server at ``base_url`` (None: not managed here)."""
        with self._lock:
            server = self._servers.get(base_url)
        return dict(server.info) if server is not None else None

    def describe(self) -> dict[str, dict[str, Any]]:
        """The running servers by base URL: draft, k, log, process group."""
        with self._lock:
            return {url: {key: s.info[key] for key in ("draft", "k", "log", "pgid")} for url, s in self._servers.items()}

    def close_blocking(self) -> None:
        """Stop every server. A server that is still starting is stopped when its start returns."""
        with self._lock:
            self._closed = True
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.stack.close()
