"""The MTP recipe's ``draft`` section (``draft.method: mtp``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ...draft_section import DraftSection, LossName


class MTPDraftConfig(DraftSection):
    """The target's own multi-token-prediction layer, fine-tuned (``draft.method: mtp``; targets
    that ship one: DeepSeek-V3 / R1 ``num_nextn_predict_layers``, Qwen3-Next ``mtp_num_hidden_layers``)."""

    method: Literal["mtp"] = Field("mtp", description="Draft architecture (draftsmith.methods); fine-tunes the MTP layer the target ships.")
    init_from_target: bool = Field(
        True, description="Start from the MTP layer's weights in the target checkpoint (false: random, an ablation).")
    ttt_steps: int = Field(
        1, ge=1, le=8, description="Steps K the layer is unrolled in training, as vLLM reuses it for "
        "num_speculative_tokens = K (step k reads step k-1's output).")
    gamma: float = Field(0.8, gt=0, le=1, description="Step k loss weight gamma**k.")
    loss: LossName = Field("forward_kl", description="Divergence against the target's distribution (train/losses.py).")
    lk_kl_scale: float = Field(1.0, ge=0, description="lk_lambda: KL weight at zero acceptance.")
    lk_kl_decay: float = Field(3.0, ge=0, description="lk_lambda: KL weight decays as exp(-lk_kl_decay * acceptance).")
    distill_temperature: float = Field(
        1.0, gt=0, description="The target's logits are divided by this before the softmax of the training "
        "distribution (target side only).")
    gradient_checkpointing: bool = Field(
        False, description="Not available for MTP (must stay false): the unrolled steps share one attention "
        "cache, which a recomputed block would see in its final state; lower train.batch_size instead.")

    @model_validator(mode="after")
    def _no_checkpointing(self) -> "MTPDraftConfig":
        if self.gradient_checkpointing:
            raise ValueError("gradient_checkpointing is not available for draft.method mtp: its unrolled steps share "
                             "one attention cache that a recomputed layer would see in its final state; lower "
                             "train.batch_size or data.max_length instead")
        return self
