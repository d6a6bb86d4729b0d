"""Held-out validation while training: the split by conversation, the simulated acceptance
length, and the loop that evaluates a draft on the validation conversations.

The split (``data.validation_fraction``) is by conversation, never by token: sequences whose
ids differ only by a regeneration suffix (``_gen<N>``, speculators' regenerated samples of one
prompt), by draftsmith's duplicate-id suffix (``#<N>``) or by the suffix of a reply's own row
(``#turn<N>``, ``data.history_turns: each``) are one conversation and land on the same side.
Which conversations are held out depends only on their ids and ``seed``, not on the order of
the data, so adding data does not reshuffle the validation set.

The simulated acceptance length follows the chain rule of vLLM's rejection sampler for a
chain of K drafted tokens (docs/conventions.md, "Acceptance metrics": AL = 1 + accepted / drafts):

- T = 0: draft token k is accepted when every earlier one was and the draft's argmax (mapped to
  a target id through ``d2t``) is the target's argmax over the *full* target vocab (a target
  argmax outside the draft vocab is a rejection, as in serving).
- T > 0: the expected acceptance of draft token k is ``alpha_k = sum_x min(p_T(x), q_T(x))``
  (speculative sampling, Leviathan et al. 2023), p_T the target's full-vocab distribution at
  temperature T. vLLM's EAGLE proposer drafts greedily (``draft_sampling="greedy"``), so q is
  one-hot at the draft's argmax and ``alpha_k = p_T(argmax q)``; ``"sample"`` uses the draft's
  own distribution at T. The expected number accepted is ``sum_k prod_{j<=k} alpha_j``.

The chain is evaluated at every position whose K drafted tokens are all assistant tokens of
the same conversation (a draft in mid-reply), with the TTT forward (the draft reads its own
hidden states for steps k >= 1, and the data's tokens as the accepted ones).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .data import to_device

log = logging.getLogger("draftsmith.train")

_SAME_CONVERSATION = re.compile(r"(_gen\d+|#\d+|#turn\d+)+$")


class ValidationSplitError(ValueError):
    """``data.validation_fraction`` leaves no validation or no training conversations."""


def conversation_key(record_id: str) -> str:
    """The conversation a sequence belongs to: its id without ``_gen<N>`` / ``#<N>`` / ``#turn<N>`` suffixes."""
    return _SAME_CONVERSATION.sub("", str(record_id))


def split_by_conversation(ids: list[str], fraction: float, seed: int, where: str = "data") -> tuple[list[int], list[int]]:
    """``(train indices, validation indices)`` of the sequences ``ids``: ``round(fraction * C)``
    of the C conversations (:func:`conversation_key`), chosen by a seeded hash of their keys.

    Raises:
        ValidationSplitError: naming ``where``, when the split leaves either side empty.
    """
    keys = [conversation_key(i) for i in ids]
    unique = sorted(set(keys))
    n_val = round(fraction * len(unique))
    if n_val < 1 or n_val >= len(unique):
        side = "no validation" if n_val < 1 else "no training"
        raise ValidationSplitError(
            f"{where}: data.validation_fraction={fraction} of {len(unique)} conversations ({len(ids)} sequences) "
            f"leaves {side} conversations; choose a fraction between {1 / len(unique):.4g} and "
            f"{1 - 1 / len(unique):.4g}, or set it to 0 to train without validation"
            if unique else f"{where}: no sequences to split")
    rank = sorted(unique, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())
    held_out = set(rank[:n_val])
    train = [i for i, k in enumerate(keys) if k not in held_out]
    val = [i for i, k in enumerate(keys) if k in held_out]
    return train, val


class IndexedSubset(Dataset):
    """``dataset`` restricted to ``indices``, keeping ``lengths()`` (what the samplers read)."""

    def __init__(self, dataset: Any, indices: list[int]):
        self.dataset, self.indices = dataset, list(indices)
        all_lengths = dataset.lengths()
        self._lengths = [all_lengths[i] for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> list[int]:
        return self._lengths

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.indices[i]]


