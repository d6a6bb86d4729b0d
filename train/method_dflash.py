"""The :class:`DFlashMethod` that ``train/dflash.py`` runs (``draftsmith.methods`` names it).

DFlash (z-lab, arXiv:2602.06036): block drafting from the same data EAGLE-3 trains on (aux
hidden states at vLLM aux ids, draft vocab d2t/t2d, assistant loss masks), used *unshifted*.
Each step samples up to ``draft.num_anchors`` anchors per row (fresh every step, from a
generator on the batch's device seeded by ``seed``, the step, the micro-batch and the rank; a
packed row's documents share its anchors, each anchor's block staying in its document);
block slot k of anchor a is trained towards the target's distribution ``p_{a+k-1}`` over the
draft vocab (``draft.loss``, forward KL by default), weighted ``exp(-(k-1)/gamma)``
(docs/parallel_drafts.md, "DFlash: anchor blocks").

The step reads nothing from the device: anchors come from ``topk`` over random keys, every
slot of every block is a loss row weighted 0 where it is not trained, the divergence is
computed in chunks inside the draft's forward (:func:`~draftsmith.train.losses.dflash_loss`) and the
metrics are detached device scalars. Anchors and block labels: :mod:`draftsmith.train.labels`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..models.dflash.config import DFlashConfig
from ..models.dflash.model import DFlashDraftModel
from ..recipe import Recipe
from .labels import anchor_count, sample_anchors
from .losses import dflash_loss, slot_weights
from .method_base import DraftVocabMethod

log = logging.getLogger("draftsmith.train.dflash")

NUM_ANCHORS_KEY = "dflash_num_anchors"  # the batch plan's python int: the batch's anchor width A


def loss_decay_gamma(block_size: int, gamma: float | None) -> float:
    """``draft.loss_decay_gamma``, or the anchors' default: 7 for blocks >= 12, else 4."""
    if gamma is not None:
        return float(gamma)
    return 7.0 if block_size >= 12 else 4.0


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
    config_class: type[DFlashConfig] = DFlashConfig
    model_class: type[DFlashDraftModel] = DFlashDraftModel

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        mask_id = self.mask_token_id()
        draft = recipe.draft
        self.config = self.config_class.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]), aux_layer_ids=self.target_info["aux_layer_ids"],
            num_layers=draft.num_layers, block_size=draft.block_size, mask_token_id=mask_id,
            **self.config_extra())
        self.gamma = loss_decay_gamma(draft.block_size, draft.loss_decay_gamma)
        self.weights = slot_weights(draft.block_size, self.gamma)
        self.step, self.micro = -1, 0
        log.info("dflash: %d layers, block %d, mask token %d, gamma %g", draft.num_layers, draft.block_size,
                 mask_id, self.gamma)

    def config_extra(self) -> dict[str, Any]:
        """Further config fields from the recipe (a DFlash-family subclass's; none here)."""
        return {}

    def build_model(self) -> DFlashDraftModel:
        return self.init_draft(self.model_class(self.config))

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
        aux, final = self.training_states(model, batch)  # (B, T, n*Ht)
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        T = mask.shape[1]
        width = batch.get(NUM_ANCHORS_KEY)  # the plan's tight A; else the cap (padding anchors cost compute only)
        num_anchors = width if width is not None else min(self.recipe.draft.num_anchors, max(T - 1, 1))
        anchors, valid = sample_anchors(mask, num_anchors, self.anchor_generator(mask.device), docs)
        return dflash_loss(model, batch["input_ids"], aux, final, mask, anchors, valid, self.target_head, self.weights,
                           self.loss, batch.get("position_ids"), docs, self.global_denominators,
                           self.recipe.train.loss_chunk_rows, selector=self.selector_loss())

    def selector_loss(self) -> Any:
        """The candidate-selector term of the loss (:class:`~draftsmith.train.losses.SelectorLoss`),
        or None: DFlash has none."""
        return None
