"""One vLLM OpenAI server on loopback. Its lifecycle (command line, start, stop, warm-up) lives
in :mod:`draftsmith.vllm_server`, shared with regeneration; it is re-exported here so every
import from this module keeps working. What only the benchmark asks of the server
(``/metrics`` spec-decode counters) stays here."""

from __future__ import annotations

from typing import Any

from .metrics import parse_spec_counters
from ...vllm_server import (  # noqa: F401  (re-exported)
    _LOOPBACK,
    ServerOptions,
    ServerStartError,
    command_log,
    free_port,
    log_tail,
    server_command,
    stop_process_group,
    vllm_server,
    vllm_cli_works,
    warm_up,
)


def fetch_spec_counters(base_url: str) -> dict[str, Any]:
    with _LOOPBACK.open(f"{base_url}/metrics", timeout=30) as r:
        return parse_spec_counters(r.read().decode())

