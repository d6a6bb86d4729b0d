"""Training losses and metrics for draft models.

EAGLE-3 (TTT): a divergence between the target distribution restricted to the draft vocab
and the draft's at each TTT step, on assistant tokens only, weighted ``gamma**k`` (EAGLE-3,
arXiv:2503.01840; docs/conventions.md, "Loss and step weights"). The divergence is ``draft.loss`` (:data:`LOSSES`,
:func:`divergence`): forward KL (the anchors' default), reverse KL, Jensen-Shannon, total
variation, or the LK acceptance losses (Samarin et al., "LK Losses: Direct Acceptance Rate
Optimization for Speculative Decoding", arXiv:2602.23881). P-EAGLE and DFlash use the same
:func:`divergence` per element.

The target distribution is recomputed from the target's final (normed) hidden state and
the ``t2d`` rows of the target ``lm_head``: the ``[tokens, V]`` logits are never built.

Medusa heads and MLP-speculator stages: per-head cross-entropy against the sequence's
next tokens (the target's own regenerated replies), head k weighted ``decay**k``, on
assistant tokens only (:func:`head_targets`; the loss itself is :func:`chunked_distill` with
``labels=True`` inside the heads' forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.common import shift_left
from ..models.eagle3.model import ttt_prediction_mask
from ..recipe import LossName

LOSSES: tuple[str, ...] = get_args(LossName)
_ALPHA_FLOOR = 1e-6  # lk_alpha: -log(max(alpha, floor)) stays finite at zero overlap


def acceptance_probability(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)`` over the last dim: the probability that a
    token drafted from q is accepted by speculative sampling against p (Leviathan et al. 2023).

    Args:
        log_p, log_q: ``(..., V)`` log-probabilities (target, draft).

    Returns:
        ``(...)`` in [0, 1].
    """
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a || b) = sum_v a_v (log a_v - log b_v)`` over the last dim, from log-probabilities."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def divergence(kind: str, target_logits: torch.Tensor, draft_logits: torch.Tensor, *,
               lk_kl_scale: float = 1.0, lk_kl_decay: float = 3.0) -> torch.Tensor:
    """Per-position loss ``(M,)`` between the target distribution ``p = softmax(target_logits)``
    and the draft's ``q = softmax(draft_logits)`` (both ``(M, V)``, computed in float32; nats).

    - ``forward_kl``: ``KL(p || q) = sum p (log p - log q)`` (mass-covering; the EAGLE anchors').
    - ``reverse_kl``: ``KL(q || p)`` (mode-seeking).
    - ``jsd``: ``(KL(p || m) + KL(q || m)) / 2`` with ``m = (p + q) / 2`` (bounded by log 2).
    - ``tv``: ``sum |p - q| / 2 = 1 - alpha``: minimising it maximises the acceptance rate
      alpha (:func:`acceptance_probability`), but its gradient vanishes where the overlap is small.
    - ``lk_alpha``: ``-log alpha`` (LK^alpha): acceptance directly, its gradient ``grad TV / alpha``
      amplified where the overlap is low; equals cross-entropy for a one-hot target.
    - ``lk_lambda``: ``w * KL(p || q) + (1 - alpha)`` with ``w = lk_kl_scale * exp(-lk_kl_decay *
      alpha)`` (alpha detached; LK^lambda): KL leads while acceptance is low, acceptance after.

    Raises:
        ValueError: unknown ``kind`` (the message lists :data:`LOSSES`).
    """
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    if kind == "forward_kl":  # the soft cross-entropy minus the target entropy (same gradient)
        return _kl(log_p, log_q)
    if kind == "reverse_kl":
        return _kl(log_q, log_p)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_p, log_q]), dim=0) - math.log(2.0)
        return 0.5 * (_kl(log_p, log_m) + _kl(log_q, log_m))
    alpha = acceptance_probability(log_p, log_q)
    if kind == "tv":
        return 1.0 - alpha
    if kind == "lk_alpha":
        return -torch.log(alpha.clamp_min(_ALPHA_FLOOR))
    if kind == "lk_lambda":
        w = lk_kl_scale * torch.exp(-lk_kl_decay * alpha.detach())
        return w * _kl(log_p, log_q) + (1.0 - alpha)
    raise ValueError(f"unknown loss {kind!r}: one of {', '.join(LOSSES)}")


