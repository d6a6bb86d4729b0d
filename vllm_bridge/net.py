"""HTTP to the servers draftsmith talks to on loopback (the vLLM server it starts, its routes).

:data:`LOOPBACK` opens URLs without the ``http_proxy`` / ``https_proxy`` of the environment. It has
a module of its own so that :mod:`.server` and :mod:`.weight_update`, which both use it, need not
import each other (the import graph of :mod:`draftsmith.vllm_bridge` has no cycle).
"""

from __future__ import annotations

import urllib.request

# The server is on loopback: never route its requests through an http_proxy from the environment.
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))
