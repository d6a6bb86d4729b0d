"""A soak of ``draftsmith proxy``: minutes of moderate load with log rotation and one swap, sampled.

    python scripts/soak_proxy.py [--minutes 30] [--concurrency 16] [--sample-every 60] [--json OUT]
                                                                               (from the repository root)

Two OpenAI stubs (``benchmarks/stub_openai.py``, each its own process: ``--tokens`` per reply at
``--token-rate`` tokens/s) stand in for two vLLM servers; the proxy is the real command (its own
process) with ``--upstream A --upstream B`` and a small rotating log (``--max-bytes`` x
``--backups``), so rotation deletes old files all along. ``--concurrency`` clients send chat requests
back to back (half streamed). Half-way, ``POST /draftsmith/swap {"upstream": B}``. Every
``--sample-every`` seconds it prints one row: minutes, requests answered, non-200 answers, proxy RSS
(MiB), open fds, CPU seconds, lines logged, lines not written, log files and their bytes. The
pass/fail summary at the end: every request answered 200; lines logged + not written == requests;
RSS and fds of the last sample against the first (after the warm-up); log bytes within
``(backups + 1) * max_bytes`` plus one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.proxy_load import process_figures, request_body, start_proxy, start_stub  # noqa: E402

LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def admin(url: str, path: str, payload: dict | None = None) -> dict[str, Any]:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with LOOPBACK.open(req, timeout=120) as r:
        return json.loads(r.read())


async def soak(args: argparse.Namespace, proxy_url: str, proxy_pid: int, log: Path, b_url: str) -> dict[str, Any]:
    import aiohttp

    state = {"requests": 0, "non_200": 0, "swap": None}
    samples: list[dict[str, Any]] = []
    stop_at = time.monotonic() + 60 * args.minutes
    started = time.monotonic()

    async def client(n: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while time.monotonic() < stop_at:
            async with session.post(proxy_url + "/v1/chat/completions",
                                    json=request_body(f"c{n}-{i}", stream=i % 2 == 0)) as r:
                await r.read()
                state["requests"] += 1
                state["non_200"] += r.status != 200
            i += 1

    def sample() -> dict[str, Any]:
        status = admin(proxy_url, "/draftsmith/status")
        files = sorted(log.parent.glob(log.name + "*"))
        row = {"minutes": (time.monotonic() - started) / 60, "requests": state["requests"],
               "non_200": state["non_200"], **process_figures(proxy_pid),
               "logged": status["counters"]["logged"], "not_written": status["counters"]["log_write_errors"],
               "log_files": len(files), "log_bytes": sum(f.stat().st_size for f in files)}
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        return row

    async def sampler() -> None:
        swapped = False
        while time.monotonic() < stop_at:
            await asyncio.sleep(args.sample_every)
            samples.append(await asyncio.to_thread(sample))
            if not swapped and time.monotonic() - started > 30 * args.minutes:
                state["swap"] = await asyncio.to_thread(admin, proxy_url, "/draftsmith/swap", {"upstream": b_url})
                print(f"swap: {json.dumps(state['swap'])}", flush=True)
                swapped = True

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(sampler(), *(client(n, session) for n in range(args.concurrency)))
    await asyncio.sleep(1.0)  # the last lines reach the writer thread
    final = await asyncio.to_thread(sample)
    return {"samples": samples + [final], "swap": state["swap"], "requests": state["requests"],
            "non_200": state["non_200"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--tokens", type=int, default=64, help="tokens per reply")
    p.add_argument("--token-rate", type=float, default=200.0, help="tokens/s per stream")
    p.add_argument("--max-bytes", type=int, default=2**20)
    p.add_argument("--backups", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("runs/soak_proxy"))
    p.add_argument("--json", type=Path, help="write the samples and the summary here")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    log = args.workdir / "traffic.jsonl"
    for old in args.workdir.glob("traffic.jsonl*"):
        old.unlink()
    procs = []
    try:
        a, a_url = start_stub(tokens=args.tokens, token_rate=args.token_rate)
        b, b_url = start_stub(tokens=args.tokens, token_rate=args.token_rate)
        procs += [a, b]
        proxy, proxy_url = start_proxy([a_url, b_url], log, args.max_bytes, args.backups)
        procs.append(proxy)
        result = asyncio.run(soak(args, proxy_url, proxy.pid, log, b_url))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    first, last = result["samples"][0], result["samples"][-1]
    bound = (args.backups + 1) * args.max_bytes + 64 * 2**10
    checks = {
        "every request answered 200": result["non_200"] == 0,
        "logged + not written == requests": last["logged"] + last["not_written"] == result["requests"],
        "no line left unwritten": last["not_written"] == 0,
        "swapped once": result["swap"] is not None and result["swap"]["new"]["base_url"] == b_url,
        f"log bytes <= {bound}": all(s["log_bytes"] <= bound for s in result["samples"]),
        "fds flat (last <= first + 8)": last["fds"] <= first["fds"] + 8,
        "RSS flat (last <= first + 32 MiB)": last["rss_mib"] <= first["rss_mib"] + 32,
    }
    result["checks"] = checks
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
