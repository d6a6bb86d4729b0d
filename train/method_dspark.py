"""The :class:`DSparkMethod` that ``train/dspark.py`` runs (``draftsmith.methods`` names it).

DSpark = DFlash's block drafter (:mod:`draftsmith.train.method_dflash`: the same data, anchors,
mask token and batch plan) + a Markov head + a confidence head. Block slot k of anchor a (k =
0..Bk-1, the anchor slot included) is trained towards ``x_{a+k+1}`` / ``p_{a+k}`` with the
Markov bias of the true previous token ``x_{a+k}``, weighted ``exp(-k/gamma)``
(:func:`~draftsmith.train.losses.dspark_loss`, after vllm-project/speculators PR #677).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..models.dspark.config import DSparkConfig
from ..models.dspark.model import DSparkDraftModel
from ..recipe import Recipe
from .labels import sample_anchors
from .losses import DSparkLossSpec, dspark_loss, dspark_slot_weights
from .method_dflash import NUM_ANCHORS_KEY, DFlashMethod

log = logging.getLogger("draftsmith.train.dspark")


class DSparkMethod(DFlashMethod):
    """DSpark: DFlash's anchor blocks, every slot a next-token prediction, Markov-corrected logits,
    the loss of :func:`~draftsmith.train.losses.dspark_loss`.

    Raises (at construction): as :class:`~draftsmith.train.method_dflash.DFlashMethod`.
    """

    name = "dspark"

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        draft = recipe.draft
        self.config = DSparkConfig(**self.config.to_dict(), markov_rank=draft.markov_rank,
                                   confidence_head=draft.confidence_head,
                                   confidence_head_with_markov=draft.confidence_head_with_markov)
        self.weights = dspark_slot_weights(draft.block_size, self.gamma)
        self.spec = DSparkLossSpec.from_recipe(draft)
        log.info("dspark: markov rank %d, confidence head %s, loss %.2g*CE + %.2g*%s + %.2g*BCE", draft.markov_rank,
                 draft.confidence_head, draft.ce_weight, draft.distill_weight, draft.loss, draft.confidence_weight)

    def build_model(self) -> DSparkDraftModel:
        return self.init_draft(DSparkDraftModel(self.config))

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.training_states(model, batch)  # draft.aux_noise_std applies here too
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        width = batch.get(NUM_ANCHORS_KEY)
        num_anchors = width if width is not None else min(self.recipe.draft.num_anchors, max(mask.shape[1] - 1, 1))
        anchors, valid = sample_anchors(mask, num_anchors, self.anchor_generator(mask.device), docs)
        return dspark_loss(model, batch["input_ids"], aux.to(param.dtype), final, mask, anchors, valid,
                           self.target_head, self.t2d, self.weights, self.spec, batch.get("position_ids"), docs,
                           self.global_denominators, self.recipe.train.loss_chunk_rows)
