"""Regeneration throughput: in-process ``vllm.LLM`` against the vLLM OpenAI server with the
async client (:class:`draftsmith.data_prep.regenerate.ServerChatEngine`), engine start included.

    .venv/bin/python -m draftsmith.scripts.bench_regenerate            # every configuration, one process each
    .venv/bin/python -m draftsmith.scripts.bench_regenerate --one server --concurrency 16

Defaults: 48 prompts of builtin:train, SmolLM2-135M-Instruct, max_new_tokens 256, T=0, the
CPU recipe's ``vllm`` section (recipes/smollm2_135m.yaml: float32, enforce_eager, 4 GiB KV
cache). Prints one JSON line per configuration (wall seconds from engine start to engine
shutdown, output tokens counted with the target's tokenizer, output tok/s).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_one(args) -> dict:
    from transformers import AutoTokenizer

    from draftsmith.data_prep import conversations as conv, regenerate as regen, target as tgt
    from draftsmith.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    target = tgt.resolve_target(args.target)
    records, _ = conv.load_records(args.prompts, max_rows=args.n)
    tok = AutoTokenizer.from_pretrained(target)
    with tempfile.TemporaryDirectory() as tmp:
        if args.one == "inprocess":
            make = lambda: regen.VllmChatEngine(target, recipe.seed, recipe.vllm)  # noqa: E731
        else:
            make = lambda: regen.ServerChatEngine(target, recipe.seed, recipe.vllm,  # noqa: E731
                                                  concurrency=args.concurrency, log_path=Path(tmp) / "server.log")
        t0 = time.perf_counter()
        out = regen.regenerate(records, Path(tmp) / "regen.jsonl", make, [0.0], args.max_new_tokens,
                               batch_size=args.batch_size, progress=False)
        wall = time.perf_counter() - t0
    n_tok = sum(len(tok(m["content"], add_special_tokens=False)["input_ids"])
                for r in out for m in r["messages"] if m["role"] == "assistant")
    return {"engine": args.one, "concurrency": args.concurrency if args.one == "server" else None,
            "batch_size": args.batch_size if args.one == "inprocess" else None,
            "prompts": len(out), "max_new_tokens": args.max_new_tokens, "wall_s": round(wall, 1),
            "output_tokens": n_tok, "output_tok_s": round(n_tok / wall, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", choices=["inprocess", "server"], help="run one configuration in this process")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--concurrencies", default="16,32", help="server concurrencies to run (all configurations)")
    p.add_argument("--batch-size", type=int, default=128, help="in-process: conversations per LLM.chat call")
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts", default="builtin:train")
    p.add_argument("--target", default="embedded:SmolLM2-135M-Instruct")
    p.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2_135m.yaml"))
    p.add_argument("--out", type=Path, help="append the JSON lines to this file too")
    args = p.parse_args(argv)
    if args.one:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        print(json.dumps(run_one(args)), flush=True)
        return 0
    common = ["--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--prompts", args.prompts,
              "--target", args.target, "--recipe", args.recipe, "--batch-size", str(args.batch_size)]
    runs = [["--one", "inprocess"]] + [["--one", "server", "--concurrency", c] for c in args.concurrencies.split(",")]
    for extra in runs:
        proc = subprocess.run([sys.executable, "-m", "draftsmith.scripts.bench_regenerate", *extra, *common],
                              capture_output=True, text=True)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else \
            json.dumps({"run": extra, "error": proc.stderr[-2000:]})
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
