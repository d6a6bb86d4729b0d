"""Training labels shared by the draft methods: which positions a draft is trained on, and
towards which token, computed from a batch's loss mask (assistant tokens) and document ids. No
model code: the losses that use them are :mod:`draftsmith.train.losses`.

- TTT steps and multi-token heads: :func:`ttt_prediction_masks` (step or head k at position t
  predicts x_{t+k+2}), computed once per batch; the heads' labels (:func:`head_targets`, Medusa
  and the MLP speculator) and a method's own rows (EAGLE-3's TTT plan) are built from them.

A method's own labels (DFlash's anchors and block labels, P-EAGLE's conditional-drop elements)
are in its package's ``training.py`` (``models/<name>/training.py``). What runs in the
DataLoader (the batch plans) reads CPU tensors; what runs in a step reads nothing on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.common import shift_left, ttt_prediction_mask

# --------------------------------------------------------------------------------------
# TTT steps and multi-token heads


def ttt_prediction_masks(loss_mask: torch.Tensor, steps: int,
                         document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """K ``(B, T)`` bool masks, one per TTT step (or head) k:
    :func:`~draftsmith.models.common.ttt_prediction_mask` (position t's prediction of x_{t+k+2} is
    trained). Computed once per batch and passed to EAGLE-3's
    :func:`~draftsmith.models.eagle3.training.ttt_plan`, :func:`head_targets` and validation's
    simulated chains."""
    return [ttt_prediction_mask(loss_mask, k, document_ids) for k in range(steps)]


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
    masks = torch.stack(ttt_prediction_masks(loss_mask, K, document_ids))  # (K, B, T)
    positions = masks.any(0)  # (B, T)
    tokens = window[positions]  # (M, K+2)
    return HeadTargets(positions, tokens, tokens[:, 2:].T.contiguous(), masks[:, positions])
