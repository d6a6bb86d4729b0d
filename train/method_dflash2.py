"""The :class:`DFlash2Method` that ``train/dflash2.py`` runs (``draftsmith.methods`` names it).

DFlash2 trains exactly as DFlash (:mod:`draftsmith.train.method_dflash`: the same data, anchors,
slot weights and divergence) a :class:`~draftsmith.models.dflash2.model.DFlash2DraftModel`, whose
loss adds ``draft.selector_loss_alpha`` times the candidate selector's K-way cross-entropy
(:func:`~draftsmith.train.losses.dflash2_loss`, :class:`~draftsmith.train.losses.SelectorLoss`).
The draft vocab must be the target's whole vocab (vLLM 0.32 serves DFlash2 only so).
"""

from __future__ import annotations

from typing import Any

from ..models.dflash2.config import SELECTOR_KEYS, DFlash2Config
from ..models.dflash2.model import DFlash2DraftModel
from .losses import SelectorLoss
from .method_dflash import DFlashMethod


class DFlash2Method(DFlashMethod):
    """DFlash2: :class:`DFlashMethod` with the convolution / selector geometry of the recipe's
    ``draft`` section and the selector term in the loss.

    Raises (at construction):
        ValueError: as :class:`DFlashMethod`; a draft vocab smaller than the target's
            (``data.draft_vocab_size``), a ``conv_group_size`` not dividing the hidden size.
    """

    name = "dflash2"
    config_class = DFlash2Config
    model_class = DFlash2DraftModel

    def config_extra(self) -> dict[str, Any]:
        return {key: getattr(self.recipe.draft, key) for key in SELECTOR_KEYS}

    def selector_loss(self) -> SelectorLoss:
        return SelectorLoss(self.recipe.draft.selector_loss_alpha)
