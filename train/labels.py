"""Training labels: which positions (or sampled elements) a draft is trained on, and towards which
token, computed from a batch's loss mask (assistant tokens) and document ids. No model code: the
losses that use them are :mod:`draftsmith.train.losses`.

- EAGLE-3 (TTT) and heads: :func:`ttt_prediction_masks` (step or head k at position t predicts
  x_{t+k+2}), computed once per batch; :func:`ttt_plan` (the TTT rows as index tensors) and
  :func:`head_targets` (the heads' labels) are built from them.
- DFlash: anchors (:func:`valid_anchor_mask`, :func:`anchor_count`, :func:`sample_anchors`) and
  the same-position labels of each block slot (:func:`block_labels`).
- P-EAGLE: conditional-drop sampling of (anchor, depth) elements (:func:`cod_budget`,
  :func:`cod_sample`) and the trained elements (:func:`step0_prediction_mask`, :func:`cod_targets`).

What runs in the DataLoader (the batch plans) reads CPU tensors; what runs in a step reads nothing
on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..models.common import shift_left
from ..models.eagle3.model import ttt_prediction_mask
from ..models.peagle.model import CODElements

# --------------------------------------------------------------------------------------
# EAGLE-3 TTT steps and multi-token heads


def ttt_prediction_masks(loss_mask: torch.Tensor, steps: int,
                         document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """K ``(B, T)`` bool masks, one per TTT step (or head) k: :func:`~draftsmith.models.eagle3.ttt_prediction_mask`
    (position t's prediction of x_{t+k+2} is trained). Computed once per batch and passed to
    :func:`ttt_plan`, :func:`head_targets` and validation's simulated chains."""
    return [ttt_prediction_mask(loss_mask, k, document_ids) for k in range(steps)]


def ttt_plan(masks: list[torch.Tensor]) -> dict[str, Any]:
    """Which rows each TTT step trains on, as index tensors: run on the CPU batch (in the
    DataLoader) so that the training step gathers with indices of known size instead of boolean
    masks (which read the mask back to the host).

    Step k trains position t when ``masks[k]`` selects it (:func:`ttt_prediction_masks`, computed
    once per batch by the caller); its teacher is the target's distribution of x_{t+k+2}, i.e. the
    target's row at position t+k+1.

    Args:
        masks: K ``(B, T)`` bool prediction masks, K >= 1.

    Returns:
        ``ttt_index (sum M_k,)`` int64 flat positions ``b * T + t``, step-major (step 0's M_0 rows
        first); ``ttt_teacher_rows (N,)`` int64 flat positions whose target distribution some step
        needs (each once); ``ttt_teacher_index (sum M_k,)`` int64 the row of ``ttt_teacher_rows``
        each trained row distils from; ``ttt_counts (K,)`` int64 M_k; ``ttt_counts_host`` the same
        as a list of python ints.
    """
    B, T = masks[0].shape
    device = masks[0].device
    flat = torch.arange(B * T, device=device).view(B, T)
    need = torch.zeros(B, T + 1, dtype=torch.bool, device=device)
    for k, sel in enumerate(masks):  # row t + k + 1 (< T for every selected t)
        need[:, k + 1 : T + 1] |= sel[:, : T - k]
    need = need[:, :T]
    lookup = need.flatten().cumsum(0) - 1  # flat position -> teacher row
    index = [flat[sel] for sel in masks]
    teacher_index = [lookup[i + k + 1] for k, i in enumerate(index)]
    counts = [int(i.numel()) for i in index]
    return {"ttt_index": torch.cat(index), "ttt_teacher_rows": flat[need],
            "ttt_teacher_index": torch.cat(teacher_index), "ttt_counts": torch.tensor(counts, dtype=torch.long),
            "ttt_counts_host": counts}


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


# --------------------------------------------------------------------------------------
# DFlash anchors and block labels


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, T)`` bool: positions a with ``m[a] == 1`` and ``m[a+1] == 1`` (so a <= T-2; SpecForge's
    rule), a and a+1 in the same document for packed rows."""
    m = loss_mask.bool()
    nxt = torch.zeros_like(m)
    nxt[:, :-1] = m[:, 1:]
    ok = m & nxt
    if document_ids is not None:
        same = torch.zeros_like(m)
        same[:, :-1] = document_ids[:, 1:] == document_ids[:, :-1]
        ok = ok & same
    return ok


def anchor_count(loss_mask: torch.Tensor, num_anchors: int, document_ids: torch.Tensor | None = None) -> int:
    """``max(1, min(num_anchors, most valid anchors of any row))``: the tightest anchor width A
    for a batch. Reads the tensor: call it on the CPU batch (the method's batch plan, in the data
    loader), never on device tensors inside a step."""
    return max(1, min(int(num_anchors), int(valid_anchor_mask(loss_mask, document_ids).sum(1).max())))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None,
                   document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``num_anchors`` distinct valid anchors per row (:func:`valid_anchor_mask`),
    uniformly without replacement, sorted ascending, without reading the device: random keys on
    the valid positions, ``topk``.

    Args:
        loss_mask: ``(B, T)``.
        num_anchors: A, the anchor width (capped at T); :func:`anchor_count` gives the tightest.
        generator: RNG (seeded per step by the caller for reproducible runs), on ``loss_mask``'s
            device preferably (a CPU generator's draws are copied over).

    Returns:
        ``(anchors (B, A) long, anchor_valid (B, A) bool)`` with ``A = max(1, min(num_anchors, T))``;
        padding anchors (rows with fewer than A valid positions) are position 0 with valid False,
        after the valid ones.
    """
    valid = valid_anchor_mask(loss_mask, document_ids)  # (B, T)
    B, T = valid.shape
    A = max(1, min(int(num_anchors), T))
    where = generator.device if generator is not None else valid.device
    noise = torch.rand(B, T, generator=generator, device=where).to(valid.device, non_blocking=True)
    score = torch.where(valid, noise, torch.full_like(noise, -1.0))
    top = score.topk(A, dim=1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    # sort kept anchors ascending, padding last
    order = torch.where(keep, anchors, torch.full_like(anchors, T)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_labels(anchors: torch.Tensor, anchor_valid: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                 document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels of each block slot (no EAGLE shift).

    Returns:
        ``(label_pos (B, A, Bk) long, label_mask (B, A, Bk) bool)``: slot k of block j predicts
        the token at ``t = a_j + k`` (clamped to T-1 where invalid); it is trained when k >= 1,
        t < T, ``m[t] == 1``, t is in a_j's document and the anchor is valid. Its teacher
        distribution is the target's at t-1.
    """
    B, T = loss_mask.shape
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[..., None] + k  # (B, A, Bk)
    inside = pos < T
    pos = pos.clamp(max=T - 1)
    flat = pos.flatten(1)
    ok = inside & loss_mask.bool().gather(1, flat).view_as(pos) & anchor_valid[..., None] & (k >= 1)
    if document_ids is not None:
        ok = ok & (document_ids.gather(1, flat).view_as(pos) == document_ids.gather(1, anchors)[..., None])
    return pos, ok


# --------------------------------------------------------------------------------------
# P-EAGLE conditional-drop (COD) elements


def cod_budget(seq_len: int, num_depths: int, ratio: float, ratio_min: float,
               max_anchors: int | None = None, seed_bound: int | None = None) -> list[int]:
    """Slots reserved for depths 1, 2, ... in a row of ``seq_len`` positions (host-side numbers).

    Depth d keeps ``int(max(0, n - d) * max(ratio**d, ratio_min))`` chains for n seeds
    (:func:`cod_sample`); with n at its largest (``seq_len``, ``max_anchors``, or
    ``seed_bound``, a host-side bound on the trained positions per row) this is the number of
    slots depth d may fill. The list stops before the first depth with no slot, so
    ``seq_len + sum(cod_budget(...))`` is the element count S of :func:`cod_sample`.
    """
    n = min([seq_len] + [b for b in (max_anchors, seed_bound) if b is not None])
    out = []
    for d in range(1, num_depths):
        k = int(max(0, n - d) * max(ratio**d, ratio_min))
        if k == 0:
            break
        out.append(k)
    return out


def _random_keys(shape: tuple[int, ...], eligible: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. uniform keys in [0, 1) at eligible entries, -1 elsewhere: the ``k`` largest are a
    uniformly random k-subset of the eligible entries (``topk``: no host sync)."""
    keys = torch.rand(shape, generator=generator, device=eligible.device)
    return keys.masked_fill_(~eligible, -1.0)


def cod_sample(
    prediction_mask: torch.Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    generator: torch.Generator,
    max_anchors: int | None = None,
    document_ids: torch.Tensor | None = None,
    seed_bound: int | None = None,
) -> CODElements:
    """Conditional-drop sampling (speculators ``peagle/data.py``; docs/parallel_drafts.md), vectorised on
    ``prediction_mask``'s device: no tensor is read on the host.

    Per row: depth 0 at every position; depth d (1 <= d < D) keeps
    ``min(int(max(0, n - d) * max(ratio**d, ratio_min)), #eligible)`` chains, a uniformly random
    subset of the eligible positions: those that continue a depth-(d-1) chain one step right
    (depth 1: the seeds), that are trained (``prediction_mask``), at least d from the start, and
    in the anchor's document. n = number of seeds (trained positions, or a random subset of
    ``max_anchors`` of them).

    Layout: ``[T depth-0 slots | K_1 depth-1 slots | ... ]`` with ``K_d`` from
    :func:`cod_budget` (the count for n = T, or ``seed_bound``), so S is known on the host. Each depth's kept
    elements come first in position order; the slots a row does not fill are invalid.

    The subsets are drawn by ``topk`` over i.i.d. uniform keys from ``generator`` (a generator
    of ``prediction_mask``'s device), so the same generator state gives the same sample.

    Args:
        prediction_mask: ``(B, T)`` bool, the EAGLE-3 step-0 loss mask (position i predicts
            x_{i+2}, trained when True).
        num_depths: D (depths 0..D-1).
        ratio, ratio_min: r and r_min.
        generator: RNG on ``prediction_mask``'s device, seeded for this micro-batch.
        max_anchors: optional number of seeds (random subset of the trained positions).
        document_ids: optional ``(B, T)`` document per position (packed rows).
        seed_bound: optional host-side bound on the trained positions of any row (e.g. counted
            on the CPU batch, :class:`~draftsmith.train.method_peagle.CODPlan`): sizes the
            depth budgets to the batch instead of T (fewer empty slots, smaller S). A row with
            more would keep at most the budget.

    Returns:
        :class:`CODElements` on ``prediction_mask``'s device.
    """
    B, T = prediction_mask.shape
    dev = prediction_mask.device
    trained = prediction_mask.bool()
    if max_anchors is None or max_anchors >= T:
        seeds = trained
    else:
        val, pick = _random_keys((B, T), trained, generator).topk(max_anchors, dim=1)
        seeds = torch.zeros_like(trained).scatter_(1, pick, val >= 0)
    n = seeds.sum(1)  # (B,) seeds per row
    anchors = [torch.arange(T, device=dev).expand(B, T)]
    depths = [torch.zeros(B, T, dtype=torch.long, device=dev)]
    valids = [torch.ones(B, T, dtype=torch.bool, device=dev)]
    prev = seeds  # (B, T): positions that may take the next depth
    for d, budget in enumerate(cod_budget(T, num_depths, ratio, ratio_min, max_anchors, seed_bound), start=1):
        eligible = prev.clone()
        eligible[:, :d] = False
        if document_ids is not None:
            eligible[:, d:] &= document_ids[:, d:] == document_ids[:, :-d]
        # float64 as the host-side formula: int(max(0, n - d) * max(r**d, r_min)) exactly
        size = ((n - d).clamp_min(0).double() * max(ratio**d, ratio_min)).floor().long()  # (B,)
        val, pos = _random_keys((B, T), eligible, generator).topk(budget, dim=1)  # (B, K) by key
        slot = torch.arange(budget, device=dev)
        keep = (val >= 0) & (slot < size.unsqueeze(1))
        order = torch.where(keep, pos, T + slot).argsort(dim=1)  # kept first, in position order
        pos, keep = pos.gather(1, order), keep.gather(1, order)
        anchors.append(torch.where(keep, pos - d, torch.zeros_like(pos)))
        depths.append(keep.long() * d)
        valids.append(keep)
        chosen = torch.zeros_like(trained).scatter_(1, pos, keep)  # (B, T) positions of depth d
        prev = torch.zeros_like(trained)
        prev[:, 1:] = chosen[:, :-1] & trained[:, 1:]  # chains continue one step right
    return CODElements(torch.cat(anchors, 1), torch.cat(depths, 1), torch.cat(valids, 1), num_depths)


def step0_prediction_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The EAGLE-3 step-0 loss mask on the shifted sequence (position i predicts x_{i+2})."""
    return ttt_prediction_mask(loss_mask, 0, document_ids)


def cod_targets(elements: CODElements, prediction_mask: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` bool: the elements trained on (valid, and ``prediction_mask`` at ``pos``)."""
    return elements.valid & prediction_mask.bool().gather(1, elements.pos)