def dataset_ids(dataset: Any) -> list[str]:
    """The record id of every sequence of a training dataset (shards: the manifest; tokenised
    Arrow rows: the ``id`` column)."""
    if hasattr(dataset, "manifest"):
        return [str(i) for s in dataset.manifest["shards"] for i in s["ids"]]
    if hasattr(dataset, "record_ids"):
        return dataset.record_ids()
    raise TypeError(f"{type(dataset).__name__} has no record ids to split by conversation")


def chain_alphas(q: torch.Tensor, p: torch.Tensor, d2t: torch.Tensor, temperatures: list[float],
                 draft_sampling: str = "greedy") -> dict[float, torch.Tensor]:
    """The acceptance probability ``alpha`` of each drafted token, per temperature, for rows of
    one step: ``q (C, Vd)`` draft logits, ``p (C, V)`` the target's full-vocab logits of the same
    token, ``d2t (Vd,)`` offsets (target id = draft id + ``d2t[draft id]``). Rows are independent,
    so callers evaluate any number of rows in chunks. Returns ``{T: (C,)}`` (see the module
    docstring for the rule at T = 0 and T > 0)."""
    q, p = q.float(), p.float()
    draft_ids = q.argmax(-1)
    draft_target_ids = draft_ids + d2t.to(q.device)[draft_ids]  # (C,)
    out = {}
    for t in temperatures:
        if t == 0:
            out[t] = (p.argmax(-1) == draft_target_ids).float()
            continue
        p_t = torch.softmax(p / t, dim=-1)
        if draft_sampling == "greedy":
            out[t] = p_t.gather(1, draft_target_ids[:, None])[:, 0]
        else:
            q_t = torch.softmax(q / t, dim=-1)  # (C, Vd) over the draft ids' target ids
            target_ids = torch.arange(q.shape[1], device=q.device) + d2t.to(q.device)
            out[t] = torch.minimum(p_t[:, target_ids], q_t).sum(-1)
    return out


def accepted_sums(step_alphas: list[dict[float, torch.Tensor]], step_masks: list[torch.Tensor],
                  temperatures: list[float]) -> dict[str, torch.Tensor]:
    """Chain sums from per-step acceptance probabilities: ``step_alphas[k][T]`` is ``(M_k,)`` at the
    positions ``step_masks[k] (B, T)`` selects (row-major). Returns ``{"chains": ()``, ``"accepted_T":
    (K,)}``: summed ``prod_{j<=k} alpha_j`` over the chains (positions every step selects)."""
    K = len(step_masks)
    chain = step_masks[0].clone()
    for m in step_masks[1:]:
        chain &= m
    out: dict[str, torch.Tensor] = {"chains": chain.sum().float()}
    for t in temperatures:
        alphas = torch.zeros((K, *chain.shape), device=chain.device)
        for k in range(K):
            if step_alphas[k] is not None and step_alphas[k][t].numel():
                alphas[k][step_masks[k]] = step_alphas[k][t].to(alphas.dtype)
        run = torch.cumprod(alphas, dim=0)  # (K, B, T): prod_{j<=k} alpha_j
        out[f"accepted_{t:g}"] = run[:, chain].sum(-1)  # (K,)
    return out


