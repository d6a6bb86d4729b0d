"""The DFlash2 recipe's ``draft`` section (``draft.method: dflash2``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..dflash.recipe import DFlashDraftConfig


class DFlash2DraftConfig(DFlashDraftConfig):
    """DFlash2 (z-lab DFlash2), ``draft.method: dflash2``: a DFlash draft whose layers wrap
    attention and MLP in block-local grouped dynamic convolutions, plus a low-rank candidate
    selector re-ranking the head's top-K per slot by the previous token; trained with the DFlash
    loss + ``selector_loss_alpha`` x the selector's K-way cross-entropy (docs/dflash2.md). vLLM
    0.32 serves it as ``{"method": "dflash"}`` (architecture DFlash2DraftModel) on GPU only (its
    V2 model runner); it needs ``data.draft_vocab_size`` = the target's vocab size."""

    method: Literal["dflash2"] = Field("dflash2", description="Draft architecture (draftsmith.methods).")
    conv_kernel_size: int = Field(2, ge=1, le=16, description="Taps T of each grouped convolution (z-lab: 2).")
    conv_group_size: int = Field(
        64, ge=1, description="Channels per dynamic coefficient group; must divide the target's hidden size.")
    selector_rank: int = Field(256, ge=1, description="Rank r of the selector's [V, r] codebooks (z-lab: 256).")
    selector_top_k: int = Field(16, ge=1, description="Candidates K per slot the selector re-ranks (z-lab: 16).")
    selector_loss_alpha: float = Field(
        1.0, ge=0, description="Weight of the selector's K-way cross-entropy added to the DFlash loss "
        "(speculators / SpecForge: 1.0).")
