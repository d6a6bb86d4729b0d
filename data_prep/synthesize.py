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

import logging
import re
from pathlib import Path
from typing import Any

import torch

from ..recipe import VllmConfig
from ..vllm_bridge.engine import configure_vllm_env, llm_kwargs

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
