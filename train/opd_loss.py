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

Both terms come from ONE :func:`~draftsmith.train.losses.chunked_distill` call over the rows, with
two per-row weights (``w * reach`` for ``D``, ``w * (1 - reach) * opd_gamma**k`` for the reverse
KL; ``DistillOut.row_loss`` is ``D``, ``row_rejected`` the reverse KL): on the chunked torch path
both divergences come from each chunk's logits, and in the fused Triton kernel (train.fused_loss)
from one logits matmul per chunk, the row kernel summing ``KL(q || p)`` beside ``D`` in the same
vocab passes and writing one gradient for both. Where the fused loss cannot run, the call takes the
chunked path with the fused loss's own warning. Nothing changes at inference or in the export.

The block drafters whose chunk computes several terms from its own logits (DSpark, XPress: their
logits are not ``logits_fn(hidden)`` alone, and their terms are not one divergence) take the same
weights from :func:`group_split`, inside their chunk, from the logits it already holds.
"""

from __future__ import annotations

from typing import Callable

import torch

from .losses import AcceptSpec, DistillOut, LossSpec, chunked_distill, expected_acceptance, group_reach


def opd_distill(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], teacher: torch.Tensor,
                teacher_index: torch.Tensor, weight: torch.Tensor, reach: torch.Tensor, decay: float,
                loss: LossSpec | None = None, chunk_size: int | None = None, *, accept: AcceptSpec,
                fused: str | bool | None = None) -> DistillOut:
    """One draft position's rows whose reach the caller carries (EAGLE-3's TTT step k >= 1):
    ``sum_m weight_m * (reach_m * D_m + (1 - reach_m) * decay * KL(q_m || p_m))`` in one
    :func:`~draftsmith.train.losses.chunked_distill` call.

    Args:
        hidden: ``(M, H)`` draft rows (with grad); logits_fn, teacher, teacher_index, loss,
            chunk_size, fused: as :func:`~draftsmith.train.losses.chunked_distill`.
        weight: ``(M,)`` or 0-dim float tensor, the rows' position weights (before the split).
        reach: ``(M,)`` float32 in [0, 1], detached: the chain's acceptance before each row.
        decay: ``opd_gamma**k`` of the rows' draft position k.
        accept: ``draft.opd``'s :class:`AcceptSpec` (no group; soft: ``row_alpha`` too, for the
            next step's reach).

    Returns:
        :class:`DistillOut`: ``loss_sum`` both terms, ``row_loss`` ``D`` and ``row_rejected``
        ``KL(q || p)`` per row (nats), ``row_hit`` / ``row_alpha`` the rows' own acceptance.

    Raises:
        ValueError: ``accept`` is not on-policy distillation's, or has a group (block drafters:
            :func:`opd_group_distill`).
    """
    if accept is None or not accept.opd or accept.group:
        raise ValueError("opd_distill needs draft.opd's AcceptSpec without a group (EAGLE-3's TTT steps)")
    accepted = weight * reach
    rejected = torch.sub(weight * decay, accepted, alpha=decay)  # w * (1 - reach) * decay in two small ops
    return chunked_distill(hidden, logits_fn, teacher, teacher_index, accepted, loss, chunk_size, fused=fused,
                           accept=accept, rejected_weight=rejected)


def opd_group_distill(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], teacher: torch.Tensor,
                      teacher_index: torch.Tensor, weight: torch.Tensor, loss: LossSpec | None = None,
                      chunk_size: int | None = None, *, accept: AcceptSpec,
                      fused: str | bool | None = None) -> DistillOut:
    """:func:`~draftsmith.train.losses.chunked_distill`'s signature for a block drafter's slots
    (``accept.group`` = G slots per block, in order): one call that weights slot j (0..G-1) of a
    block ``weight * reach`` for ``D`` and ``weight * (1 - reach) * opd_gamma**j`` for
    ``KL(q || p)``, the reach computed in the call from the block's earlier slots (``row_reach``).

    Raises:
        ValueError: ``accept`` is not on-policy distillation's or has no group; M not whole groups.
    """
    if accept is None or not accept.opd or not accept.group:
        raise ValueError("opd_group_distill needs draft.opd's AcceptSpec with a group (a block's slots)")
    return chunked_distill(hidden, logits_fn, teacher, teacher_index, weight, loss, chunk_size, fused=fused,
                           accept=accept)


def group_split(accept: AcceptSpec, target: torch.Tensor, logits: torch.Tensor, hit: torch.Tensor,
                weight: torch.Tensor, reach: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weights of a chunk of whole groups (``accept.group`` rows per block, in slot order) for a
    loss that computes its own terms from the chunk's logits (DSpark's, XPress's chunks), as
    :func:`~draftsmith.train.losses.chunked_distill` computes them with an :class:`AcceptSpec` of a
    group: the reach from :func:`~draftsmith.train.losses.group_reach` of the rows' argmax hits
    (hard, soft at T = 0) or expected acceptance at T (soft), no grad.

    Args:
        accept: ``draft.accept_weighting``'s or ``draft.opd``'s :class:`AcceptSpec`, with a group G.
        target / logits: ``(C, V)`` float32, the chunk's target and draft logits (read only for soft at T > 0).
        hit: ``(C,)`` float32, 1 where the draft's argmax is the target's.
        weight: ``(C,)`` float, the rows' position weights (0: untrained; such a row passes the chain on).
        reach: ``(C,)`` float32, a reach computed elsewhere for these rows (XPress's other parts take its
            teacher-forced part's); None: from these logits.

    Returns:
        ``(reach, accepted, rejected)``, each ``(C,)`` float32 and detached where ``weight`` is:
        ``reach``; ``accepted = weight * reach``; with ``accept.opd`` ``rejected = weight *
        opd_gamma**j * (1 - reach)`` at slot j of a group (the weight of ``KL(q || p)``), else None.
    """
    if reach is None:
        factor = expected_acceptance(target, logits, accept.temperature) if accept.soft else hit
        reach = group_reach(factor, weight <= 0, accept.group)
    accepted = weight * reach
    if not accept.opd:
        return reach, accepted, None
    decayed = (weight.view(-1, accept.group) * accept.slot_decay(weight.device)).flatten()
    return reach, accepted, decayed * (1.0 - reach)


def reverse_kl(loss: LossSpec, target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``(C,)`` ``KL(q || p)`` per row, ``p`` the target's distribution after ``loss``'s
    ``draft.distill_temperature`` (``draft.opd``'s rejected term)."""
    return LossSpec("reverse_kl", target_temperature=loss.target_temperature)(target, logits)
