"""``draftsmith spec-decode``: the reference speculative decoder (the command line of :mod:`draftsmith.eval.spec_decode`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..eval import spec_decode as sd
from ..layout import DraftLoadError
from ..runtime import DTYPE_AUTO_HELP, DTYPE_CHOICES, HelpFormatter, resolve_dtype
from ..target import DEVICE_HELP
from ..vllm_bridge.engine import add_vllm_arguments, vllm_config_from_args


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``eval/spec_decode.py`` (``draftsmith spec-decode``)."""
    p = argparse.ArgumentParser(description=sd.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", required=True, help="target dir, hub id or embedded:SmolLM2-135M-Instruct")
    p.add_argument("--draft", type=Path, required=True, help="exported draft directory (draftsmith export)")
    p.add_argument("--prompts", default="builtin:eval", help="prompt set: builtin:NAME or a JSONL file")
    p.add_argument("--max-prompts", type=int, help="use at most this many prompts (default: all)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="target sampling temperature (0: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"target and draft dtype, also vLLM's with --compare-vllm; {DTYPE_AUTO_HELP}, by --device")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; on a busy "
                   "machine 1 thread avoids waiting for cores)")
    p.add_argument("--draft-sampling", choices=["greedy", "probabilistic"], default="greedy",
                   help="at T>0: draft the argmax (vLLM's default draft_sample_method) or sample from the draft")
    p.add_argument("--no-plain", dest="plain", action="store_false", help="skip the plain-decoding baseline")
    p.add_argument("--compare-vllm", action="store_true",
                   help="also measure the EAGLE-3 draft with vLLM (draftsmith acceptance) on the same prompts")
    p.add_argument("--out", type=Path, help="write the figures as JSON")
    add_vllm_arguments(p, prefix="vllm-")  # --compare-vllm's engine; its dtype defaults to --dtype
    return p


def _format(name: str, r: dict[str, Any]) -> str:
    """One result line of ``draftsmith spec-decode`` (``name``: reference / vllm)."""
    if r.get("mean_acceptance_length") is None:
        return f"{name:<8} no drafts"
    pp = " / ".join(f"{p:.3f}" for p in r["per_position_acceptance"])
    line = (f"{name:<8} AL {r['mean_acceptance_length']:.3f}  acceptance rate {r['acceptance_rate']:.3f}  "
            f"per position {pp}  ({r['num_prompts']} prompts, {r['output_tokens']} tokens, "
            f"{r['output_tokens_per_s']:.1f} tok/s")
    if "plain_output_tokens_per_s" in r:
        line += (f"; plain {r['plain_output_tokens_per_s']:.1f} tok/s, speedup {r.get('speedup', 0):.2f}x, "
                 f"identical to plain {r['identical_to_plain']}/{r['num_prompts']}")
    return line + ")"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..target import default_device, load_target, resolve_target
    from ..recipe import RecipeError, VllmConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        engine = vllm_config_from_args(args, VllmConfig(dtype=dtype)) if args.compare_vllm else None
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        target_dir = resolve_target(args.target)
    except FileNotFoundError as exc:  # no such directory, or a Hub id the Hub does not serve here
        print(f"error: {exc}", file=sys.stderr)
        return 1
    model, tokenizer = load_target(target_dir, dtype=getattr(torch, dtype), device=device)
    try:
        proposer = sd.load_draft(args.draft, model)
    except DraftLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    proposer.model.to(model.device, getattr(torch, dtype))
    proposer.draft_sampling = args.draft_sampling
    prompts = sd.prompt_token_ids(tokenizer, args.prompts, args.max_prompts)
    results = {"reference": sd.evaluate(model, tokenizer, proposer, prompts, args.k, args.temperature,
                                        args.max_new_tokens, args.seed, args.plain)}
    print(_format("reference", results["reference"]), flush=True)
    if args.compare_vllm:
        from ..eval.acceptance import EXPORT_METHOD, measure

        # the export's own method (EAGLE-3, Medusa, DFlash, P-EAGLE), as the reference decoder loaded it
        results["vllm"] = measure(target_dir, args.prompts, EXPORT_METHOD, args.draft, args.k, args.temperature,
                                  args.max_new_tokens, args.max_prompts, args.seed, engine)
        print(_format("vllm", results["vllm"]), flush=True)
        same = sum(a == b for a, b in zip(results["reference"]["outputs"], results["vllm"]["outputs"]))
        results["identical_outputs_reference_vs_vllm"] = same
        print(f"identical outputs reference vs vLLM: {same}/{len(prompts)} prompts", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(
            {k: ({kk: vv for kk, vv in v.items() if kk != "outputs"} if isinstance(v, dict) else v)
             for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
