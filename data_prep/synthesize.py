"""Target-synthesised prompts (Magpie: Xu et al., arXiv:2406.08464).

Give the target only its chat template's user-turn prefix (e.g. ``<|im_start|>user\\n``)
and sample: an instruction-tuned model writes a plausible user message and closes the turn.
The messages are filtered (length, end of turn reached, repetition) and deduplicated, then
go through the normal pipeline (regeneration of the replies by the target), so a draft can
be trained from the target alone.

    draftsmith synthesize --target embedded:SmolLM2-135M-Instruct \\
        --num-prompts 1000 --out runs/x/magpie.jsonl [--engine vllm|transformers] [--temperature 1.0]

The vLLM engine takes its settings from the vLLM flags (``--dtype``, ``--enforce-eager``,
``--gpu-memory-utilization``, ... see ``--help``) over ``--recipe``'s ``vllm`` over
:class:`draftsmith.recipe.VllmConfig`'s defaults (GPU values; on CPU use a CPU recipe such as
``recipes/smollm2_135m.yaml`` or the flags). The transformers engine runs on ``--device``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch

from ..recipe import RecipeError, VllmConfig, load_recipe
from ..vllm_bridge.engine import add_vllm_arguments, configure_vllm_env, llm_kwargs, vllm_config_from_args

log = logging.getLogger("draftsmith.synthesize")
_SENTINEL = "\x00DRAFTSMITH_USER_MESSAGE\x00"


class TemplateError(ValueError):
    """The chat template does not expose a user-turn prefix."""


def user_turn_prefix(tokenizer: Any) -> tuple[str, str]:
    """``(prefix, end_of_turn)``: the rendered text before a user message's content (system
    prompt included, as the template renders it) and the marker that closes the turn.

    Raises:
        TemplateError: the template does not render the message verbatim.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise TemplateError("the chat template does not render the user message verbatim")
    prefix, after = text.split(_SENTINEL, 1)
    end = after.strip()
    if not end:
        end = tokenizer.eos_token or ""
    return prefix, end


_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    return _WS.sub(" ", text.strip().lower())


def keep_prompt(text: str, finished: bool, min_chars: int = 12, max_chars: int = 2000) -> str | None:
    """Reason a sampled user message is dropped, or None to keep it: unfinished turns, too
    short/long, template markup leaking in, or degenerate repetition."""
    t = text.strip()
    if not finished:
        return "unfinished"
    if len(t) < min_chars:
        return "too_short"
    if len(t) > max_chars:
        return "too_long"
    if "<|" in t or "|>" in t:
        return "markup"
    words = t.split()
    if len(words) >= 8 and len(set(words)) / len(words) < 0.3:
        return "repetitive"
    return None


def synthesize(
    generate_fn, num_prompts: int, batch_size: int = 64, max_rounds: int = 20, progress: bool = True
) -> tuple[list[str], dict[str, int]]:
    """Sample until ``num_prompts`` distinct, filtered user messages exist (or ``max_rounds``).

    Args:
        generate_fn: ``(n) -> list[(text, finished)]``, n samples from the user-turn prefix.
        progress: a bar of the prompts kept so far (one update per sampling round).

    Returns:
        ``(prompts, counts)``: counts of ``sampled``, ``kept``, ``duplicate`` and each drop reason.
    """
    kept: list[str] = []
    seen: set[str] = set()
    counts: dict[str, int] = {"sampled": 0, "kept": 0, "duplicate": 0}
    from tqdm.auto import tqdm

    bar = tqdm(total=num_prompts, desc="synthesize", unit="prompt", disable=not progress)
    for _ in range(max_rounds):
        bar.update(len(kept) - bar.n)
        bar.set_postfix(sampled=counts["sampled"], refresh=False)
        if len(kept) >= num_prompts:
            break
        for text, finished in generate_fn(batch_size):
            counts["sampled"] += 1
            reason = keep_prompt(text, finished)
            if reason is None and normalise(text) in seen:
                reason = "duplicate"
            if reason:
                counts[reason] = counts.get(reason, 0) + 1
                continue
            seen.add(normalise(text))
            kept.append(text.strip())
            counts["kept"] += 1
            if len(kept) >= num_prompts:
                break
    bar.update(len(kept) - bar.n)
    bar.close()
    return kept, counts


def vllm_sampler(target_dir: Path, prefix: str, end: str, temperature: float, max_tokens: int, seed: int,
                 engine: VllmConfig | None = None):
    """``(n) -> list[(text, finished)]`` sampling ``n`` user turns from ``prefix`` with
    ``vllm.LLM`` built from ``engine`` (default ``VllmConfig()``).

    Raises:
        ValueError: engine settings the offline engine cannot run (``data_parallel_size > 1``).
    """

    engine = engine or VllmConfig()
    kwargs = llm_kwargs(engine, model=str(target_dir), seed=seed)
    configure_vllm_env(engine)
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, stop=[end] if end else None)

    def generate(n: int):
        outs = llm.generate([prefix] * n, params, use_tqdm=False)
        return [(o.outputs[0].text, o.outputs[0].finish_reason == "stop") for o in outs]

    return generate


def transformers_sampler(model: Any, tokenizer: Any, prefix: str, end: str, temperature: float, max_tokens: int):
    """``(n) -> list[(text, finished)]`` sampling ``n`` user turns from ``prefix`` with
    ``model.generate`` on the model's device (samples decoded on CPU)."""
    enc = tokenizer(prefix, return_tensors="pt", add_special_tokens=False).to(model.device)
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    stop = [end_ids[0]] if len(end_ids) == 1 else None  # single-token markers stop generation

    @torch.inference_mode()
    def generate(n: int):
        out = model.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=None,
                             max_new_tokens=max_tokens, num_return_sequences=n,
                             eos_token_id=stop or tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        res = []
        for row in out[:, enc["input_ids"].shape[1]:].cpu():
            text = tokenizer.decode(row, skip_special_tokens=False)
            finished = bool(end) and end in text
            text = text.split(end)[0] if end else text
            pad = tokenizer.pad_token
            res.append((text.replace(pad, "") if pad else text, finished))
        return res

    return generate


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``data_prep/synthesize.py`` (``draftsmith synthesize``)."""
    from ..cli import HelpFormatter
    from .target import DEVICE_HELP

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
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
    from ..cli import setup_logging
    from .target import load_target, resolve_target

    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        vllm_engine = vllm_config_from_args(args, load_recipe(args.recipe).vllm if args.recipe else None)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from .regenerate import vllm_available

    try:
        target_dir = resolve_target(args.target)
    except FileNotFoundError as exc:  # no such directory, or a Hub id the Hub does not serve here
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(target_dir)
    prefix, end = user_turn_prefix(tok)
    engine = args.engine if args.engine != "auto" else ("vllm" if vllm_available() else "transformers")
    if engine == "vllm":
        gen = vllm_sampler(target_dir, prefix, end, args.temperature, args.max_tokens, args.seed, vllm_engine)
    else:
        torch.manual_seed(args.seed)
        model, tok = load_target(target_dir, device=args.device)
        gen = transformers_sampler(model, tok, prefix, end, args.temperature, args.max_tokens)
    prompts, counts = synthesize(gen, args.num_prompts, args.batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for i, text in enumerate(prompts):
            fh.write(json.dumps({"id": f"magpie-{i:06d}", "prompt": text, "source": "magpie"}, ensure_ascii=False) + "\n")
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
