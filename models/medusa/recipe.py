"""The Medusa recipe's ``draft`` section (``draft.method: medusa``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...draft_section import HeadsSection


class MedusaDraftConfig(HeadsSection):
    """Medusa-1 heads (arXiv:2401.10774), ``draft.method: medusa``."""

    method: Literal["medusa"] = Field("medusa", description="Draft architecture (draftsmith.methods).")
    num_heads: int = Field(3, ge=1, le=16, description="Heads K; head k predicts x_{t+k+2} (vLLM: K >= num_speculative_tokens).")
    num_layers: int = Field(1, ge=1, le=8, description="ResBlocks per head (Medusa-1: 1).")
    init_from_target: bool = Field(True, description="Start every head's lm_head from the target lm_head (Medusa's init).")
