"""The MLP speculator recipe's ``draft`` section (``draft.method: mlp_speculator``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ...draft_section import HeadsSection


class MLPSpeculatorDraftConfig(HeadsSection):
    """IBM MLP speculator (arXiv:2404.19124), ``draft.method: mlp_speculator``."""

    method: Literal["mlp_speculator"] = Field("mlp_speculator", description="Draft architecture (draftsmith.methods).")
    n_predict: int = Field(3, ge=1, le=16, description="Stages P = tokens proposed per step.")
    inner_dim: int = Field(0, ge=0, description="Width of every stage's state; 0 = the target hidden size.")
    tie_weights: bool = Field(False, description="Share emb/head/ln across stages and proj across stages >= 1 (fms-extras).")
    scale_input: bool = Field(False, description="Normalise the target hidden state before stage 0.")
    stage2_start_step: int | None = Field(
        None, ge=0, description="Optimizer step from which batches are sequences the target generates itself "
        "(stage 2); null: stage 1 (the data's own replies) throughout.",
    )
    stage2_new_tokens: int = Field(64, ge=1, description="Tokens the target generates per prompt in stage 2.")
    stage2_temperature: float = Field(0.0, ge=0, description="Stage 2 sampling temperature; 0 = greedy.")

    @model_validator(mode="after")
    def _tie_needs_stages(self) -> "MLPSpeculatorDraftConfig":
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights needs n_predict >= 2")
        return self
