"""The :class:`PEagleMethod` that ``train/peagle.py`` runs (``draftsmith.methods`` names it).

P-EAGLE (arXiv:2602.01469; SPEC_DFLASH_PEAGLE.md section 3.3): the EAGLE-3 data (aux states,
draft vocab, loss mask) on the EAGLE-shifted sequence, conditional-drop (COD) sampling of mask
chains re-drawn every step from a generator seeded with ``seed + step``, one forward over all
sampled elements, forward KL to the target over the draft vocab at ``anchor + depth`` (no
depth decay, depth 0 included). No TTT: vLLM never feeds draft states back.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..models.eagle3 import Eagle3Config, shift_left
from ..models.peagle import PEagleConfig, PEagleDraftModel, cod_sample, cod_targets, step0_prediction_mask
from ..recipe import Recipe
from .losses import LossSpec, StepMetrics
from .method_base import DraftVocabMethod

log = logging.getLogger("draftsmith.train.peagle")


def cod_loss(logits: torch.Tensor, target_logits: torch.Tensor, depth: torch.Tensor, num_depths: int,
             denominator: float | None = None, loss: LossSpec | None = None) -> tuple[torch.Tensor, StepMetrics]:
    """``sum_s D(p_{pos_s + 1} || q_s) / N`` over the trained elements, D the divergence ``loss``
    (``train.loss``; None: forward KL).

    Args:
        logits: ``(M, Vd)`` draft logits of the M trained elements.
        target_logits: ``(M, Vd)`` target logits at ``pos + 1`` (the distribution of x_{pos+2}).
        depth: ``(M,)`` element depths (for the per-depth metrics).
        num_depths: D, the number of per-depth metric slots.
        denominator: replaces M (data parallel: global count / world size).

    Returns:
        ``(loss, StepMetrics)`` with per-depth divergence, argmax accuracy (draft vs target argmax over
        the draft vocab) and element counts.
    """
    M = logits.shape[0]
    if M == 0:
        return logits.sum() * 0.0, StepMetrics([0.0] * num_depths, [0.0] * num_depths, [0] * num_depths)
    kl = (loss or LossSpec())(target_logits, logits)  # (M,)
    total = kl.sum() / (denominator if denominator is not None else M)
    losses, accs, counts = [], [], []
    with torch.no_grad():
        hit = logits.argmax(-1) == target_logits.argmax(-1)
        for d in range(num_depths):
            sel = depth == d
            n = int(sel.sum())
            counts.append(n)
            losses.append(float(kl[sel].mean()) if n else 0.0)
            accs.append(float(hit[sel].float().mean()) if n else 0.0)
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts)


def expected_acceptance_length(acc: list[float]) -> float:
    """``1 + sum_d prod_{j<=d} acc_j``: the acceptance length the per-depth accuracies imply."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


class PEagleMethod(DraftVocabMethod):
    """P-EAGLE: COD chains of mask slots on the EAGLE-3 data, forward-KL loss."""

    name = "peagle"

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        draft = recipe.draft
        base = Eagle3Config.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]), aux_layer_ids=self.target_info["aux_layer_ids"],
            norm_before_residual=draft.norm_before_residual)
        mask_id = self.mask_token_id()
        log.info("P-EAGLE mask token id %d (never occurs in %s)", mask_id, self.paths.tokenized)
        self.config = PEagleConfig.from_eagle3(base, num_layers=draft.num_layers, num_depths=draft.num_depths,
                                               mask_token_id=mask_id, train_embeddings=draft.train_embeddings)
        self._step, self._generator = None, torch.Generator()

    def build_model(self) -> PEagleDraftModel:
        torch.manual_seed(self.recipe.seed)  # mask_hidden's randn init
        return self.init_draft(PEagleDraftModel(self.config))

    def begin_step(self, step: int) -> None:
        """COD samples are re-drawn every optimizer step from ``seed + step`` (a resumed run
        draws the same); micro-batches of one step continue the same generator."""
        if step != self._step:
            self._step = step
            self._generator = torch.Generator().manual_seed(self.recipe.seed + step)

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.target_states(batch)
        aux = aux.to(param.dtype)  # (B, T, 3H)
        docs = batch.get("document_ids")
        pred = step0_prediction_mask(batch["loss_mask"], docs)  # (B, T): position i predicts x_{i+2}
        d = self.recipe.draft
        elements = cod_sample(pred, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min, self._generator,
                              d.max_anchors, docs)
        sel = cod_targets(elements, pred)  # (B, S)
        logits = model(batch["input_ids"], aux, elements, batch.get("position_ids"), docs, select=sel)  # (M, Vd)
        teacher = self.target_head(shift_left(final, 1))  # (B, T, Vd): distribution of x_{i+2}
        pos = elements.pos
        target = teacher.gather(1, pos.unsqueeze(-1).expand(-1, -1, teacher.shape[-1]))[sel]
        denominators = self.global_denominators(sel.sum().view(1))
        loss, m = cod_loss(logits, target, elements.depth[sel], d.num_depths,
                           denominators[0] if denominators else None, self.loss)
        metrics = self.step_metrics(loss, m)
        metrics["expected_al"] = expected_acceptance_length(m.acc) if m.tokens[0] else 0.0
        return loss, metrics
