"""The EAGLE-3 recipe's ``draft`` section (``draft.method: eagle3``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ...draft_section import (
    AcceptWeighting,
    AcceptWeightingSection,
    DraftVocabSection,
    SlidingWindowSection,
    OpdSplit,
    accept_weighting_field,
    opd_field,
    opd_gamma_field,
)


class Eagle3DraftConfig(SlidingWindowSection, DraftVocabSection, AcceptWeightingSection):
    """EAGLE-3 (arXiv:2503.01840), ``draft.method: eagle3``: one decoder layer over the fused
    low/mid/high aux hidden states, trained with training-time test. ``draft.sliding_window``
    (:class:`~draftsmith.draft_section.SlidingWindowSection`) limits its attention to the last
    positions as vLLM serves it (docs/formats.md, "EAGLE-3 sliding window"); it is checked against
    the target's context where the target's config is read (the dry run, the training setup)."""

    method: Literal["eagle3"] = Field("eagle3", description="Draft architecture (draftsmith.methods); train it with draftsmith train or accelerate launch -m draftsmith.train.")
    norm_before_residual: bool = Field(
        True, description="Residual branch carries hidden_norm(g) (speculators) instead of g (EAGLE-3 paper)."
    )
    norm_before_fc: bool = Field(
        False, description="EAGLE-3.1: one RMSNorm (input_norm, width 3*H_target) over the concatenated aux hidden "
        "states before fc (speculators' 3.1 default: true).")
    fc_norm: bool = Field(
        False, description="EAGLE-3.1: one RMSNorm per aux hidden state (fc_norm.{0,1,2}, width H_target) before fc "
        "(speculators' 3.1 default: false; its library refuses it together with norm_before_fc, vLLM runs both).")
    norm_output: bool = Field(
        False, description="EAGLE-3.1: each TTT step (and each chained proposal in vLLM) reads the previous step's "
        "post-norm hidden norm(h) instead of h (speculators' 3.1 default: true).")
    init_from: str | None = Field(
        None, description="Warm start: an EAGLE-3 export folder (speculators format: draftsmith's or a published "
        "draft's) or a draftsmith checkpoint (checkpoints/best) to fine-tune; it must fit the target and this "
        "run's aux layer ids (checked before training). Its geometry is kept; lm_head rows move by token id.")
    init_layer_from_target: int | None = Field(
        None, description="Start the draft decoder layer from this target decoder layer (0-based; negative counts "
        "from the last, -1 = the last): its q/k/v read the fused hidden state, o_proj, MLP and norms are copied; "
        "the next-token embedding's columns keep their random start. null: random (the anchors').")
    init_fc: Literal["random", "last_aux"] = Field(
        "random", description="How fc starts: random (the anchors'), or last_aux: [0 | 0 | I], the fused hidden state "
        "starts as the highest aux hidden state (with init_layer_from_target, the draft starts as that target layer "
        "applied to the target's own late hidden state).")
    ttt_steps: int = Field(7, ge=1, le=16, description="Unrolled TTT steps K (EAGLE-3: 7).")
    gamma: float = Field(0.8, gt=0, le=1, description="TTT step k loss weight gamma**k.")
    accept_weighting: AcceptWeighting = accept_weighting_field()
    opd: OpdSplit = opd_field()
    opd_gamma: float = opd_gamma_field()

    @model_validator(mode="after")
    def _one_start(self) -> "Eagle3DraftConfig":
        if self.init_from and (self.init_layer_from_target is not None or self.init_fc != "random"):
            raise ValueError("draft.init_from (a whole trained draft) and draft.init_layer_from_target / "
                             "draft.init_fc (a start from the target) both set the draft's start: set one")
        return self
