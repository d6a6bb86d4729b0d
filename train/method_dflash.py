"""The :class:`DFlashMethod` that ``train/dflash.py`` runs (``draftsmith.methods`` names it).

DFlash (z-lab, arXiv:2602.06036): block drafting from the same data EAGLE-3 trains on (aux
hidden states at vLLM aux ids, draft vocab d2t/t2d, assistant loss masks), used *unshifted*.
Each step samples up to ``draft.num_anchors`` anchors per sequence (fresh every step, from a
generator seeded by ``seed`` and the step); block slot k of anchor a is trained towards the
target's distribution ``p_{a+k-1}`` over the draft vocab (forward KL), weighted
``exp(-(k-1)/gamma)`` (SPEC_DFLASH_PEAGLE.md 2.3).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..models.dflash import DFlashConfig, DFlashDraftModel, block_labels, sample_anchors, slot_weights
from ..recipe import Recipe
from .losses import LossSpec, StepMetrics
from .method_base import DraftVocabMethod

log = logging.getLogger("draftsmith.train.dflash")


def loss_decay_gamma(block_size: int, gamma: float | None) -> float:
    """``draft.loss_decay_gamma``, or the anchors' default: 7 for blocks >= 12, else 4."""
    if gamma is not None:
        return float(gamma)
    return 7.0 if block_size >= 12 else 4.0


def dflash_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                denominator: float | None = None,
                loss: LossSpec | None = None) -> tuple[torch.Tensor, StepMetrics, float]:
    """Position-weighted divergence of the trained block slots (``loss``, ``train.loss``; None:
    forward KL).

    Args:
        logits: ``(M, Vd)`` draft logits of the M trained slots.
        teacher_logits: ``(M, Vd)`` target logits over the draft vocab of each slot's label
            position minus one (``p_{a+k-1}``).
        slots: ``(M,)`` block slot k (1..Bk-1) of each row.
        weights: ``(Bk,)`` slot weights (:func:`~draftsmith.models.dflash.slot_weights`).
        denominator: replaces the local ``sum(w_k)`` over the M slots (data parallel: the global
            sum / world size).

    Returns:
        ``(loss, StepMetrics, acceptance_length)``: ``loss = sum(w*KL) / sum(w)``; metrics per slot
        k = 1..Bk-1 (index k-1): mean KL (nats/token), argmax accuracy against the target's
        argmax, slots counted; the expected acceptance length ``1 + sum_k prod_{i<=k} acc_i``.
    """
    Bk = weights.shape[0]
    w = weights.to(logits.device)[slots]  # (M,)
    kl = (loss or LossSpec())(teacher_logits, logits)  # (M,)
    denom = denominator if denominator is not None else float(w.sum().clamp_min(1e-6))
    total = (w * kl).sum() / denom
    losses, accs, counts = [], [], []
    with torch.no_grad():
        hit = (logits.argmax(-1) == teacher_logits.argmax(-1)).float()
        for k in range(1, Bk):
            sel = slots == k
            n = int(sel.sum())
            counts.append(n)
            losses.append(float(kl[sel].mean()) if n else 0.0)
            accs.append(float(hit[sel].mean()) if n else 0.0)
    al, run = 1.0, 1.0
    for a in accs:
        run *= a
        al += run
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts), al


def teacher_for_labels(teacher: torch.Tensor, label_pos: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """The target logits each trained slot is distilled towards: ``teacher (B, T, Vd)`` (row t is
    ``p_t``, the distribution of x_{t+1}) gathered at ``label_pos - 1`` for the slots
    ``label_mask (B, A, Bk)`` selects -> ``(M, Vd)``. Slot k of anchor a predicts x_{a+k}, so its
    teacher is ``p_{a+k-1}`` (same-position labels: no EAGLE shift)."""
    b = torch.arange(teacher.shape[0], device=teacher.device)[:, None, None].expand_as(label_pos)
    return teacher[b[label_mask], label_pos[label_mask] - 1]


class DFlashMethod(DraftVocabMethod):
    """DFlash: anchor blocks over the fused aux context, forward-KL per block slot with
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

    def begin_step(self, step: int) -> None:
        """Called before every micro-batch: counts the micro-batches of one optimizer step."""
        self.micro = self.micro + 1 if step == self.step else 0
        self.step = step

    def anchor_generator(self) -> torch.Generator:
        """CPU generator of this micro-batch's anchors: seeded by ``seed``, the step, the
        micro-batch within it and the process index, so a resumed run samples the same anchors
        and micro-batches / ranks sample independently."""
        rank = self.accelerator.process_index if self.accelerator is not None else 0
        key = ((self.recipe.seed * 1_000_003 + max(self.step, 0)) * 1009 + self.micro) * 4099 + rank
        return torch.Generator().manual_seed(key)

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.target_states(batch)
        aux = aux.to(param.dtype)  # (B, T, n*Ht)
        teacher = self.target_head(final)  # (B, T, Vd), fp32: row t is p_t
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        Bk = self.config.block_size
        anchors, valid = sample_anchors(mask, self.recipe.draft.num_anchors, self.anchor_generator(), docs)
        label_pos, label_mask = block_labels(anchors, valid, mask, Bk, docs)  # (B, A, Bk)
        logits = model(batch["input_ids"], aux, anchors, valid, label_mask, batch.get("position_ids"), docs)
        teacher_sel = teacher_for_labels(teacher, label_pos, label_mask)  # (M, Vd): p_{a+k-1}
        slots = torch.arange(Bk, device=mask.device).expand_as(label_pos)[label_mask]  # (M,)
        w = self.weights.to(mask.device)
        denominator = self.global_denominators((w[slots].sum()).reshape(1))
        loss, m, al = dflash_loss(logits, teacher_sel, slots, self.weights,
                                  denominator[0] if denominator is not None else None, self.loss)
        metrics = self.step_metrics(loss, m)
        metrics["acceptance_length"] = al
        return loss, metrics
