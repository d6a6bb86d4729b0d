"""Training losses and metrics for draft models.

EAGLE-3 (TTT): forward KL / soft cross-entropy between the target distribution restricted
to the draft vocab and the draft's ``log_softmax`` at each TTT step, on assistant tokens
only, weighted ``gamma**k`` (EAGLE-3, arXiv:2503.01840; SPEC.md section 2).

The target distribution is recomputed from the target's final (normed) hidden state and
the ``t2d`` rows of the target ``lm_head``: the ``[tokens, V]`` logits are never built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.eagle3 import shift_left, ttt_prediction_mask


class TargetDraftHead(nn.Module):
    """The target ``lm_head`` restricted to the draft vocab: ``weight [Vd, H]`` (frozen).

    ``forward(final_hidden (..., H)) -> logits (..., Vd)`` in float32.
    """

    def __init__(self, lm_head_draft_rows: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", lm_head_draft_rows.detach().clone(), persistent=False)

    @classmethod
    def from_full(cls, lm_head: torch.Tensor, t2d: torch.Tensor) -> "TargetDraftHead":
        """Gather the draft rows of a full target ``lm_head [V, H]`` with ``t2d bool [V]``."""
        if lm_head.shape[0] != t2d.shape[0]:
            raise ValueError(
                f"target lm_head has {lm_head.shape[0]} rows but t2d covers {t2d.shape[0]} target ids"
            )
        return cls(lm_head[t2d])

    @torch.no_grad()
    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(final_hidden.float(), self.weight.float())


@dataclass
class StepMetrics:
    """Per-TTT-step figures: ``loss[k]`` (forward KL, nats/token), ``acc[k]`` (fraction of
    masked positions where the draft argmax equals the target argmax over the draft vocab),
    ``tokens[k]`` (positions counted)."""

    loss: list[float]
    acc: list[float]
    tokens: list[int]


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 0.8,
    denominators: list[float] | None = None,
) -> tuple[torch.Tensor, StepMetrics]:
    """Weighted TTT loss ``sum_k gamma**k * KL_k`` (forward KL target || draft).

    Args:
        step_logits: K tensors ``(M_k, Vd)``: the draft's logits at the positions
            :func:`~draftsmith.models.eagle3.ttt_prediction_mask` selects for step k (what
            ``Eagle3DraftModel.forward(..., loss_mask=loss_mask)`` returns).
        target_logits: ``(B, T, Vd)`` target logits over the draft vocab; position t gives
            the target's distribution of x_{t+1}.
        loss_mask: ``(B, T)`` 1 on assistant tokens (the tokens to be predicted).
        gamma: step weight base.
        denominators: per-step normalisers replacing M_k; data-parallel training passes the
            global count / world size, so the averaged gradient equals the global token mean.

    Returns:
        ``(loss scalar, StepMetrics)``. KL_k averages over the M_k trained positions of step
        k (those predicting an assistant token x_{t+k+2}); a step with none contributes 0.
    """
    total = target_logits.new_zeros(())
    losses, accs, counts = [], [], []
    for k, draft in enumerate(step_logits):
        sel = ttt_prediction_mask(loss_mask, k)  # (B, T)
        target = shift_left(target_logits, k + 1)[sel]  # (M_k, Vd): distribution of x_{t+k+2}
        if draft.shape[0] != target.shape[0]:
            raise ValueError(f"step {k}: {draft.shape[0]} draft positions but {target.shape[0]} selected targets")
        m = draft.shape[0]
        counts.append(m)
        if m == 0:
            losses.append(0.0), accs.append(0.0)
            continue
        draft = draft.float()
        log_p = torch.log_softmax(target, dim=-1)
        # forward KL(p || q): the soft cross-entropy minus the target entropy (same gradient),
        # so 0 means the draft reproduces the target distribution exactly
        kl = (log_p.exp() * (log_p - torch.log_softmax(draft, dim=-1))).sum(-1).sum()
        kl = kl / (denominators[k] if denominators is not None else m)
        total = total + (gamma**k) * kl
        losses.append(kl.item())
        with torch.no_grad():
            accs.append((draft.argmax(-1) == target.argmax(-1)).float().mean().item())
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts)
