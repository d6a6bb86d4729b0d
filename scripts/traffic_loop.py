"""The measured traffic-adaptation loop (issue 18) on one machine:

1. ``draftsmith proxy`` (managed) serves the target with the base draft and logs traffic;
2. the shifted-domain prompts (``builtin:code_math``) are served through it;
3. ``draftsmith adapt`` continues the base draft on that log (replay of the base data);
4. output tok/s through the proxy on the held-out prompts with the base draft, then a swap to the
   adapted draft while requests are in flight (every response checked), then tok/s again;
5. offline ``draftsmith acceptance`` (vLLM counters) of both drafts on the held-out traffic prompts
   and on MT-bench.

    python scripts/traffic_loop.py --base-draft runs/cmp/out/demo/eagle3/export/eagle3 \\
        --base-recipe runs/cmp/out/demo/eagle3/recipe.yaml --replay runs/cmp/demo_prep/data/regen.jsonl \\
        --target ~/.cache/draftsmith/targets/SmolLM2-135M-Instruct --mt-bench mt_bench.jsonl --out runs/i18

Finished phases are kept (``OUT/phases.json``), so a stopped loop continues where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get_json(url: str, timeout: float = 10) -> Any:
    with OPENER.open(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


async def drive(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                temperature: float, during: Any = None) -> dict[str, Any]:
    """Send every prompt (chat, non-streaming and every 4th streamed) through the proxy with
    ``concurrency`` in flight; ``during``: a coroutine run alongside (the swap). Returns counts,
    output tokens and output tok/s; a request fails on any exception or a reply without finish_reason."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []

    async def one(i: int, text: str) -> None:
        async with sem:
            t0 = time.perf_counter()
            try:
                kwargs = {"model": model, "messages": [{"role": "user", "content": text}],
                          "max_tokens": max_tokens, "temperature": temperature}
                if i % 4 == 3:
                    stream = await client.chat.completions.create(
                        **kwargs, stream=True, stream_options={"include_usage": True})
                    tokens, finish, content = 0, None, ""
                    async for chunk in stream:
                        if chunk.usage:
                            tokens = chunk.usage.completion_tokens
                        for c in chunk.choices:
                            content += c.delta.content or ""
                            finish = c.finish_reason or finish
                else:
                    r = await client.chat.completions.create(**kwargs)
                    tokens, finish, content = r.usage.completion_tokens, r.choices[0].finish_reason, \
                        r.choices[0].message.content
                ok = finish is not None and content is not None
                results.append({"i": i, "ok": ok, "tokens": tokens, "s": time.perf_counter() - t0})
            except Exception as exc:  # noqa: BLE001  (every failure counts)
                results.append({"i": i, "ok": False, "error": repr(exc)[:300], "s": time.perf_counter() - t0})

    t0 = time.perf_counter()
    extra = None
    if during is None:
        await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    else:  # keep `concurrency` requests in flight, cycling the prompts, until `during` is done and 30 s more
        finished = asyncio.Event()
        sent = itertools.count()

        async def worker() -> None:
            while not finished.is_set():
                i = next(sent)
                await one(i, prompts[i % len(prompts)])

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        extra = await during
        await asyncio.sleep(30)
        finished.set()
        await asyncio.gather(*workers)
        prompts = [None] * len(results)  # every request sent, for the answered-once check below
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(r.get("tokens", 0) for r in results if r["ok"])
    answered = sorted(r["i"] for r in results)
    return {"requests": len(prompts), "ok": sum(r["ok"] for r in results),
            "failed": [r for r in results if not r["ok"]][:20], "num_failed": sum(not r["ok"] for r in results),
            "answered_once": answered == list(range(len(prompts))), "output_tokens": tokens,
            "wall_s": round(wall, 1), "output_tok_s": round(tokens / wall, 1), "during": extra}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-draft", required=True, type=Path)
    p.add_argument("--base-recipe", required=True)
    p.add_argument("--replay", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--recipe", default="recipes/smollm2_135m.yaml", help="engine settings (vllm section)")
    p.add_argument("--prompts", default="builtin:code_math")
    p.add_argument("--per-category", type=int, help="serve the first N prompts of each category (code, math)")
    p.add_argument("--mt-bench", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--bench-concurrency", type=int, default=4)
    p.add_argument("--bench-max-tokens", type=int, default=128)
    p.add_argument("--budget-minutes", type=float, default=30)
    p.add_argument("--adapt-set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override passed to draftsmith adapt (repeatable)")
    p.add_argument("--stop-after", choices=["traffic"], help="stop after this phase (run the rest later)")
    args = p.parse_args()
    from draftsmith.serve.adapt import swap
    from draftsmith.eval.serving.client import load_prompt_texts

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    phases_file = out / "phases.json"
    phases = json.loads(phases_file.read_text()) if phases_file.exists() else {}

    def done(name: str, value: Any) -> None:
        phases[name] = value
        phases_file.write_text(json.dumps(phases, indent=1))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(value)[:600]}", flush=True)

    base_url = f"http://127.0.0.1:{args.port}"
    adapted = out / "adapt" / "export" / "adapted"
    heldout = out / "adapt" / "traffic" / "heldout.jsonl"
    log_path = out / "traffic" / "traffic.jsonl"
    log_path.parent.mkdir(exist_ok=True)

    @contextlib.contextmanager
    def serving(draft: Path):
        """A managed ``draftsmith proxy`` serving ``draft``; yields the served model name."""
        cmd = [sys.executable, "-m", "draftsmith.cli", "proxy", "--recipe", args.recipe, "--target", args.target,
               "--draft", str(draft), "--port", str(args.port), "--log", str(log_path)]
        with open(out / "proxy.log", "a") as log:
            proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            while True:
                if proxy.poll() is not None:
                    raise SystemExit(f"proxy exited ({proxy.returncode}); see {out / 'proxy.log'}")
                with contextlib.suppress(OSError, KeyError, IndexError):
                    yield_model = get_json(f"{base_url}/v1/models")["data"][0]["id"]
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("proxy not up after 900 s")
                time.sleep(2)
            yield yield_model
            done("proxy_status_" + draft.name, get_json(f"{base_url}/draftsmith/status"))
        finally:
            if proxy.poll() is None:
                os.killpg(proxy.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proxy.wait(120)

    if "traffic" not in phases:
        prompts = load_prompt_texts(args.prompts)
        if args.per_category:
            from draftsmith.data_prep.conversations import load_records

            records, _ = load_records(args.prompts)
            cats = [r["id"].rsplit("-", 1)[0] for r in records]
            seen: dict[str, int] = {}
            keep = []
            for text, cat in zip(prompts, cats, strict=True):
                seen[cat] = seen.get(cat, 0) + 1
                if seen[cat] <= args.per_category:
                    keep.append(text)
            prompts = keep
        served = set()  # a stopped loop serves only what has no answer in the log yet
        if log_path.exists():
            for line in log_path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                    rec = json.loads(line)
                    if rec["status"] == 200 and rec["choices"][0]["finish_reason"]:
                        served.add(rec["request"]["messages"][-1]["content"])
        with serving(args.base_draft) as model:
            done("traffic", {"already_served": len(served), **asyncio.run(drive(
                base_url, model, [q for q in prompts if q not in served], args.concurrency, args.max_tokens, 0.0))})
    if args.stop_after == "traffic":
        return 0
    if "adapt" not in phases:  # nothing else runs meanwhile: the budget is wall-clock
        t0 = time.monotonic()
        with open(out / "adapt.log", "a") as log:
            rc = subprocess.call([sys.executable, "-m", "draftsmith.cli", "adapt", "--log", str(log_path),
                                  "--deployed", str(args.base_draft), "--recipe", args.base_recipe,
                                  "--replay", args.replay, "--run-dir", str(out / "adapt"),
                                  "--budget-minutes", str(args.budget_minutes), "--overwrite",
                                  *[a for kv in args.adapt_set for a in ("--set", kv)]],
                                 stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            raise SystemExit(f"adapt failed ({rc}); see {out / 'adapt.log'}")
        result = json.loads((out / "adapt" / "adapt.json").read_text())
        done("adapt", {**{k: result[k] for k in ("conversations", "traffic", "cpu_seconds", "wall_seconds",
                                                  "prepare_seconds", "train_minutes_budget", "checkpoint")},
                       "loop_wall_s": round(time.monotonic() - t0, 1)})
    held = load_prompt_texts(str(heldout))
    if any(k not in phases for k in ("bench_before", "swap", "bench_after")):
        # the bench traffic goes to its own log, so the adaptation data stays the first traffic
        log_path = out / "traffic_bench" / "traffic.jsonl"
        log_path.parent.mkdir(exist_ok=True)
        with serving(adapted if "swap" in phases else args.base_draft) as model:
            if "bench_before" not in phases:
                done("bench_before", asyncio.run(drive(base_url, model, held, args.bench_concurrency,
                                                       args.bench_max_tokens, 0.0)))
            if "swap" not in phases:
                async def swap_later() -> Any:
                    await asyncio.sleep(20)  # requests in flight on the base server
                    return await asyncio.to_thread(swap, base_url, adapted, None)
                done("swap", asyncio.run(drive(base_url, model, held, args.bench_concurrency,
                                               args.bench_max_tokens, 0.0, during=swap_later())))
            if "bench_after" not in phases:
                done("bench_after", asyncio.run(drive(base_url, model, held, args.bench_concurrency,
                                                      args.bench_max_tokens, 0.0)))
    for name, draft in (("base", args.base_draft), ("adapted", adapted)):
        for label, prompts in (("heldout", heldout), ("mt_bench", args.mt_bench)):
            key = f"acceptance_{name}_{label}"
            if key in phases:
                continue
            res = out / f"{key}.json"
            with open(out / f"{key}.log", "w") as log:
                subprocess.check_call([sys.executable, "-m", "draftsmith.cli", "acceptance", "--recipe", args.recipe,
                                       "--target", args.target, "--draft", str(draft), "--prompts", str(prompts),
                                       "--max-new-tokens", "128", "--temperature", "0", "--out", str(res)],
                                      stdout=log, stderr=subprocess.STDOUT)
            r = json.loads(res.read_text())
            r = next(v for v in r.values() if isinstance(v, dict) and "mean_acceptance_length" in v)
            done(key, {k: r.get(k) for k in ("mean_acceptance_length", "per_position_acceptance", "num_prompts",
                                              "output_tokens")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
