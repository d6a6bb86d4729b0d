"""Reference speculative decoder: acceptance of EAGLE-3, Medusa, MLP-speculator, DFlash and
P-EAGLE drafts without vLLM (docs/conventions.md, "Acceptance metrics").

    draftsmith spec-decode --target DIR --draft DIR --prompts FILE [--k 3]
        [--temperature 0] [--max-new-tokens N] [--max-prompts N] [--out result.json] [--compare-vllm]
        [--threads N] [--no-plain] [--draft-sampling greedy|probabilistic] [--device cuda:0]
        [--vllm-enforce-eager --vllm-gpu-memory-utilization 0.2 ...]   # --compare-vllm's engine

The target and the draft run on ``--device`` (default: this process's accelerator);
``--dtype auto`` (the default) is bfloat16 on a CUDA device and float32 on the CPU
(:func:`draftsmith.runtime.resolve_dtype`); ``--compare-vllm`` runs vLLM at that dtype with
the ``--vllm-*`` engine settings (:class:`draftsmith.recipe.VllmConfig`; its defaults are GPU
values).

Chain speculative decoding, batch size 1 (prompts one at a time), on a transformers target
with a KV cache. Each round:

1. the draft proposes K tokens ``d_1..d_K`` after the last committed token ``x_m``;
2. the target runs ONE forward pass over ``[x_m, d_1, ..., d_K]`` on its KV cache, giving
   the K+1 next-token distributions ``p_1..p_{K+1}`` and the hidden states the draft reads
   next round;
3. acceptance: at temperature 0, ``d_i`` is accepted while it equals ``argmax p_i``; at
   T > 0, lossless rejection sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al.
   2023, arXiv:2302.01318): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``,
   on the first rejection sample from ``norm(max(0, p_i - q_i))``; when all K are accepted
   sample a bonus token from ``p_{K+1}``;
4. the target's cache is cut back to the committed tokens (rejected drafts dropped): attention
   layers are cropped, sliding-window layers too (they record their past for it), and the
   recurrent state of linear-attention layers (Gated DeltaNet), which cannot be cropped, is
   restored and recomputed over the kept tokens (:mod:`draftsmith.eval.target_cache`).

The output is therefore exactly the target's greedy output at T=0 and distributed as the
target's samples at T>0, whatever the draft. Counters follow vLLM's spec-decode metrics
(drafts, draft tokens, accepted tokens, accepted per position) and are summarised with
:func:`draftsmith.eval.acceptance.summarise`: acceptance rate, mean acceptance length
``1 + accepted / drafts`` and per-position rates.

Draft proposers (one per draft type, all behind :class:`Proposer`, each in its method's package,
``models/<name>/proposer.py``, found through :mod:`draftsmith.methods`):

- EAGLE-3 (:class:`~draftsmith.models.eagle3.proposer.Eagle3Proposer`): reads the target's aux hidden states (vLLM convention,
  docs/conventions.md, "Aux layer ids"; captured with the same pre-hooks as training,
  :class:`draftsmith.target.capture.AuxHiddenStateCapture`) and keeps its own KV
  cache: step-0 keys of committed positions persist, the keys of the chained steps are
  dropped after each proposal (vLLM overwrites those slots the same way).
- Medusa (:class:`~draftsmith.models.medusa.proposer.MedusaProposer`): head k at the last committed position t proposes
  ``x_{t+k+2}`` from the target's final (normed) hidden state.
- MLP speculator (:class:`~draftsmith.models.mlp_speculator.proposer.MLPSpeculatorProposer`): stage 0 reads the final hidden state at t
  and the token ``x_{t+1}``, stage i the state and token chosen at stage i-1.
- DFlash and P-EAGLE (block drafting, their own modules :mod:`draftsmith.models.dflash.proposer` and
  :mod:`draftsmith.models.peagle.proposer`): all K tokens in one draft forward over the pending token and
  K mask slots (DFlash: bidirectional block over the cached context; P-EAGLE: causal, after
  the cached depth-0 keys), the way vLLM runs them.

At T>0 a proposer either samples its draft tokens from its own (temperature-scaled)
distribution q (``draft_sampling="probabilistic"``), or drafts the argmax and verifies it as
a one-hot q (``"greedy"``, vLLM's default ``draft_sample_method`` and this CLI's default, so
``--compare-vllm`` compares like with like). EAGLE-3's q lives on the draft vocab and is
mapped to target ids with ``d2t`` (zero outside the draft vocab).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..target.capture import AuxHiddenStateCapture, decoder_layers
from ..target.facts import text_config
from .target_cache import crop_attention, new_target_cache, rollback, snapshot_linear_states
from ..layout import DraftLoadError, ExportError
from ..layout import read_export_config as _read_config
from ..methods import UnknownMethodError, method_of_export

# --------------------------------------------------------------------------------------
# Token choice and verification


@dataclass
class Proposal:
    """K drafted tokens (target ids) and, at T>0, the distributions they were sampled from.

    Attributes:
        token_ids: ``(K,)`` int64 target token ids.
        probs: ``(K, V)`` float32 draft distributions q over the target vocab, or None at
            temperature 0 (greedy acceptance needs no q).
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Pick one token from ``(V,)`` logits: argmax at T=0, else a sample of
    ``softmax(logits / T)``. Returns ``(token id, probs (V,) float32 or None at T=0)``."""
    if temperature <= 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def verify(proposal: Proposal, target_logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> tuple[int, int]:
    """Accept a prefix of the proposal against the target.

    Args:
        proposal: K draft tokens (and q at T>0).
        target_logits: ``(K+1, V)`` target logits at ``[x_m, d_1, ..., d_K]``: row i is the
            target's distribution for the token after ``d_i`` (row 0: after ``x_m``).
        temperature: 0 = greedy acceptance; > 0 = rejection sampling at this temperature.
        generator: RNG for the acceptance tests and the resampled token.

    Returns:
        ``(num_accepted, next_token)``: the first ``num_accepted`` drafts are kept and
        ``next_token`` follows them (the target's correction, or the bonus token when all
        K were accepted).
    """
    draft = proposal.token_ids.tolist()
    K = len(draft)
    if temperature <= 0:
        greedy = target_logits.argmax(dim=-1).tolist()  # (K+1,)
        n = 0
        while n < K and draft[n] == greedy[n]:
            n += 1
        return n, greedy[n]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # (K+1, V)
    q = proposal.probs
    if q is None:
        raise ValueError("rejection sampling at temperature > 0 needs the draft distributions q")
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if qx > 0 and u < min(1.0, px / qx):
            continue
        residual = (p[i] - q[i]).clamp_min(0)  # (V,)
        total = float(residual.sum())
        # residual == 0 only when p == q, where a rejection has probability 0; rounding can
        # still get here, and then p itself is the right distribution.
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return K, int(torch.multinomial(p[K], 1, generator=generator))


# --------------------------------------------------------------------------------------
# Target


class Target:
    """A transformers causal LM run incrementally on a KV cache, returning what the draft
    reads: the aux hidden states (EAGLE-3) or the final normed hidden state (Medusa, MLP).

    Args:
        model: the target, e.g. from :func:`draftsmith.target.load_target`.
        aux_layer_ids: ids whose decoder-layer *inputs* are captured (vLLM convention);
            None when the draft reads the final hidden state.
    """

    def __init__(self, model: Any, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else None
        self.device = next(model.parameters()).device

    def new_cache(self) -> Any:
        """A cache for :meth:`forward` (:func:`draftsmith.eval.target_cache.new_target_cache`: sliding
        windows recording their past, so a rejected suffix can be cropped)."""
        return new_target_cache(self.model.config)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """``(T, V)`` float32 logits of final normed states ``(T, H)``: the ``lm_head``, then the
        target's ``final_logit_softcapping`` ``c`` when it has one (Gemma: ``c * tanh(z / c)``, as
        its ``forward`` does; the argmax is unchanged, the distributions sampled at T > 0 are not)."""
        logits = self.model.lm_head(final).float()
        cap = getattr(text_config(self.model.config), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.no_grad()
    def extend(self, token_ids: torch.Tensor, cache: Any) -> None:
        """Run the base model over ``(T,)`` tokens on ``cache`` (no capture, no logits): the
        recomputation of :func:`draftsmith.eval.target_cache.rollback`."""
        self.base(input_ids=token_ids.to(self.device).unsqueeze(0), past_key_values=cache, use_cache=True)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, cache: Any, last_logits_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the cache by ``(T,)`` tokens.

        Args:
            last_logits_only: compute logits for the last position only (a prefill needs no
                more; ``T x V`` logits of a long prompt are large for 200k vocabularies).

        Returns:
            ``(logits (T or 1, V) float32, states (T, D))`` where states are ``cat(h[L0],
            h[L1], h[L2])`` (D = 3H) with aux ids, else the final normed hidden state (D = H).
        """
        ids = token_ids.to(self.device).unsqueeze(0)  # (1, T)
        if self.aux_layer_ids is None:
            final = self.base(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            states = final[0]
        else:
            with AuxHiddenStateCapture(self.model, self.aux_layer_ids) as cap:
                final = self.base(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            states = torch.cat([cap.captured[L][0] for L in self.aux_layer_ids], dim=-1)  # (T, 3H)
        final = final[0, -1:] if last_logits_only else final[0]
        return self.logits(final), states


def crop_cache(cache: Any, length: int) -> None:
    """Drop cached positions past ``length`` in every attention layer
    (:func:`draftsmith.eval.target_cache.crop_attention`; linear-attention states need
    :func:`~draftsmith.eval.target_cache.rollback`)."""
    crop_attention(cache, length)


# --------------------------------------------------------------------------------------
# Proposers


class Proposer(ABC):
    """One draft type. Per prompt: :meth:`reset`, then one :meth:`propose` per round.

    ``propose`` receives the target states of the positions committed since the previous
    call: ``states (n, D)`` at positions t and ``next_tokens (n,)`` = ``x_{t+1}`` (the last of
    them is the pending token the target has not processed yet). It returns K drafts for the
    positions after the pending token.
    """

    #: the draft network.
    model: torch.nn.Module
    #: aux layer ids the target must capture, or None for the final normed hidden state.
    aux_layer_ids: list[int] | None = None
    #: the most tokens this draft can propose per round (heads / stages), None = unbounded.
    max_k: int | None = None
    #: at T > 0: "probabilistic" samples each draft token from q = softmax(logits / T);
    #: "greedy" drafts the argmax and verifies it as a one-hot q (accepted with probability
    #: p(d)), which is vLLM's default ``draft_sample_method``. Both are lossless.
    draft_sampling: str = "probabilistic"

    def reset(self) -> None:
        """Forget the previous prompt."""

    @abstractmethod
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """Draft ``k`` tokens after the pending token.

        Args:
            states: ``(n, D)`` target states of the newly committed positions (D = 3H aux
                states for EAGLE-3, H final normed states otherwise).
            next_tokens: ``(n,)`` the token after each of those positions.
            k: tokens to draft.
            temperature: 0 = each draft token is the argmax; > 0 = sampled from
                ``softmax(logits / T)``, returned as ``Proposal.probs`` over the target vocab.
            generator: RNG for the samples.
        """

    def _chain(self, logits_fn, k: int, temperature: float, generator: torch.Generator | None) -> Proposal:
        """Run ``logits_fn(i, previous token) -> (V,) logits`` for i < k, choosing each token
        (see :attr:`draft_sampling`)."""
        ids, probs, prev = [], [], None
        for i in range(k):
            logits = logits_fn(i, prev)
            if temperature > 0 and self.draft_sampling == "greedy":
                tok = int(logits.argmax())
                q = F.one_hot(torch.tensor(tok, device=logits.device), logits.shape[-1]).float()
            else:
                tok, q = choose(logits, temperature, generator)
            ids.append(tok)
            probs.append(q)
            prev = tok
        return Proposal(torch.tensor(ids), torch.stack(probs) if temperature > 0 else None)


def to_target_vocab(proposal: Proposal, d2t: torch.Tensor, vocab_size: int) -> Proposal:
    """``proposal`` of a draft-vocab draft with its token ids mapped to target ids
    (``id + d2t[id]``) and its ``probs (k, Vd)`` scattered to ``(k, vocab_size)`` (zero outside
    the draft vocab); in place, returned."""
    device = d2t.device
    draft_ids = proposal.token_ids.to(device)
    proposal.token_ids = (draft_ids + d2t[draft_ids]).cpu()
    if proposal.probs is not None:
        q = torch.zeros(proposal.probs.shape[0], vocab_size, device=device)
        q[:, torch.arange(len(d2t), device=device) + d2t] = proposal.probs.to(device)
        proposal.probs = q
    return proposal


# --------------------------------------------------------------------------------------
# Decoding loops


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: one draft = one verification round of K tokens."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.per_pos:
            self.per_pos = [0] * self.k

    def record(self, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += self.k
        self.accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.per_pos[i] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "per_pos": list(self.per_pos)}


def _finished(out: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    return len(out) >= max_new_tokens or any(t in stop_ids for t in out)


def _truncate(out: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Cut after the first stop token (kept, as vLLM and ``generate`` return it) and at the
    token budget."""
    for i, t in enumerate(out):
        if t in stop_ids:
            out = out[: i + 1]
            break
    return out[:max_new_tokens]


@torch.no_grad()
def speculative_generate(target: Target, proposer: Proposer, prompt_ids: list[int], k: int = 3,
                         temperature: float = 0.0, max_new_tokens: int = 256, stop_ids: set[int] | None = None,
                         generator: torch.Generator | None = None,
                         counters: SpecCounters | None = None, rejections: list[int] | None = None) -> list[int]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` by chain speculative
    decoding (module docstring); ``counters`` (if given) accumulate vLLM's figures;
    ``rejections`` (if given) gets the index in the output of each token the target put in place
    of a rejected draft token (the round's correction; a bonus token after K accepted is not one;
    indices past the returned tokens' end may follow a stop token and are to be ignored).

    Returns:
        the generated token ids (stop token included when reached).

    Raises:
        ValueError: ``k`` < 1 or more than the draft's heads / stages.
    """
    if k < 1 or (proposer.max_k is not None and k > proposer.max_k):
        raise ValueError(f"k={k} must be in [1, {proposer.max_k}] for this draft")
    if target.aux_layer_ids != proposer.aux_layer_ids:
        raise ValueError(f"target captures aux layers {target.aux_layer_ids}, draft reads {proposer.aux_layer_ids}")
    stop_ids = stop_ids or set()
    proposer.reset()
    cache = target.new_cache()
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    logits, states = target.forward(prompt, cache, last_logits_only=True)
    first, _ = choose(logits[-1], temperature, generator)
    out = [first]
    next_tokens = torch.cat([prompt[1:], torch.tensor([first])])  # x_{t+1} for each state row
    while not _finished(out, max_new_tokens, stop_ids):
        proposal = proposer.propose(states, next_tokens, k, temperature, generator)
        committed = cache.get_seq_length()
        fed = torch.cat([torch.tensor([out[-1]]), proposal.token_ids])  # pending token + drafts
        saved = snapshot_linear_states(cache)  # None without linear-attention layers
        logits, states = target.forward(fed, cache)
        n, nxt = verify(proposal, logits, temperature, generator)
        if counters is not None:
            counters.record(n)
        rollback(cache, committed, fed[: n + 1], saved, target.extend)  # pending token + accepted drafts
        if rejections is not None and n < k:
            rejections.append(len(out) + n)
        states = states[: n + 1]
        next_tokens = torch.cat([proposal.token_ids[:n], torch.tensor([nxt])])
        out.extend(proposal.token_ids[:n].tolist() + [nxt])
    return _truncate(out, max_new_tokens, stop_ids)


@torch.no_grad()
def plain_generate(target: Target, prompt_ids: list[int], temperature: float = 0.0, max_new_tokens: int = 256,
                   stop_ids: set[int] | None = None, generator: torch.Generator | None = None) -> list[int]:
    """The baseline: the same target, one token per forward pass on a KV cache (argmax at
    T=0, a sample of ``softmax(logits / T)`` otherwise)."""
    stop_ids = stop_ids or set()
    cache = target.new_cache()
    logits, _ = target.forward(torch.tensor(prompt_ids, dtype=torch.long), cache, last_logits_only=True)
    out = [choose(logits[-1], temperature, generator)[0]]
    while not _finished(out, max_new_tokens, stop_ids):
        logits, _ = target.forward(torch.tensor([out[-1]]), cache)
        crop_cache(cache, cache.get_seq_length())  # trims sliding windows back to W - 1 positions
        out.append(choose(logits[-1], temperature, generator)[0])
    return _truncate(out, max_new_tokens, stop_ids)


# --------------------------------------------------------------------------------------
# Loading exported drafts


def check_aux_layers(path: Path, aux_layer_ids: list[int], target_model: Any, lowest: int = 0) -> None:
    """Refuse a draft (export folder ``path``) reading aux layer ids the target has no decoder
    layer for (``lowest``: the smallest id the format allows).

    Raises:
        DraftLoadError: naming the ids and the target's layer count.
    """
    n_layers = len(decoder_layers(target_model))
    if not all(lowest <= L < n_layers for L in aux_layer_ids):
        raise DraftLoadError(f"{Path(path) / 'config.json'}: aux layer ids {aux_layer_ids} out of "
                             f"range for a target with {n_layers} decoder layers")


def head_export(loader: Any, path: Path) -> Any:
    """``loader(path)`` of a draft of heads that shares nothing with the target (Medusa, MLP
    speculator), without gradients.

    Raises:
        DraftLoadError: the folder does not load (the loader's ExportError / KeyError).
    """
    try:
        return loader(path).requires_grad_(False)
    except (ExportError, KeyError) as exc:
        raise DraftLoadError(f"{path}: {exc}") from exc


def load_draft(path: Path, target_model: Any | None = None) -> Proposer:
    """The proposer for an exported draft folder: the proposer factory of the method
    (:mod:`draftsmith.methods`) whose exports its ``config.json`` matches.

    Args:
        path: an exported draft folder: EAGLE-3 (speculators or legacy), Medusa (vLLM
            ``model_type "medusa"``), MLP speculator (``model_type "mlp_speculator"``), DFlash
            or P-EAGLE (speculators ``dflash`` / ``peagle``).
        target_model: the target, whose input embedding EAGLE-3, DFlash and P-EAGLE share.

    Raises:
        DraftLoadError: unknown format, a folder that does not load, or (EAGLE-3) aux layer
            ids the target does not have.
    """
    path = Path(path)
    cfg = _read_config(path)
    try:
        spec = method_of_export(cfg)
    except UnknownMethodError as exc:
        raise DraftLoadError(f"{path / 'config.json'}: unknown draft format ({exc})") from None
    return spec.proposer_factory(path, target_model)


# --------------------------------------------------------------------------------------
# Evaluation over a prompt set


def prompt_token_ids(tokenizer: Any, prompts: str, max_prompts: int | None = None) -> list[list[int]]:
    """Prompts through :func:`draftsmith.data_prep.conversations.load_records` (the loaders
    ``eval/acceptance.py`` uses; MT-bench keeps its first turn), assistant turns dropped,
    rendered with the target's chat template and a generation prompt."""
    from ..data_prep.conversations import load_records

    records, _ = load_records(prompts, max_rows=max_prompts)
    out = []
    for r in records:
        if "messages" not in r:
            continue
        conv = [m for m in r["messages"] if m["role"] != "assistant"]
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids of the tokenizer and the generation config (an int or a list)."""
    ids = set()
    for v in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif v:
            ids.update(int(x) for x in v)
    return ids


def evaluate(model: Any, tokenizer: Any, proposer: Proposer, prompts: list[list[int]], k: int = 3,
             temperature: float = 0.0, max_new_tokens: int = 256, seed: int = 0, plain: bool = True,
             progress: bool = True) -> dict[str, Any]:
    """Speculative (and, with ``plain``, plain) decoding of every prompt, one at a time (a
    progress bar over the prompts unless ``progress`` is False).

    Returns:
        :func:`draftsmith.eval.acceptance.summarise` figures plus ``counters``, output token
        counts, wall-clock seconds and tokens/s of both, ``speedup`` (speculative over plain
        tokens/s), ``identical_to_plain`` (prompts whose outputs match; at T=0 all must),
        and the ``outputs`` (token ids per prompt).
    """
    from .acceptance import summarise

    target = Target(model, proposer.aux_layer_ids)
    stops = stop_token_ids(model, tokenizer)
    counters = SpecCounters(k)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    t0 = time.perf_counter()
    from tqdm.auto import tqdm

    outputs = [speculative_generate(target, proposer, p, k, temperature, max_new_tokens, stops, generator, counters)
               for p in tqdm(prompts, desc="speculative decode", unit="prompt", disable=not progress)]
    spec_s = time.perf_counter() - t0
    n_spec = sum(len(o) for o in outputs)
    result: dict[str, Any] = {
        "num_speculative_tokens": k, "temperature": temperature, "num_prompts": len(prompts),
        "output_tokens": n_spec, "generate_seconds": spec_s, "output_tokens_per_s": n_spec / spec_s if spec_s else None,
        "counters": counters.as_dict(), **summarise(counters.as_dict(), k),
    }
    if plain:
        plain_target = Target(model)
        generator = torch.Generator(device=target.device).manual_seed(seed)
        t0 = time.perf_counter()
        plain_outputs = [plain_generate(plain_target, p, temperature, max_new_tokens, stops, generator)
                         for p in tqdm(prompts, desc="plain decode", unit="prompt", disable=not progress)]
        plain_s = time.perf_counter() - t0
        n_plain = sum(len(o) for o in plain_outputs)
        result.update({
            "plain_output_tokens": n_plain, "plain_seconds": plain_s,
            "plain_output_tokens_per_s": n_plain / plain_s if plain_s else None,
            "identical_to_plain": sum(a == b for a, b in zip(outputs, plain_outputs)),
        })
        if result["output_tokens_per_s"] and result["plain_output_tokens_per_s"]:
            result["speedup"] = result["output_tokens_per_s"] / result["plain_output_tokens_per_s"]
    result["outputs"] = outputs
    return result
