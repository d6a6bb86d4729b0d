"""``draftsmith synthesize``: target-written prompts (the command line of :mod:`draftsmith.data_prep.synthesize`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..data_prep import synthesize as syn
from ..recipe import RecipeError, load_recipe
from ..runtime import HelpFormatter, setup_logging
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``data_prep/synthesize.py`` (``draftsmith synthesize``)."""
    from ..target import DEVICE_HELP

    p = argparse.ArgumentParser(description=syn.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", default="embedded:SmolLM2-135M-Instruct",
                   help="target dir, hub id or embedded:SmolLM2-135M-Instruct (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, required=True, help="distinct user messages to keep")
    p.add_argument("--out", type=Path, required=True, help="output JSONL (one {id, prompt, source} per line)")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto",
                   help="auto: vLLM when installed, else transformers (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per sampled message (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per generation call (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--recipe", type=Path, help="recipe YAML whose vllm section gives the vLLM engine settings "
                   "(the vLLM flags override it)")
    add_vllm_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..target import load_target, resolve_target

    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        vllm_engine = vllm_config_from_args(args, load_recipe(args.recipe).vllm if args.recipe else None)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from ..data_prep.chat_engines import vllm_available

    try:
        target_dir = resolve_target(args.target)
    except FileNotFoundError as exc:  # no such directory, or a Hub id the Hub does not serve here
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(target_dir)
    prefix, end = syn.user_turn_prefix(tok)
    engine = args.engine if args.engine != "auto" else ("vllm" if vllm_available() else "transformers")
    if engine == "vllm":
        gen = syn.vllm_sampler(target_dir, prefix, end, args.temperature, args.max_tokens, args.seed, vllm_engine)
    else:
        torch.manual_seed(args.seed)
        model, tok = load_target(target_dir, device=args.device)
        gen = syn.transformers_sampler(model, tok, prefix, end, args.temperature, args.max_tokens)
    prompts, counts = syn.synthesize(gen, args.num_prompts, args.batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for i, text in enumerate(prompts):
            fh.write(json.dumps({"id": f"magpie-{i:06d}", "prompt": text, "source": "magpie"}, ensure_ascii=False) + "\n")
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