@dataclass(frozen=True)
class LossSpec:
    """``draft.loss`` and its LK hyperparameters, passed to :func:`divergence`."""

    kind: str = "forward_kl"
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 3.0

    @classmethod
    def from_recipe(cls, draft_cfg) -> LossSpec:
        return cls(draft_cfg.loss, draft_cfg.lk_kl_scale, draft_cfg.lk_kl_decay)

    def __call__(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        return divergence(self.kind, target_logits, draft_logits, lk_kl_scale=self.lk_kl_scale,
                          lk_kl_decay=self.lk_kl_decay)


class TargetDraftHead(nn.Module):
    """The target ``lm_head`` restricted to the draft vocab: ``weight [Vd, H]`` (frozen, kept in the
    target's dtype: bf16 for a bf16 target).

    ``forward(final_hidden (..., H)) -> logits (..., Vd)`` in float32. On an accelerator a bf16
    weight multiplies in bf16 with fp32 accumulation (the logits the served target computes: vLLM
    runs the target's ``lm_head`` in its dtype and samples from those logits); on the CPU the
    product is taken in float32.
    """

    def __init__(self, lm_head_draft_rows: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", lm_head_draft_rows.detach().clone(), persistent=False)

    @classmethod
    def from_full(cls, lm_head: torch.Tensor, t2d: torch.Tensor) -> TargetDraftHead:
        """Gather the draft rows of a full target ``lm_head [V, H]`` with ``t2d bool [V]``."""
        if lm_head.shape[0] != t2d.shape[0]:
            raise ValueError(
                f"target lm_head has {lm_head.shape[0]} rows but t2d covers {t2d.shape[0]} target ids"
            )
        return cls(lm_head[t2d])

    @torch.no_grad()
    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != torch.float32 and w.device.type != "cpu":
            return F.linear(final_hidden.to(w.dtype), w).float()
        return F.linear(final_hidden.float(), w.float())


DEFAULT_CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk: 128 MiB per fp32 (C, V) copy


def chunk_rows(vocab_size: int, chunk_size: int | None = None) -> int:
    """Rows per loss chunk: ``chunk_size`` or as many as keep one fp32 ``(C, V)`` tensor at
    :data:`DEFAULT_CHUNK_ELEMENTS` (1048 rows at V = 32000, 261 at V = 128256)."""
    return max(1, chunk_size or DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size))


@dataclass
class DistillOut:
    """What :func:`chunked_distill` returns.

    Attributes:
        loss_sum: scalar ``sum_m weight_m * D_m`` (with grad).
        row_loss: ``(M,)`` float32 ``D_m`` per row (detached; nats).
        row_hit: ``(M,)`` float32, 1 where the draft argmax equals the target argmax (detached).
    """

    loss_sum: torch.Tensor
    row_loss: torch.Tensor
    row_hit: torch.Tensor


def _distill_chunk(hidden: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor,
                   weight: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], loss: LossSpec,
                   labels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits_fn(hidden).float()  # (C, V)
    if labels:  # hard labels: teacher (N,) token ids
        target = teacher.index_select(0, teacher_index)  # (C,)
        d = F.cross_entropy(logits, target, reduction="none")
        hit = logits.argmax(-1) == target
    else:
        target = teacher.index_select(0, teacher_index).float()  # (C, V)
        d = loss(target, logits)
        hit = logits.argmax(-1) == target.argmax(-1)
    return (weight * d).sum(), d.detach(), hit.float()


def chunked_distill(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                    teacher: torch.Tensor, teacher_index: torch.Tensor, weight: torch.Tensor,
                    loss: LossSpec | None = None, chunk_size: int | None = None,
                    labels: bool = False, vocab_size: int | None = None) -> DistillOut:
    """The weighted divergence of M draft rows against their target rows, computed in chunks of
    rows so that no ``(M, V)`` tensor exists: each chunk's logits and fp32 log-softmaxes live only
    inside the chunk and are recomputed in backward (non-reentrant activation checkpointing), so
    the memory of the loss is ``O(C * V)`` for ``C`` rows per chunk, not ``O(M * V)`` per step.

    Call it inside the draft's ``forward`` (``logits_fn`` uses the draft's ``norm`` / ``lm_head``),
    so DDP / FSDP see those weights used in forward and accelerate's fp32 output conversion
    copies scalars, not logits. Reads no tensor on the host (no sync).

    Args:
        hidden: ``(M, H)`` draft rows (pre-norm hidden states), with grad.
        logits_fn: ``(C, H) -> (C, V)`` draft logits.
        teacher: ``(N, V)`` target logits over the draft vocab (no grad; fp32 or bf16), or with
            ``labels`` ``(N,)`` target token ids (cross-entropy against hard labels).
        teacher_index: ``(M,)`` int64, the ``teacher`` row of each hidden row.
        weight: ``(M,)`` float, the loss weight of each row (0: not trained).
        loss: the divergence (``draft.loss``, :class:`LossSpec`); None: forward KL. Ignored with ``labels``.
        chunk_size: rows per chunk; default :func:`chunk_rows` of V.
        labels: ``teacher`` holds token ids (Medusa heads / MLP-speculator stages).
        vocab_size: V of ``logits_fn`` (sizes the default chunk when ``labels``).

    Raises:
        ValueError: ``labels`` without ``chunk_size`` or ``vocab_size``.

    Returns:
        :class:`DistillOut`; its values and gradients equal the unchunked
        ``sum(weight * divergence(teacher[teacher_index], logits_fn(hidden)))``.
    """
    spec = loss or LossSpec()
    M = hidden.shape[0]
    if labels and not (chunk_size or vocab_size):
        raise ValueError("chunked_distill(labels=True) needs chunk_size or vocab_size")
    rows = chunk_rows(vocab_size if labels else teacher.shape[-1], chunk_size)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    sums, row_loss, row_hit = [], [], []
    for s in range(0, M, rows):
        args = (hidden[s:s + rows], teacher, teacher_index[s:s + rows], weight[s:s + rows], logits_fn, spec, labels)
        out = checkpoint(_distill_chunk, *args, use_reentrant=False) if grad else _distill_chunk(*args)
        sums.append(out[0]), row_loss.append(out[1]), row_hit.append(out[2])
    if not sums:  # no row: a zero that keeps the graph
        zero = hidden.sum() * 0.0
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return DistillOut(zero, empty, empty)
    total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return DistillOut(total, torch.cat(row_loss), torch.cat(row_hit))


@dataclass
class StepMetrics:
    """Per-TTT-step figures: ``loss[k]`` (the step's divergence, nats/token), ``acc[k]`` (fraction of
    masked positions where the draft argmax equals the target argmax over the draft vocab),
    ``tokens[k]`` (positions counted)."""

    loss: list[float]
    acc: list[float]
    tokens: list[int]


@dataclass
class HeadTargets:
    """What K multi-token heads train on, gathered at the positions that have a label.

    ``positions (B, T)`` bool: positions t where some head k has a label (loss_mask of
    x_{t+k+2} is 1); M of them. ``tokens (M, K + 2)``: ``tokens[m, j]`` = x_{t+j} (0 past the
    end). ``labels (K, M)`` = x_{t+k+2}; ``label_mask (K, M)`` bool = loss_mask of that token.
    """

    positions: torch.Tensor
    tokens: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor


def head_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int,
                 document_ids: torch.Tensor | None = None) -> HeadTargets:
    """Labels of Medusa heads / MLP-speculator stages: head k at position t predicts
    x_{t+k+2}, trained only where that token is an assistant token (``loss_mask (B, T)``;
    padding has 0) and, with ``document_ids (B, T)`` (packed rows), in t's document.
    Restricting to positions with a label keeps the full-vocab heads to the tokens that count
    (prompts and padding are never projected).

    M depends on the data (boolean indexing): training calls it on the collated CPU batch in the
    DataLoader (``HeadMethod.plan_heads``, the batch plan), so the step reads nothing back."""
    K = num_heads
    window = torch.stack([shift_left(input_ids, j) for j in range(K + 2)], dim=-1)  # (B, T, K+2)
    masks = torch.stack([ttt_prediction_mask(loss_mask, k, document_ids) for k in range(K)])  # (K, B, T)
    positions = masks.any(0)  # (B, T)
    tokens = window[positions]  # (M, K+2)
    return HeadTargets(positions, tokens, tokens[:, 2:].T.contiguous(), masks[:, positions])
