"""Regeneration throughput against vLLM's own offline throughput, and the demo's prepare time.

    python -m benchmarks.regenerate                       # every engine, one process each
    python -m benchmarks.regenerate --one server --concurrency 16
    python -m benchmarks.regenerate --demo-prepare --before-ref 16c8679

Engines (each in a fresh process, on the same prompts and settings):

- ``inprocess``: :class:`~draftsmith.data_prep.chat_engines.VllmChatEngine` (``vllm.LLM.chat``
  in batches of ``--batch-size``), the CPU default;
- ``server``: :class:`~draftsmith.data_prep.chat_engines.ServerChatEngine`, vLLM's OpenAI server
  with the async client at each of ``--concurrencies``, the GPU default;
- ``vllm-offline``: vLLM's own ``bench throughput`` (``vllm.benchmarks.throughput``, offline
  ``LLM.generate``, ``ignore_eos``) on the same chat-templated prompts with each request's
  output length set to the number of tokens the in-process engine generated for it: the same
  work with nothing of ours around it, i.e. the practical limit.

Defaults: 48 prompts of ``builtin:train``, the embedded SmolLM2-135M-Instruct, max_new_tokens
256, T=0, the SmolLM2 recipe's ``vllm`` section. Prints one JSON line per engine: ``wall_s``
(engine start to shutdown), ``engine_start_s``, ``generate_s`` (first request to last reply),
``output_tokens`` (counted with the target's tokenizer) and ``output_tok_s`` = output tokens /
``generate_s`` (vLLM's ``bench throughput`` times the same span); then ``vs_vllm_offline``, each
engine's output tok/s over vLLM's.

``--demo-prepare`` times ``python -m draftsmith.cli.prepare`` on the demo recipe
(``recipes/smollm2_135m.yaml``, all stages, a fresh run directory) with this checkout's code
and, with ``--before-ref REF``, with the code of git ``REF`` (a temporary worktree; its own
recipe), one after the other.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from benchmarks import subprocess_env

REPO = Path(__file__).resolve().parents[1]
DEMO_RECIPE = "recipes/smollm2_135m.yaml"


def _load(args):
    from transformers import AutoTokenizer

    from draftsmith import target as tgt
    from draftsmith.data_prep import conversations as conv
    from draftsmith.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    target = tgt.resolve_target(args.target)
    records, _ = conv.load_records(args.prompts, max_rows=args.n)
    return recipe, target, records, AutoTokenizer.from_pretrained(target)


def reply_tokens(tok, rows: list[dict]) -> list[int]:
    """Tokens of each row's assistant turns (the target's tokenizer, no special tokens)."""
    return [sum(len(tok(m["content"], add_special_tokens=False)["input_ids"]) for m in r["messages"]
                if m["role"] == "assistant") for r in rows]


def run_engine(args) -> dict:
    """One of our engines through :func:`~draftsmith.data_prep.regenerate.regenerate`, timed
    around the engine's start and close; writes the replies to ``--replies`` when given."""
    from draftsmith.data_prep import chat_engines, regenerate as regen

    recipe, target, records, tok = _load(args)
    marks: dict[str, float] = {}

    def make():
        marks["start"] = time.perf_counter()
        if args.one == "inprocess":
            engine = chat_engines.VllmChatEngine(target, recipe.seed, recipe.vllm)
        else:
            engine = chat_engines.ServerChatEngine(target, recipe.seed, recipe.vllm, concurrency=args.concurrency,
                                                   log_path=Path(tmp) / "server.log")
        marks["ready"] = time.perf_counter()
        close = engine.close

        def timed_close():
            marks["generated"] = time.perf_counter()
            close()
            marks["closed"] = time.perf_counter()

        engine.close = timed_close
        return engine

    with tempfile.TemporaryDirectory() as tmp:
        out = regen.regenerate(records, Path(tmp) / "regen.jsonl", make, [0.0], args.max_new_tokens,
                               batch_size=args.batch_size, progress=False)
    if args.replies:
        args.replies.write_text("".join(json.dumps(r) + "\n" for r in out))
    n_tok = sum(reply_tokens(tok, out))
    gen_s = marks["generated"] - marks["ready"]
    return {"engine": args.one, "concurrency": args.concurrency if args.one == "server" else None,
            "batch_size": args.batch_size if args.one == "inprocess" else None, "prompts": len(out),
            "max_new_tokens": args.max_new_tokens, "wall_s": round(marks["closed"] - marks["start"], 1),
            "engine_start_s": round(marks["ready"] - marks["start"], 1), "generate_s": round(gen_s, 1),
            "output_tokens": n_tok, "output_tok_s": round(n_tok / gen_s, 1)}


