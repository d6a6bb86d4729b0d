"""The unchunked reference losses: what training computed before its losses moved into the drafts'
forwards in chunks (``train/losses.py`` ``chunked_distill``). Each keeps every step's or head's whole
logits and reads its metrics back per step; the tests check that the training paths give the same
values, gradients and metrics."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from draftsmith.models.common import shift_left
from draftsmith.models.common import ttt_prediction_mask
from draftsmith.train.losses import LossSpec, StepMetrics
from draftsmith.train.validation import accepted_sums, chain_alphas


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 0.8,
    denominators: list[float] | None = None,
    document_ids: torch.Tensor | None = None,
    loss: LossSpec | None = None,
) -> tuple[torch.Tensor, StepMetrics]:
    """Weighted TTT loss ``sum_k gamma**k * D_k``, D the divergence ``loss`` (default: forward
    KL target || draft; :func:`divergence`), from every step's whole logits: the unchunked reference.
    Training computes the same value and gradients without holding any ``(M_k, Vd)`` tensor
    (``Eagle3Method.compute_loss``: :func:`chunked_distill` inside the draft's forward, no host read);
    this form reads its metrics back per step and keeps all K logits, for tests and small checks.

    Args:
        step_logits: K tensors ``(M_k, Vd)``: the draft's logits at the positions
            :func:`~draftsmith.models.common.ttt_prediction_mask` selects for step k (what
            ``Eagle3DraftModel.forward(..., loss_mask=loss_mask)`` returns).
        target_logits: ``(B, T, Vd)`` target logits over the draft vocab; position t gives
            the target's distribution of x_{t+1}.
        loss_mask: ``(B, T)`` 1 on assistant tokens (the tokens to be predicted).
        gamma: step weight base.
        denominators: per-step normalisers replacing M_k; data-parallel training passes the
            global count / world size, so the averaged gradient equals the global token mean.
        document_ids: ``(B, T)`` document per position of packed rows (as given to the model):
            no prediction crosses a document boundary.
        loss: the divergence (``draft.loss``); None: forward KL.

    Returns:
        ``(loss scalar, StepMetrics)``. D_k averages over the M_k trained positions of step
        k (those predicting an assistant token x_{t+k+2}); a step with none contributes 0.
    """
    total = target_logits.new_zeros(())
    losses, accs, counts = [], [], []
    for k, draft in enumerate(step_logits):
        sel = ttt_prediction_mask(loss_mask, k, document_ids)  # (B, T)
        target = shift_left(target_logits, k + 1)[sel]  # (M_k, Vd): distribution of x_{t+k+2}
        if draft.shape[0] != target.shape[0]:
            raise ValueError(f"step {k}: {draft.shape[0]} draft positions but {target.shape[0]} selected targets")
        m = draft.shape[0]
        counts.append(m)
        if m == 0:
            losses.append(0.0), accs.append(0.0)
            continue
        draft = draft.float()
        kl = (loss or LossSpec())(target, draft).sum()
        kl = kl / (denominators[k] if denominators is not None else m)
        total = total + (gamma**k) * kl
        losses.append(kl.item())
        with torch.no_grad():
            accs.append((draft.argmax(-1) == target.argmax(-1)).float().mean().item())
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts)


def head_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    decay: float = 0.8,
    denominators: list[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, StepMetrics]:
    """Per-head cross-entropy ``sum_k decay**k * CE_k`` against hard labels (Medusa-1 /
    IBM MLP speculator; docs/conventions.md, "Loss and step weights").

    The unchunked reference: it takes the ``(K, M, V)`` logits and reads counts and metrics back
    to the host. Training computes the same loss without either (``HeadMethod.compute_loss``:
    :func:`chunked_distill` per head inside the model's forward).

    Args:
        logits: ``(K, M, V)`` every head's logits at the M gathered positions (full target vocab).
        labels: ``(K, M)`` the token each head should predict (x_{t+k+2}).
        label_mask: ``(K, M)`` bool, positions that count for head k.
        decay: head weight base (Medusa: 0.8).
        denominators: per-head normalisers replacing the local count M_k (data parallel: the
            global count / world size, as in :func:`ttt_loss`); a list or a ``(K,)`` tensor.

    Returns:
        ``(loss scalar, StepMetrics)``: ``loss[k]`` mean CE in nats/token, ``acc[k]`` top-1
        accuracy (argmax == label), ``tokens[k]`` positions counted; a head with none gives 0.
    """
    total = logits.sum() * 0.0  # keeps the graph: a micro-batch without labels still backpropagates
    losses, accs, counts = [], [], []
    for k in range(logits.shape[0]):
        sel = label_mask[k]
        m = int(sel.sum())
        counts.append(m)
        if m == 0:
            losses.append(0.0), accs.append(0.0)
            continue
        head = logits[k][sel].float()  # (M_k, V), one head at a time: fp32 copies stay small
        target = labels[k][sel]
        ce = F.cross_entropy(head, target, reduction="sum") / (denominators[k] if denominators is not None else m)
        total = total + (decay**k) * ce
        losses.append(ce.item())
        with torch.no_grad():
            accs.append((head.argmax(-1) == target).float().mean().item())
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts)


def simulated_chain(step_logits: list[torch.Tensor], step_masks: list[torch.Tensor],
                    target_full_logits: Callable[[int], torch.Tensor], d2t: torch.Tensor,
                    temperatures: list[float], draft_sampling: str = "greedy") -> dict[str, torch.Tensor]:
    """Accepted-token sums of the simulated K-token chains of one batch (:func:`chain_alphas`
    per step, :func:`accepted_sums`); training's validation evaluates the same in chunks of rows
    inside the draft's forward instead (``Eagle3Method.validation_sums``).

    Args:
        step_logits: K tensors ``(M_k, Vd)``: draft logits of step k at the positions
            ``step_masks[k]`` selects (row-major), as the TTT forward returns them.
        step_masks: K ``(B, T)`` bool masks (:func:`~draftsmith.models.common.ttt_prediction_mask`).
        target_full_logits: ``k -> (M_k, V)`` the target's full-vocab logits of the token step k
            drafts, at the same positions.
        d2t: ``(Vd,)`` offsets, target id = draft id + ``d2t[draft id]``.
        temperatures: sampling temperatures simulated (0: greedy verification).
        draft_sampling: ``"greedy"`` (vLLM's EAGLE proposer: q one-hot at the argmax) or ``"sample"``.

    Returns:
        ``{"chains": ()`` number of chains, ``"accepted_T": (K,)`` summed ``prod_{j<=k} alpha_j``
        over the chains, per temperature T}. Chains are the positions every step selects.

    Raises:
        ValueError: unknown ``draft_sampling``.
    """
    if draft_sampling not in ("greedy", "sample"):
        raise ValueError(f"draft_sampling={draft_sampling!r}: 'greedy' or 'sample'")
    alphas = [chain_alphas(step_logits[k], target_full_logits(k), d2t, temperatures, draft_sampling)
              if bool(step_masks[k].any()) else None for k in range(len(step_logits))]
    return accepted_sums(alphas, step_masks, temperatures)
