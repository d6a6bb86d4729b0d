"""``draftsmith proxy`` under load, on loopback: the latency it adds, its CPU cost, and whether its
memory, file descriptors and traffic log stay sound.

    python -m benchmarks.proxy_load [--requests 2000] [--concurrency 256] [--stream-share 0.5]
                                    [--tokens 16] [--token-rate 0] [--json OUT.json]

An OpenAI stub (:mod:`benchmarks.stub_openai`, its own process) stands in for ``vllm serve``; the
proxy is the real command (``python -m draftsmith.cli proxy``, its own process) with a rotating
traffic log. The same mixed load (a ``--stream-share`` of streamed chat requests, the rest plain
chat) runs once straight at the stub and once through the proxy, and the figures are:

- latency to the last byte, p50 / p99, direct and through the proxy; the difference is what the
  proxy adds (one more loopback hop, the copy and the log record);
- proxy CPU seconds (user + system, from ``/proc``) per 1,000 requests;
- proxy RSS (MiB) and open file descriptors after a warm-up and after the run (flat: no leak);
- the traffic log: lines per request id (exactly one for every finished request) and torn lines
  (a line that is not one JSON object, across every rotated file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import subprocess_env


def start_process(cmd: list[str], ready: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` and return it with the first stdout line that starts with ``ready``.

    Raises:
        RuntimeError: the process exited or printed no such line within ``timeout_s``.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready):
            return proc, line.strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start: {proc.stderr.read()[-2000:]}")


def start_stub(tokens: int = 16, ttft: float = 0.0, token_rate: float = 0.0, model: str = "m"
               ) -> tuple[subprocess.Popen, str]:
    """The OpenAI stub in its own process: ``(process, base URL)``."""
    proc, line = start_process([sys.executable, "-m", "benchmarks.stub_openai", "--tokens", str(tokens),
                                "--ttft", str(ttft), "--token-rate", str(token_rate), "--model", model], "port ")
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def start_proxy(upstreams: list[str], log: Path, max_bytes: int, backups: int, *extra: str
                ) -> tuple[subprocess.Popen, str]:
    """``draftsmith proxy`` in its own process on a free port: ``(process, base URL)``."""
    cmd = [sys.executable, "-m", "draftsmith.cli", "proxy", "--port", "0", "--log", str(log),
           "--max-bytes", str(max_bytes), "--backups", str(backups), *extra]
    for url in upstreams:
        cmd += ["--upstream", url]
    proc, line = start_process(cmd, "draftsmith proxy: ")
    return proc, line.split()[2]


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open file descriptors and CPU seconds (user + system) of process ``pid``."""
    import psutil

    p = psutil.Process(pid)
    cpu = p.cpu_times()
    return {"rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds(), "cpu_s": cpu.user + cpu.system}


def request_body(rid: str, stream: bool, model: str = "m") -> dict[str, Any]:
    """A chat request the stub answers; ``user`` carries the request id into the traffic log."""
    return {"model": model, "user": rid, "stream": stream, "max_tokens": 64,
            "messages": [{"role": "user", "content": f"request {rid}: say something"}]}


async def run_load(url: str, rids: list[str], concurrency: int, stream_share: float, seed: int = 0
                   ) -> list[dict[str, Any]]:
    """Send one chat request per id at ``concurrency`` in flight; ``stream_share`` of them streamed
    (seeded). Returns ``{"rid", "stream", "status", "latency_s", "bytes"}`` per request, latency to
    the last byte."""
    import aiohttp

    rng = random.Random(seed)
    plan = [(rid, rng.random() < stream_share) for rid in rids]
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        async def one(rid: str, stream: bool) -> None:
            async with sem:
                t0 = time.perf_counter()
                async with client.post(url + "/v1/chat/completions", json=request_body(rid, stream)) as r:
                    body = await r.read()
                results.append({"rid": rid, "stream": stream, "status": r.status,
                                "latency_s": time.perf_counter() - t0, "bytes": len(body)})

        await asyncio.gather(*(one(rid, stream) for rid, stream in plan))
    return results


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def read_log(log: Path) -> tuple[list[dict[str, Any]], int, int]:
    """``(records, torn lines, files)`` of the traffic log and its rotated files. A torn line is one
    that is not a JSON object, or a file whose last line has no newline."""
    files = sorted(log.parent.glob(log.name + "*"))
    records, torn = [], 0
    for f in files:
        raw = f.read_bytes()
        if raw and not raw.endswith(b"\n"):
            torn += 1
        for line in raw.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if isinstance(rec, dict):
                records.append(rec)
            else:
                torn += 1
    return records, torn, len(files)


def wait_logged(url: str, expected: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll the proxy's status until ``expected`` lines are written or counted as not written."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while True:
        with opener.open(url + "/draftsmith/status", timeout=10) as r:
            counters = json.loads(r.read())["counters"]
        if counters["logged"] + counters["log_write_errors"] >= expected or time.monotonic() > deadline:
            return counters
        time.sleep(0.1)


def run(requests: int = 2000, concurrency: int = 256, stream_share: float = 0.5, tokens: int = 16,
        token_rate: float = 0.0, warmup: int | None = None, max_bytes: int = 256 * 2**10, backups: int = 50,
        workdir: Path | None = None) -> dict[str, Any]:
    """The whole measurement (module docstring); returns the figures and the per-request check.
    ``warmup`` requests (default: twice ``concurrency``) fill the proxy's pool of upstream
    connections first, so the fds and RSS before the run compare like for like with after it."""
    warmup = 2 * concurrency if warmup is None else warmup
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        log = work / "traffic.jsonl"
        stub, stub_url = start_stub(tokens=tokens, token_rate=token_rate)
        proxy = None
        try:
            proxy, proxy_url = start_proxy([stub_url], log, max_bytes, backups)
            asyncio.run(run_load(proxy_url, [f"warm-{i}" for i in range(warmup)], concurrency, stream_share, seed=1))
            wait_logged(proxy_url, warmup)
            before = process_figures(proxy.pid)
            rids = [f"r{i:05d}" for i in range(requests)]
            direct = asyncio.run(run_load(stub_url, [f"d{i:05d}" for i in range(requests)], concurrency, stream_share))
            mid = process_figures(proxy.pid)  # the direct run costs the proxy nothing; measured for honesty
            proxied = asyncio.run(run_load(proxy_url, rids, concurrency, stream_share))
            counters = wait_logged(proxy_url, warmup + requests)
            after = process_figures(proxy.pid)
        finally:
            for proc in (proxy, stub):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=30)
        records, torn, files = read_log(log)
        per_rid: dict[str, int] = {}
        for rec in records:
            rid = (rec.get("request") or {}).get("user")
            per_rid[rid] = per_rid.get(rid, 0) + 1
        ok = [r for r in proxied if r["status"] == 200]
        lat_direct = [r["latency_s"] for r in direct]
        lat_proxy = [r["latency_s"] for r in proxied]
        return {
            "requests": requests, "concurrency": concurrency, "stream_share": stream_share, "tokens": tokens,
            "status_200": len(ok), "statuses": sorted({r["status"] for r in proxied}),
            "direct_p50_ms": 1e3 * percentile(lat_direct, 0.5), "direct_p99_ms": 1e3 * percentile(lat_direct, 0.99),
            "proxy_p50_ms": 1e3 * percentile(lat_proxy, 0.5), "proxy_p99_ms": 1e3 * percentile(lat_proxy, 0.99),
            "added_p50_ms": 1e3 * (percentile(lat_proxy, 0.5) - percentile(lat_direct, 0.5)),
            "added_p99_ms": 1e3 * (percentile(lat_proxy, 0.99) - percentile(lat_direct, 0.99)),
            "proxy_cpu_s_per_1000": 1000 * (after["cpu_s"] - mid["cpu_s"]) / requests,
            "proxy_cpu_s_during_direct_run": mid["cpu_s"] - before["cpu_s"],
            "rss_mib_before": before["rss_mib"], "rss_mib_after": after["rss_mib"],
            "fds_before": before["fds"], "fds_after": after["fds"],
            "log_files": files, "log_records": len(records), "torn_lines": torn,
            "logged_once": sum(1 for rid in rids if per_rid.get(rid) == 1),
            "logged_more_than_once": sum(1 for rid in rids if per_rid.get(rid, 0) > 1),
            "not_logged": sum(1 for rid in rids if rid not in per_rid),
            "log_write_errors": counters["log_write_errors"],
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests")
    p.add_argument("--tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--token-rate", type=float, default=0.0, help="stub tokens/s per stream (0: unthrottled)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    figures = run(args.requests, args.concurrency, args.stream_share, args.tokens, args.token_rate)
    for key, value in figures.items():
        print(f"{key:32s} {value:.2f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