def run_vllm_offline(args) -> dict:
    """vLLM's ``bench throughput`` on the first user turn of each row of ``--replies`` with the
    output length its reply had (ShareGPT layout: prompt = the chat-templated turn); vLLM's
    dataset loader drops rows with fewer than 4 prompt or output tokens (``prompts`` says how
    many ran)."""
    from draftsmith.data_prep.regenerate import prompt_turns
    from draftsmith.vllm_bridge.engine import configure_vllm_env, server_args

    recipe, target, _, tok = _load(args)
    rows = [json.loads(line) for line in args.replies.read_text().splitlines()]
    sharegpt = []
    for r in rows:
        turns = prompt_turns(r["messages"])
        first = turns[: next(i for i, m in enumerate(turns) if m["role"] == "user") + 1]
        reply = next(m["content"] for m in r["messages"] if m["role"] == "assistant")
        prompt = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        sharegpt.append({"id": r["id"], "conversations": [{"from": "human", "value": prompt},
                                                           {"from": "gpt", "value": reply}]})
    configure_vllm_env(recipe.vllm)
    from vllm.benchmarks.throughput import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "sharegpt.json"
        data.write_text(json.dumps(sharegpt))
        argv = ["--backend", "vllm", "--model", str(target), "--dataset-name", "sharegpt", "--dataset-path", str(data),
                "--num-prompts", str(len(sharegpt)), "--output-json", str(Path(tmp) / "r.json"),
                *server_args(recipe.vllm, seed=recipe.seed)]
        parser = FlexibleArgumentParser(description="vllm bench throughput")
        add_cli_args(parser)
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(parser.parse_args(argv))
        printed = buf.getvalue()
        result = json.loads((Path(tmp) / "r.json").read_text())
    sys.stderr.write(printed)
    out_tok = int(re.search(r"Total num output tokens:\s+(\d+)", printed).group(1))
    return {"engine": "vllm-offline", "prompts": result["num_requests"], "max_new_tokens": args.max_new_tokens,
            "generate_s": round(result["elapsed_time"], 1), "output_tokens": out_tok,
            "output_tok_s": round(out_tok / result["elapsed_time"], 1)}


def demo_prepare(ref: str | None) -> dict:
    """Wall time of the demo recipe's prepare stage (all stages, fresh run directory) with this
    checkout's code, or with git ``ref``'s code and recipe in a temporary worktree.

    Raises:
        RuntimeError: ``ref`` given outside a git checkout, or the prepare run failed (log tail).
    """
    with tempfile.TemporaryDirectory() as tmp:
        env, src = dict(os.environ), REPO
        if ref:
            src = Path(tmp) / "src"
            made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(src), ref],
                                  capture_output=True, text=True)
            if made.returncode:
                raise RuntimeError(f"--before-ref {ref}: git worktree add failed: {made.stderr.strip()}")
            (Path(tmp) / "pkg").mkdir()
            (Path(tmp) / "pkg" / "draftsmith").symlink_to(src)  # the old code is imported as draftsmith
            env["PYTHONPATH"] = str(Path(tmp) / "pkg")
        try:
            log = Path(tmp) / "prepare.log"
            t0 = time.perf_counter()
            with log.open("w") as fh:
                proc = subprocess.run([sys.executable, "-m", "draftsmith.cli.prepare", str(src / DEMO_RECIPE),
                                       "--run-dir", str(Path(tmp) / "run")], cwd=tmp, env=env, stdout=fh,
                                      stderr=subprocess.STDOUT)
            wall = time.perf_counter() - t0
            if proc.returncode:
                raise RuntimeError(f"prepare ({ref or 'this checkout'}) failed:\n{log.read_text()[-3000:]}")
            summary = json.loads((Path(tmp) / "run" / "data" / "summary.json").read_text())
        finally:
            if ref:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(src)], capture_output=True)
    return {"demo_prepare": ref or "this checkout", "wall_s": round(wall, 1),
            "stages": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in summary.items()}}


def main(argv: list[str] | None = None) -> int:
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--one", choices=["inprocess", "server", "vllm-offline"], help="run one engine in this process")
    p.add_argument("--concurrency", type=int, default=16, help="server: requests in flight")
    p.add_argument("--concurrencies", default="16,48", help="server concurrencies to run (all engines)")
    p.add_argument("--batch-size", type=int, default=128, help="inprocess: conversations per LLM.chat call")
    p.add_argument("--n", type=int, default=48, help="prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts", default="builtin:train")
    p.add_argument("--target", default="embedded:SmolLM2-135M-Instruct")
    p.add_argument("--recipe", default=str(REPO / DEMO_RECIPE), help="its vllm section configures every engine")
    p.add_argument("--replies", type=Path, help="inprocess: write the replies here; vllm-offline: read them")
    p.add_argument("--demo-prepare", action="store_true", help="time the demo's prepare stage instead")
    p.add_argument("--before-ref", help="with --demo-prepare: also time git REF's code first")
    p.add_argument("--out", type=Path, help="append the JSON lines to this file too")
    args = p.parse_args(argv)

    def emit(line: str) -> None:
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(line + "\n")

    if args.demo_prepare:
        for ref in ([args.before_ref] if args.before_ref else []) + [None]:
            emit(json.dumps(demo_prepare(ref)))
        return 0
    if args.one:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        result = run_vllm_offline(args) if args.one == "vllm-offline" else run_engine(args)
        print(json.dumps(result), flush=True)
        return 0
    common = ["--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--prompts", args.prompts,
              "--target", args.target, "--recipe", args.recipe, "--batch-size", str(args.batch_size)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        replies = str(Path(tmp) / "replies.jsonl")
        runs = ([["--one", "inprocess", "--replies", replies], ["--one", "vllm-offline", "--replies", replies]]
                + [["--one", "server", "--concurrency", c] for c in args.concurrencies.split(",")])
        for extra in runs:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.regenerate", *extra, *common],
                                  capture_output=True, text=True, env=subprocess_env())
            if proc.returncode == 0 and proc.stdout.strip():
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                emit(json.dumps(results[-1]))
            else:
                emit(json.dumps({"run": extra, "error": proc.stderr[-2000:]}))
    limit = next((r["output_tok_s"] for r in results if r["engine"] == "vllm-offline"), None)
    if limit:
        emit(json.dumps({"vs_vllm_offline": {
            f"{r['engine']}" + (f"@c{r['concurrency']}" if r.get("concurrency") else ""): round(r["output_tok_s"] / limit, 2)
            for r in results if r["engine"] != "vllm-offline"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
