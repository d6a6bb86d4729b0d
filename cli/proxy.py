"""``draftsmith proxy``: the OpenAI-compatible proxy in front of ``vllm serve`` (the command line of
:mod:`draftsmith.serve.proxy`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from ..runtime import HelpFormatter
from ..serve import proxy as px
from ..serve.managed import ManagedServers
from ..serve.traffic_writer import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, TrafficLog
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args
from ..vllm_bridge.server import ServerOptions, ServerStartError


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``draftsmith proxy``."""
    p = argparse.ArgumentParser(description=px.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="unmanaged mode: the base URL of a running OpenAI server, e.g. http://127.0.0.1:8001; "
                        "repeat it to name the upstreams POST /draftsmith/swap may switch to (the first serves)")
    p.add_argument("--draft", type=Path, help="managed mode: the exported draft the first vllm serve serves")
    p.add_argument("--target", help="managed mode: target directory, hub id or embedded:NAME (default: the recipe's)")
    p.add_argument("--recipe", type=Path, help="managed mode: recipe YAML (target, vllm engine, eval.num_speculative_tokens)")
    p.add_argument("--k", type=int, help="managed mode: num_speculative_tokens (default: the recipe's, else 3)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="managed mode: seconds to wait for a server's /health")
    p.add_argument("--inplace-swap", action=argparse.BooleanOptionalAction, default=True,
                   help="managed mode: start servers that accept in-place draft weight updates (vLLM's dev-mode "
                        "routes on the loopback server), so a draft swap of the same architecture and k loads "
                        "the new weights into the running server; otherwise, or when vLLM cannot, a swap starts "
                        "a second server")
    p.add_argument("--server-logs", type=Path, help="managed mode: directory of the servers' logs (default: proxy_servers/ beside --log)")
    p.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    p.add_argument("--port", type=int, default=8000, help="port the proxy listens on")
    p.add_argument("--log", type=Path, default=Path("traffic.jsonl"), help="traffic log (JSON lines, rotated)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="bytes per traffic log file before it rotates")
    p.add_argument("--backups", type=int, default=DEFAULT_BACKUPS, help="rotated traffic log files kept (.1 ... .N)")
    p.add_argument("--admin-token", help=f"token the admin endpoints require in {px.ADMIN_HEADER} "
                                         f"(default: ${px.ADMIN_TOKEN_ENV}; none: no check, allowed only on a loopback --host)")
    p.add_argument("--max-request-bytes", type=int, default=px.DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; larger ones get 413")
    p.add_argument("--upstream-timeout", type=float, default=px.DEFAULT_UPSTREAM_TIMEOUT_S,
                   help="seconds the upstream may stay silent (before its answer or between two chunks): then 504, "
                        "or an error event ends the stream")
    add_vllm_arguments(p)
    return p


def managed_servers_from_args(args: argparse.Namespace) -> ManagedServers:
    """The managed servers of ``--draft`` mode: target, engine flags over the recipe's ``vllm``, k.

    Raises:
        ValueError / RecipeError / FileNotFoundError: no target, a bad recipe or engine flag, an unknown target.
    """
    from ..target import resolve_target
    from ..recipe import load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else None
    target_name = args.target or (recipe.target.name_or_path if recipe else None)
    if target_name is None:
        raise ValueError("managed mode needs a target: --target or --recipe")
    trust = recipe.target.trust_remote_code if recipe else False
    options = ServerOptions(engine=vllm_config_from_args(args, recipe.vllm if recipe else None),
                            startup_timeout_s=args.startup_timeout, trust_remote_code=trust,
                            inplace_swap=args.inplace_swap)
    k = args.k if args.k is not None else (recipe.eval.num_speculative_tokens if recipe else 3)
    log_dir = args.server_logs or args.log.expanduser().resolve().parent / "proxy_servers"
    return ManagedServers(resolve_target(target_name, trust), options, k, log_dir,
                          recipe.eval.draft_sampling if recipe else "greedy")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if (args.upstream is None) == (args.draft is None):
        print("error: name one of --upstream URL (unmanaged) or --draft EXPORT_DIR (managed)", file=sys.stderr)
        return 2
    admin_token = args.admin_token or os.environ.get(px.ADMIN_TOKEN_ENV) or None
    if admin_token is None and args.host not in px.LOOPBACK_HOSTS:
        print(f"error: --host {args.host} is reachable from other machines: set --admin-token (or "
              f"${px.ADMIN_TOKEN_ENV}), or anyone who reaches the port could swap the upstream", file=sys.stderr)
        return 2
    if args.max_request_bytes < 1 or args.upstream_timeout <= 0:
        print("error: --max-request-bytes and --upstream-timeout must be positive", file=sys.stderr)
        return 2
    try:
        servers = managed_servers_from_args(args) if args.draft is not None else None
        allowed = [px.checked_base_url(u) for u in args.upstream] if servers is None else []
        upstream = allowed[0] if allowed else None
        log = TrafficLog(args.log, args.max_bytes, args.backups)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if servers is not None:
            # started before the event loop: a Ctrl-C during the start stops the server (vllm_server's finally)
            upstream = servers.start_blocking(args.draft)["base_url"]
        proxy = px.TrafficProxy(upstream, log, admin_token=admin_token, servers=servers, allowed_upstreams=allowed,
                                max_request_bytes=args.max_request_bytes, upstream_timeout_s=args.upstream_timeout)
        asyncio.run(px.serve(proxy, args.host, args.port))
    except ValueError as exc:  # a draft vLLM does not serve here, or one not trained for the target
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ServerStartError, OSError) as exc:  # OSError: the proxy's port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if servers is not None:
            servers.close_blocking()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

