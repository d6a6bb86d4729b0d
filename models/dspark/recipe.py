"""The DSpark recipe's ``draft`` section (``draft.method: dspark``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...draft_section import LossName
from ..dflash.recipe import DFlashDraftConfig


class DSparkDraftConfig(DFlashDraftConfig):
    """DSpark (``draft.method: dspark``): DFlash's block drafter plus a low-rank Markov head
    (``logits_k += W2 @ W1[previous token]``, applied left to right at inference) and a confidence
    head, served by vLLM 0.32 as ``{"method": "dspark"}`` (``Qwen3DSparkModel``, GPU only) with
    ``num_speculative_tokens = block_size``: every slot of the block, the anchor's included,
    predicts the next token. Loss (models/dspark/training.py ``dspark_loss``, after vllm-project/speculators
    PR #677): ``ce_weight * CE + distill_weight * draft.loss + confidence_weight * BCE(confidence,
    1 - TV)`` per slot, slot k weighted ``exp(-k / loss_decay_gamma)``."""

    method: Literal["dspark"] = Field("dspark", description="Draft architecture (draftsmith.methods).")
    block_size: int = Field(
        8, ge=2, le=64, description="Block B = anchor + B-1 mask slots, every slot a prediction; serve with "
        "num_speculative_tokens = B (vLLM's default for DSpark).")
    markov_rank: int = Field(32, ge=1, le=1024, description="Rank r of the Markov head (markov_w1 [V, r], markov_w2 [Vd, r]).")
    confidence_head: bool = Field(True, description="Train and export the confidence head (vLLM: enable_confidence_head; "
                                  "used only under enable_adaptive_verification).")
    confidence_head_with_markov: bool = Field(
        True, description="The confidence head reads cat(hidden, W1[previous token]) instead of the hidden state.")
    loss: LossName = Field("tv", description="Distribution term between target and Markov-corrected draft "
                           "(speculators' DSpark: tv, or forward_kl); see train/losses.py.")
    loss_decay_gamma: float | None = Field(
        4.0, gt=0, description="Slot k (k = 0..B-1) loss weight exp(-k / gamma) (speculators' DSpark: 4).")
    ce_weight: float = Field(0.1, ge=0, description="Weight of the cross-entropy on the true next token.")
    distill_weight: float = Field(0.9, ge=0, description="Weight of draft.loss against the target's distribution.")
    confidence_weight: float = Field(1.0, ge=0, description="Weight of BCE(confidence, 1 - TV) (ignored without "
                                     "a confidence head).")