def full_vocab_logits(final_hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """``(M, V)`` float32 target logits of ``final_hidden (M, H)`` (the target's normed final
    states) through the full ``lm_head [V, H]`` (kept in its own dtype: a bf16 head is not copied
    to fp32; callers pass chunks of rows)."""
    if lm_head.dtype == torch.float32 or lm_head.device.type != "cpu":
        return F.linear(final_hidden.to(lm_head.dtype), lm_head).float()
    return F.linear(final_hidden.float(), lm_head.float())


@dataclass(frozen=True)
class ValidationSpec:
    """What a method's validation reports: K chained draft tokens simulated (0: no simulated
    acceptance), the temperatures simulated, and the step weights that make ``val_loss`` from
    the per-step ``val_loss_k`` (the training loss's weights, e.g. ``gamma**k``)."""

    num_draft_tokens: int = 0
    temperatures: tuple[float, ...] = ()
    step_weights: tuple[float, ...] = ()


def summarise_validation(sums: dict[str, float], spec: ValidationSpec) -> dict[str, float]:
    """Metrics from the summed validation counters (``name`` / ``name_count`` pairs, and the
    chain sums of :func:`accepted_sums`): ``val_loss_k`` / ``val_acc_k`` token means,
    ``val_loss`` (their ``step_weights`` sum, or the ``loss`` mean), ``val_sim_al`` (T=0) /
    ``val_sim_al_t{T}`` and ``val_sim_rate_k`` (T=0 per-position acceptance), ``val_chains``."""
    K, temperatures = spec.num_draft_tokens, spec.temperatures
    out: dict[str, float] = {}
    for key, total in sums.items():
        if key.endswith("_count") or key.startswith(("accepted_", "chains")):
            continue
        count = sums.get(f"{key}_count", 0.0)
        if count:
            out[f"val_{key}"] = total / count
    if "val_loss" not in out and spec.step_weights:
        steps = [out.get(f"val_loss_{k}") for k in range(len(spec.step_weights))]
        if all(v is not None for v in steps):
            out["val_loss"] = sum(w * v for w, v in zip(spec.step_weights, steps))
    chains = sums.get("chains", 0.0)
    if chains and K:
        for t in temperatures:
            per_pos = [sums[f"accepted_{t:g}_{k}"] / chains for k in range(K)]
            suffix = "" if t == 0 else f"_t{t:g}"
            out[f"val_sim_al{suffix}"] = 1.0 + sum(per_pos)
            if t == 0:
                for k, r in enumerate(per_pos):
                    out[f"val_sim_rate_{k}"] = r
    if K:
        out["val_chains"] = chains
    return out


@torch.no_grad()
def run_validation(method: Any, model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]],
                   accelerator: Any) -> dict[str, float]:
    """Evaluate ``model`` on this rank's validation ``batches`` with ``method.validation_sums``
    and reduce the sums over processes; every rank must pass the same number of batches (a
    rank with fewer repeats one with ``weight 0``: FSDP / ZeRO-3 forwards are collective).

    ``method.validation_sums(model, batch)`` returns summed counters of one batch (scalars or
    ``(K,)`` vectors; see :func:`summarise_validation`); ``method.validation_spec()`` a
    :class:`ValidationSpec`.

    Returns:
        :func:`summarise_validation` of the global sums (the same dict on every rank).
    """
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    try:
        for batch in batches:
            weight = float(batch.pop("_weight", 1.0))
            batch = to_device(batch, accelerator.device)
            for key, value in method.validation_sums(model, batch).items():
                value = torch.as_tensor(value, dtype=torch.float64, device=accelerator.device).reshape(-1) * weight
                sums[key] = sums[key] + value if key in sums else value
    finally:
        model.train(was_training)
    keys = sorted(sums)
    flat = torch.cat([sums[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
    if accelerator.num_processes > 1:
        flat = accelerator.reduce(flat.to(accelerator.device), reduction="sum")
    totals: dict[str, float] = {}
    i = 0
    for k in keys:
        n = sums[k].numel()
        values = flat[i:i + n].tolist()
        i += n
        if n == 1:
            totals[k] = values[0]
        else:  # per-step vectors: accepted_T -> accepted_T_k
            for j, v in enumerate(values):
                totals[f"{k}_{j}"] = v
    return summarise_validation(totals, method.validation_spec())


def validation_batches(dataset: Any, batch_size: int, collate_fn: Callable, num_processes: int,
                       rank: int, max_sequences: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's share of the validation set (at most ``max_sequences`` of it, the same ones
    every time) as collated batches, length-sorted so there is little padding, read lazily and
    the same count on every rank: ranks with fewer repeat batch 0 with ``_weight 0``."""
    lengths = dataset.lengths()
    keep = range(len(dataset)) if max_sequences is None else range(min(len(dataset), max_sequences))
    order = sorted(keep, key=lambda i: lengths[i])
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    per_rank = math.ceil(len(chunks) / num_processes)
    mine = chunks[rank::num_processes]
    for c in mine:
        yield collate_fn([dataset[i] for i in c])
    for _ in range(per_rank - len(mine)):
        filler = collate_fn([dataset[i] for i in chunks[0]])
        filler["_weight"] = torch.tensor(0.0)
        yield filler
