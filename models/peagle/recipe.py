"""The P-EAGLE recipe's ``draft`` section (``draft.method: peagle``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...draft_section import (
    AcceptWeighting,
    AcceptWeightingSection,
    DraftVocabSection,
    OpdSplit,
    accept_weighting_field,
    opd_field,
    opd_gamma_field,
)


class PEagleDraftConfig(DraftVocabSection, AcceptWeightingSection):
    """P-EAGLE parallel drafting (arXiv:2602.01469), ``draft.method: peagle``: an EAGLE-3 head
    of ``num_layers`` layers that drafts ``num_depths`` tokens in one forward pass (mask
    tokens with a learned ``mask_hidden`` in the raw aux space), trained on conditional-drop
    (COD) chains. Served by vLLM as ``{"method": "eagle3", "parallel_drafting": true}`` with
    ``num_speculative_tokens <= num_depths``."""

    method: Literal["peagle"] = Field("peagle", description="Draft architecture (draftsmith.methods).")
    num_layers: int = Field(2, ge=1, le=16, description="Decoder layers (layer 0 reads cat(embed, fc(aux)); the paper: 4).")
    num_depths: int = Field(4, ge=2, le=16, description="Parallel depths D trained (serve K <= D).")
    down_sample_ratio: float = Field(0.7, gt=0, le=1, description="COD: depth d keeps a fraction r**d of the chains.")
    down_sample_ratio_min: float = Field(0.2, ge=0, le=1, description="COD: the kept fraction never falls below this.")
    max_anchors: int | None = Field(None, ge=1, description="COD seeds per sequence (random subset); null: every valid position.")
    mask_token_id: int | None = Field(
        None, ge=0, description="Token id of the mask slots (vLLM: pard_token); same rule as dflash's.")
    accept_weighting: AcceptWeighting = accept_weighting_field()
    opd: OpdSplit = opd_field()
    opd_gamma: float = opd_gamma_field()
    norm_before_residual: bool = Field(False, description="Residual branch carries hidden_norm(g) (always written to the export).")
    train_embeddings: bool = Field(
        False, description="Train and export embed_tokens (the paper and speculators do); false: the target's "
        "embedding, frozen, and only mask_hidden adapts the mask slots.")
    init_from: str | None = Field(
        None, description="Warm start: a P-EAGLE export folder (speculators format: draftsmith's or a speculators "
        "library peagle checkpoint) or a draftsmith checkpoint (checkpoints/best) to fine-tune; it must fit the "
        "target and this run's aux layer ids (checked before training). Its geometry, layer count and trained "
        "embedding are kept, its mask token unless draft.mask_token_id is set; lm_head rows move by token id.")
