"""The :class:`DFlashMethod` that ``train/dflash.py`` runs (``draftsmith.methods`` names it).

DFlash (z-lab, arXiv:2602.06036): block drafting from the same data EAGLE-3 trains on (aux
hidden states at vLLM aux ids, draft vocab d2t/t2d, assistant loss masks), used *unshifted*.
Each step samples up to ``draft.num_anchors`` anchors per sequence (fresh every step, from a
generator on the batch's device seeded by ``seed``, the step, the micro-batch and the rank);
block slot k of anchor a is trained towards the target's distribution ``p_{a+k-1}`` over the
draft vocab (``draft.loss``, forward KL by default), weighted ``exp(-(k-1)/gamma)``
(docs/parallel_drafts.md, "DFlash: anchor blocks").

The step reads nothing from the device: anchors come from ``topk`` over random keys, every
slot of every block is a loss row weighted 0 where it is not trained, the divergence is
computed in chunks inside the draft's forward (:class:`~draftsmith.models.common.DistillTargets`,
:func:`~draftsmith.train.losses.chunked_distill`) and the metrics are detached device scalars.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models.dflash.config import DFlashConfig
from ..models.dflash.model import DFlashDraftModel, anchor_count, block_labels, sample_anchors, slot_weights
from ..models.common import DistillTargets
from ..recipe import Recipe
from .losses import chunked_distill
from .method_base import DraftVocabMethod

log = logging.getLogger("draftsmith.train.dflash")

NUM_ANCHORS_KEY = "dflash_num_anchors"  # the batch plan's python int: the batch's anchor width A


def loss_decay_gamma(block_size: int, gamma: float | None) -> float:
    """``draft.loss_decay_gamma``, or the anchors' default: 7 for blocks >= 12, else 4."""
    if gamma is not None:
        return float(gamma)
    return 7.0 if block_size >= 12 else 4.0


