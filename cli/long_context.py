"""``draftsmith long-context``: acceptance by context length in vLLM (the command line of :mod:`draftsmith.eval.long_context`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..eval import long_context as lc
from ..recipe import RecipeError, load_recipe
from ..runtime import HelpFormatter
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=lc.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    p.add_argument("--draft", type=Path, required=True, help="exported draft directory")
    p.add_argument("--recipe", type=Path, help="recipe YAML whose vllm section gives the engine settings")
    p.add_argument("--history", type=Path, required=True,
                   help="conversations with assistant replies (OpenAI messages JSONL) to build histories from")
    p.add_argument("--questions", required=True, help="final questions: a prompt file (MT-bench, prompts, messages)")
    p.add_argument("--buckets", default=",".join(map(str, lc.DEFAULT_BUCKETS)),
                   help="context lengths in tokens (each bucket's prompts are at most this long)")
    p.add_argument("--per-bucket", type=int, default=16, help="conversations per bucket")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per conversation")
    p.add_argument("--seed", type=int, default=0, help="history order and vLLM seed")
    p.add_argument("--out", type=Path, help="write the result (per-bucket counters and figures) as JSON")
    add_vllm_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from ..data_prep.conversations import load_records
    from ..eval.acceptance import measure

    args = build_parser().parse_args(argv)
    buckets = sorted(int(b) for b in args.buckets.split(","))
    try:
        engine = vllm_config_from_args(args, load_recipe(args.recipe).vllm if args.recipe else None)
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        window = getattr(tokenizer, "model_max_length", None)
        need = buckets[-1] + args.max_new_tokens
        engine = engine.model_copy(update={"max_model_len": max(engine.max_model_len or 0, need)})
        records, _ = load_records(args.questions)
        questions = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in records
                     if "messages" in r]
        groups = lc.build_long_conversations(lc.load_history(args.history), questions, tokenizer, buckets,
                                             args.per_bucket, args.seed)
        result = measure(args.target, str(args.questions), draft=args.draft, k=args.k, temperature=args.temperature,
                         max_new_tokens=args.max_new_tokens, seed=args.seed, engine=engine, groups=groups)
    except (RecipeError, lc.LongContextError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result.pop("outputs", None)
    result.update(buckets=buckets, history=str(args.history), target_window=window)
    print(lc.format_table(result, result["method"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

