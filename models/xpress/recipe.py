"""The XPress recipe's ``draft`` section (``draft.method: xpress``; torch-free)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from ...draft_section import LossName
from ..dflash.recipe import DFlashDraftConfig

LossTerm = Literal[("ce", *get_args(LossName))]  # type: ignore[valid-type]
"""A term of ``draft.loss_weights``: ``ce`` (cross-entropy against the target's argmax) or one of
``draft.loss``'s divergences (``train/losses.py``)."""


class XPressDraftConfig(DFlashDraftConfig):
    """XPress (``draft.method: xpress``, docs/xpress.md): a DFlash block drafter plus a causal
    low-rank refiner that adds a logit bias to every block slot from the token before it, the
    slot's hidden state and the block's mean hidden state, mixed causally across the block. At
    inference the block is resolved by ``num_jacobi_passes`` parallel Jacobi passes. vLLM 0.33
    serves it as ``{"method": "dflash"}`` with architecture ``Qwen3XPressModel`` (GPU only);
    it drafts over the target's whole vocab with the target's frozen ``lm_head``.

    Loss (after speculators 0.9's XPress): ``L(refined, teacher-forced) + consistency_weight *
    mean_j L(refined, Jacobi round j) + base_anchor_weight * L(drafter alone)``, each ``L`` the
    ``loss_weights`` mix per slot, slot k weighted ``exp(-(k-1)/gamma)``, summed over the trained
    slots and divided by their number."""

    method: Literal["xpress"] = Field("xpress", description="Draft architecture (draftsmith.methods).")
    loss_decay_gamma: float | None = Field(
        4.0, gt=0, description="Slot k (k = 1..B-1) loss weight exp(-(k-1) / gamma) (speculators' XPress: 4 at "
        "every block size); null: DFlash's rule (7 for block_size >= 12, else 4).")
    xpress_rank: int = Field(256, ge=1, le=4096, description="Rank r of the refiner (its token embedding, "
                             "projections, mixer and MLP work in r dimensions; speculators: 256).")
    xpress_mlp_ratio: int = Field(2, ge=1, le=16, description="Refiner SwiGLU width = r * ratio (speculators: 2).")
    num_jacobi_passes: int = Field(6, ge=0, le=64, description="Parallel refine passes K at inference "
                                   "(vLLM's xpress_num_passes; 0: the drafter's argmax). Not used in training.")
    xpress_topc: int = Field(512, ge=0, description="At inference each pass re-ranks only the drafter's top-C "
                             "tokens of a slot (vLLM's xpress_topc, default 512); 0: the whole vocab.")
    loss_weights: dict[LossTerm, float] = Field(
        default_factory=lambda: {"ce": 0.1, "tv": 0.9},
        description="Per-slot loss mix: ce (cross-entropy against the target's argmax) and divergences of "
        "draft.loss's list (train/losses.py) with their weights (speculators' XPress: {ce: 0.1, tv: 0.9}).")
    consistency_weight: float = Field(0.3, ge=0, description="Weight of the Jacobi consistency term: the mean "
                                      "loss of consistency_passes free-running refine rounds (0: off).")
    consistency_passes: int = Field(3, ge=0, le=16, description="Free-running rounds of the consistency term: "
                                    "round 1 conditions on the drafter's argmax, round j on round j-1's, "
                                    "no gradient through the argmax.")
    base_anchor_weight: float = Field(0.6, ge=0, description="Weight of the loss of the drafter's own logits "
                                      "(keeps the Jacobi seed from drifting while the refiner trains).")
    base_anchor_full_weight: bool = Field(False, description="The drafter term weighs every trained slot 1 "
                                          "(no position decay).")

    @model_validator(mode="after")
    def _xpress_loss_and_head(self) -> "XPressDraftConfig":
        if self.loss != "forward_kl":
            raise ValueError(f"draft.loss={self.loss}: xpress trains on draft.loss_weights (e.g. {{ce: 0.1, "
                             f"{self.loss}: 0.9}}), not draft.loss")
        if not self.loss_weights or any(w < 0 for w in self.loss_weights.values()) \
                or sum(self.loss_weights.values()) <= 0:
            raise ValueError(f"draft.loss_weights={self.loss_weights}: give at least one term a positive weight, "
                             "none a negative one")
        if not (self.init_lm_head_from_target and self.freeze_lm_head):
            raise ValueError("xpress drafts with the target's own lm_head (speculators reloads it from the "
                             "target): set draft.init_lm_head_from_target and draft.freeze_lm_head to true")
        return self
