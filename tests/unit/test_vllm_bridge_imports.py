"""The modules of ``vllm_bridge/`` import each other without a cycle (imports inside functions
included): :data:`draftsmith.vllm_bridge.net.LOOPBACK` has a module of its own so that the server
and the weight-update routes, which both use it, need not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BRIDGE = ROOT / "vllm_bridge"
PACKAGE = "draftsmith.vllm_bridge"


def bridge_imports(name: str, source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` (``vllm_bridge`` module names, ``"server"``) that the module
    ``name`` with ``source`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module
            elif node.level == 0 and node.module and node.module.startswith(PACKAGE + "."):
                base = node.module[len(PACKAGE) + 1:]
            elif node.level == 0 and node.module == PACKAGE:
                base = None
            else:
                continue
            if base is None:  # from . import server, engine
                found |= {a.name for a in node.names if a.name in modules}
            else:
                found.add(base.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name[len(PACKAGE) + 1:].split(".")[0] for a in node.names if a.name.startswith(PACKAGE + ".")}
    return (found & modules) - {name}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    modules = set(sources)
    return {name: bridge_imports(name, text, modules) for name, text in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def bridge_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(BRIDGE.glob("*.py")) if p.stem != "__init__"}


def test_the_vllm_bridge_import_graph_has_no_cycle():
    graph = import_graph(bridge_sources())
    assert {"server", "weight_update", "net"} <= set(graph)
    assert find_cycle(graph) is None


def test_loopback_lives_in_net_and_both_users_import_it_from_there():
    graph = import_graph(bridge_sources())
    assert "net" in graph["server"] and "net" in graph["weight_update"]
    assert graph["net"] == set()


def test_the_checker_sees_a_cycle():
    # the scan must be able to fail: server importing weight_update inside a function and
    # weight_update importing server at its top (the circle LOOPBACK used to make) is caught
    sources = {"server": "def f():\n    from .weight_update import inplace_swap_server_env\n",
               "weight_update": "from .server import LOOPBACK\n",
               "net": "import urllib.request\n"}
    assert find_cycle(import_graph(sources)) == ["server", "weight_update", "server"]
    sources["weight_update"] = "from draftsmith.vllm_bridge import server\n"
    assert find_cycle(import_graph(sources)) == ["server", "weight_update", "server"]
    sources["weight_update"] = "from .net import LOOPBACK\n"
    assert find_cycle(import_graph(sources)) is None