def teacher_rows(final: torch.Tensor, label_pos: torch.Tensor, head: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target logits the block slots are distilled towards, computed once per batch.

    Slot k of anchor a predicts x_{a+k}, so its teacher is ``p_{a+k-1}`` = ``head(final[a+k-1])``
    (same-position labels: no EAGLE shift). The head runs on whichever row set is smaller (both
    sizes are known on the host): every position (``B*T`` rows) or the ``B*A*(Bk-1)`` slot rows.

    Args:
        final: ``(B, T, Ht)`` the target's final (normed) hidden states.
        label_pos: ``(B, A, Bk)`` label positions (:func:`~draftsmith.models.dflash.model.block_labels`).
        head: ``(..., Ht) -> (..., Vd)`` the target head over the draft vocab.

    Returns:
        ``(teacher (N, Vd), teacher_index (B, A, Bk) long)``; slot 0's index is a valid row
        (the anchor is never trained).
    """
    B, T, _ = final.shape
    _, A, Bk = label_pos.shape
    prev = (label_pos - 1).clamp_min(0)  # (B, A, Bk): p_{t-1} for the label at t
    if A * (Bk - 1) < T:
        rows = final.gather(1, prev[:, :, 1:].reshape(B, -1, 1).expand(-1, -1, final.shape[-1]))  # (B, A*(Bk-1), Ht)
        teacher = head(rows.reshape(B * A * (Bk - 1), -1))
        index = torch.arange(B * A * (Bk - 1), device=label_pos.device).view(B, A, Bk - 1)
        index = torch.cat([index[:, :, :1], index], dim=2)  # slot 0: any valid row
    else:
        teacher = head(final.reshape(B * T, -1))
        index = torch.arange(B, device=label_pos.device)[:, None, None] * T + prev
    return teacher, index


def slot_metrics(row_loss: torch.Tensor, row_hit: torch.Tensor, trained: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot means over the trained rows, as detached 0-dim tensors (no host read).

    Args:
        row_loss / row_hit: ``(B, A, Bk-1)`` per-row divergence and argmax match of slots 1..Bk-1.
        trained: ``(B, A, Bk-1)`` bool.

    Returns:
        ``loss_{k-1}`` / ``acc_{k-1}`` for slot k = 1..Bk-1 (0 where a slot has no trained row)
        and ``acceptance_length = 1 + sum_k prod_{i<=k} acc_i`` (a slot without rows stops the chain).
    """
    w = trained.float().flatten(0, 1)  # (B*A, Bk-1)
    count = w.sum(0)  # (Bk-1,)
    denom = count.clamp_min(1.0)
    loss = (row_loss.flatten(0, 1) * w).sum(0) / denom
    acc = (row_hit.flatten(0, 1) * w).sum(0) / denom
    out: dict[str, torch.Tensor] = {}
    for k in range(loss.shape[0]):  # over the host-known slot count: views, no reads
        out[f"loss_{k}"], out[f"acc_{k}"] = loss[k].detach(), acc[k].detach()
    out["acceptance_length"] = (1.0 + acc.cumprod(0).sum()).detach()
    return out


def dflash_step(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, head: Any,
                weights: torch.Tensor, loss: Any = None, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                global_denominators: Callable[[torch.Tensor], Any] | None = None,
                chunk_size: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One DFlash loss over given anchors, without host reads.

    Args:
        model: the :class:`~draftsmith.models.dflash.model.DFlashDraftModel` (possibly wrapped).
        input_ids / loss_mask / position_ids / document_ids: ``(B, T)`` the batch.
        aux: ``(B, T, n*Ht)`` aux states in the draft's dtype; final: ``(B, T, Ht)`` the
            target's final hidden states.
        anchors / anchor_valid: ``(B, A)`` (:func:`~draftsmith.models.dflash.model.sample_anchors`).
        head: the target head over the draft vocab (``TargetDraftHead``).
        weights: ``(Bk,)`` slot weights (:func:`~draftsmith.models.dflash.model.slot_weights`).
        loss: ``draft.loss`` (``LossSpec``); None: forward KL.
        global_denominators: data parallel: ``(1,)`` local weight sum -> the global sum over the
            world size (a device tensor), or None on one process.
        chunk_size: rows per loss chunk (default: ``chunk_rows`` of Vd).

    Returns:
        ``(loss, metrics)``: ``loss = sum(w * D) / sum(w)`` over the trained slots; metrics
        ``loss``, ``loss_{k-1}`` / ``acc_{k-1}`` per slot k, ``acceptance_length``
        (:func:`slot_metrics`), all detached 0-dim tensors.
    """
    Bk = weights.shape[0]
    B, A = anchors.shape
    label_pos, label_mask = block_labels(anchors, anchor_valid, loss_mask, Bk, document_ids)  # (B, A, Bk)
    teacher, teacher_index = teacher_rows(final, label_pos, head)  # p_{a+k-1}
    weight = weights.to(loss_mask.device) * label_mask  # (B, A, Bk), 0 where not trained
    out = model(input_ids, aux, anchors, anchor_valid, position_ids=position_ids, document_ids=document_ids,
                targets=DistillTargets(teacher_index=teacher_index[:, :, 1:], weight=weight[:, :, 1:], teacher=teacher,
                                       distill=chunked_distill, loss=loss, chunk_size=chunk_size))
    local = weight.sum()
    denominator = global_denominators(local.reshape(1)) if global_denominators is not None else None
    total = out.loss_sum / (denominator[0] if denominator is not None else local.clamp_min(1e-6))
    rows = (B, A, Bk - 1)
    metrics = {"loss": total.detach()}
    metrics.update(slot_metrics(out.row_loss.view(rows), out.row_hit.view(rows), label_mask[:, :, 1:]))
    return total, metrics


class AnchorCountPlan:
    """The DFlash batch plan (run on each collated CPU batch in the data loader): the batch plus
    its anchor width ``A = max(1, min(num_anchors, most valid anchors of any row))`` as a python
    int under :data:`NUM_ANCHORS_KEY`, so the step needs no device read to size its anchors
    (without it the step uses ``min(num_anchors, T - 1)``: more padding anchors, same loss).
    Picklable."""

    def __init__(self, num_anchors: int):
        self.num_anchors = int(num_anchors)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {**batch, NUM_ANCHORS_KEY: anchor_count(batch["loss_mask"], self.num_anchors,
                                                       batch.get("document_ids"))}


class DFlashMethod(DraftVocabMethod):
    """DFlash: anchor blocks over the fused aux context, ``draft.loss`` per block slot with
    exponential position decay, against the target distribution over the draft vocab.

    Raises (at construction, i.e. at train start):
        MaskTokenError: ``draft.mask_token_id`` occurs in ``RUN_DIR/data/tokenized`` (or none is free).
        ValueError: aux layer ids invalid for the target; a vocab built for another target.
    """

    name = "dflash"

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        mask_id = self.mask_token_id()
        draft = recipe.draft
        self.config = DFlashConfig.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]), aux_layer_ids=self.target_info["aux_layer_ids"],
            num_layers=draft.num_layers, block_size=draft.block_size, mask_token_id=mask_id)
        self.gamma = loss_decay_gamma(draft.block_size, draft.loss_decay_gamma)
        self.weights = slot_weights(draft.block_size, self.gamma)
        self.step, self.micro = -1, 0
        log.info("dflash: %d layers, block %d, mask token %d, gamma %g", draft.num_layers, draft.block_size,
                 mask_id, self.gamma)

    def build_model(self) -> DFlashDraftModel:
        return self.init_draft(DFlashDraftModel(self.config))

    def batch_plan(self) -> AnchorCountPlan:
        return AnchorCountPlan(self.recipe.draft.num_anchors)

    def begin_step(self, step: int) -> None:
        """Called before every micro-batch: counts the micro-batches of one optimizer step."""
        self.micro = self.micro + 1 if step == self.step else 0
        self.step = step

    def anchor_seed(self) -> int:
        """The seed of this micro-batch's anchors: ``seed``, the step, the micro-batch within it
        and the process index, so a resumed run samples the same anchors and micro-batches /
        ranks sample independently."""
        rank = self.accelerator.process_index if self.accelerator is not None else 0
        return ((self.recipe.seed * 1_000_003 + max(self.step, 0)) * 1009 + self.micro) * 4099 + rank

    def anchor_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on ``device`` seeded with :meth:`anchor_seed` (host-side seeding)."""
        return torch.Generator(device=device).manual_seed(self.anchor_seed())

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.target_states(batch)
        aux = aux.to(param.dtype)  # (B, T, n*Ht)
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        T = mask.shape[1]
        width = batch.get(NUM_ANCHORS_KEY)  # the plan's tight A; else the cap (padding anchors cost compute only)
        num_anchors = width if width is not None else min(self.recipe.draft.num_anchors, max(T - 1, 1))
        anchors, valid = sample_anchors(mask, num_anchors, self.anchor_generator(mask.device), docs)
        return dflash_step(model, batch["input_ids"], aux, final, mask, anchors, valid, self.target_head, self.weights,
                           self.loss, batch.get("position_ids"), docs, self.global_denominators,
                           self.recipe.train.loss_chunk_rows)
