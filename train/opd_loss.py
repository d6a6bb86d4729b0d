"""On-policy distillation's loss (``draft.opd``; Draft-OPD, arXiv:2605.29343; docs/training.md,
"On-policy distillation"): the teacher-forced draft positions split by the draft's own earlier
positions of the same chain, as ``draft.accept_weighting`` weights them (:class:`AcceptSpec`).

For the row of draft position k (0-based: EAGLE-3's TTT step k, a block drafter's slot k + 1)
with position weight ``w`` (the method's: EAGLE-3 ``gamma**k / M_k``, DFlash ``w_k / sum(w)``) and
``reach = prod_{j<k} a_j`` (detached; ``a_j`` the argmax hit, hard, or the expected acceptance
``sum min(p_T, q_T)`` at the served temperature, soft) the loss is

    w * reach * D(p, q)  +  w * (1 - reach) * opd_gamma**k * KL(q || p)

with ``D`` the recipe's ``draft.loss`` (forward KL ``KL(p || q)`` by default, Draft-OPD's on
accepted positions) and ``p``, ``q`` the target's and the draft's distributions over the draft
vocab (``p`` after ``draft.distill_temperature``). At hard, ``reach`` is 0 or 1: a position the
chain reaches gets the forward KL only, one it does not reach the decayed reverse KL only.

The reverse-KL term is a second :func:`~draftsmith.train.losses.chunked_distill` over the same
rows with loss ``reverse_kl``, so it runs where the first runs: on the chunked torch path, or in
the fused Triton kernel (its ``reverse_kl`` kind) where ``train.fused_loss`` takes it (one more
logits matmul per chunk); where the fused loss cannot run, both terms fall back to the chunked
path with the fused loss's own warning. Nothing changes at inference or in the export.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .losses import AcceptSpec, DistillOut, LossSpec, chunked_distill


def reverse_spec(loss: LossSpec | None) -> LossSpec:
    """``KL(q || p)`` at ``loss``'s target temperature (``draft.distill_temperature``)."""
    return LossSpec("reverse_kl", target_temperature=(loss or LossSpec()).target_temperature)


def rejected_term(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], teacher: torch.Tensor,
                  teacher_index: torch.Tensor, weight: torch.Tensor, reach: torch.Tensor, decay: float | torch.Tensor,
                  loss: LossSpec | None = None, chunk_size: int | None = None,
                  fused: str | bool | None = None) -> DistillOut:
    """The rejected rows' term ``sum_m weight_m * (1 - reach_m) * decay_m * KL(q_m || p_m)``.

    Args:
        hidden: ``(M, H)`` draft rows (with grad); logits_fn, teacher, teacher_index, chunk_size,
            fused: as :func:`~draftsmith.train.losses.chunked_distill`.
        weight: ``(M,)`` or a 0-dim float, the rows' position weights (before the split).
        reach: ``(M,)`` float32 in [0, 1], detached: the chain's acceptance before each row.
        decay: ``opd_gamma**k``: a float, or ``(M,)`` per row.
        loss: the recipe's :class:`LossSpec` (its ``target_temperature`` is kept).

    Returns:
        :class:`DistillOut` of the reverse KL (``row_loss``: ``KL(q || p)`` per row, nats).
    """
    w = (weight * (1.0 - reach) * decay).expand(hidden.shape[0])
    return chunked_distill(hidden, logits_fn, teacher, teacher_index, w, reverse_spec(loss), chunk_size, fused=fused)


def with_rejected(accepted: DistillOut, rejected: DistillOut) -> DistillOut:
    """``accepted`` with the rejected term added to its ``loss_sum`` (the rest is the accepted
    term's: ``row_loss`` is ``D``, ``row_hit`` / ``row_alpha`` / ``row_reach`` the chain's)."""
    return dataclasses.replace(accepted, loss_sum=accepted.loss_sum + rejected.loss_sum)


def opd_group_distill(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], teacher: torch.Tensor,
                      teacher_index: torch.Tensor, weight: torch.Tensor, loss: LossSpec | None = None,
                      chunk_size: int | None = None, *, accept: AcceptSpec,
                      fused: str | bool | None = None) -> DistillOut:
    """:func:`~draftsmith.train.losses.chunked_distill`'s signature for a block drafter's slots
    (``accept.group`` = G slots per block, in order): the accepted term
    (``chunked_distill(..., accept=accept)``, each row's weight times its ``row_reach``) plus
    :func:`rejected_term` with ``decay = opd_gamma**j`` at slot index j (0..G-1) of its block.

    Raises:
        ValueError: ``accept`` is not on-policy distillation's or has no group; M not whole groups.
    """
    if accept is None or not accept.opd or not accept.group:
        raise ValueError("opd_group_distill needs draft.opd's AcceptSpec with a group (a block's slots)")
    out = chunked_distill(hidden, logits_fn, teacher, teacher_index, weight, loss, chunk_size, fused=fused,
                          accept=accept)
    G = accept.group
    decay = (accept.opd_gamma ** torch.arange(G, device=hidden.device, dtype=torch.float32)).repeat(hidden.shape[0] // G)
    rejected = rejected_term(hidden, logits_fn, teacher, teacher_index, weight, out.row_reach, decay, loss,
                             chunk_size, fused)
    return with_rejected(out, rejected)
