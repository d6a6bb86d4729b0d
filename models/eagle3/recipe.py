"""The EAGLE-3 recipe's ``draft`` section (``draft.method: eagle3``; torch-free)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

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

#: ``draft.layer`` -> the vLLM 0.32 module (and class) that serves an EAGLE-3 draft with that
#: decoder layer (docs/formats.md, "EAGLE-3 draft layers").
DRAFT_LAYERS = {
    "llama": ("llama_eagle3", "Eagle3LlamaForCausalLM"),
    "qwen3": ("qwen3_eagle3", "Eagle3Qwen3ForCausalLM"),
    "mla": ("deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM"),
}



def layer_option_problem(layer: str, prefix: str = "draft.", *, norm_before_fc: bool = False,
                         sliding_window: int | None = None, attention_bias: bool = False, mlp_bias: bool = False,
                         hidden_act: str = "silu") -> str | None:
    """The one line saying why vLLM cannot serve an EAGLE-3 draft whose decoder layer is ``layer``
    with these options, or None when it can: vLLM's ``deepseek_eagle3`` builds no ``input_norm``
    (``norm_before_fc``), reads no ``layer_types`` (a sliding window) and has no attention or MLP
    biases; ``qwen3_eagle3``'s MLP has no biases; both MLPs run SiLU only (vLLM's ``Qwen2MLP`` /
    ``DeepseekV2MLP`` refuse another activation).

    Args:
        prefix: put before the option names in the line (``draft.`` for the recipe's keys, empty
            for an export's ``config.json`` keys).
    """
    served = f"vLLM's {DRAFT_LAYERS[layer][0]} ({prefix}layer {layer})" if layer in DRAFT_LAYERS else layer
    if layer == "mla" and norm_before_fc:
        return (f"{prefix}norm_before_fc=true: {served} has no input_norm before fc; set {prefix}norm_before_fc "
                f"false (it serves fc_norm and norm_output) or {prefix}layer llama / qwen3")
    if layer == "mla" and sliding_window is not None:
        return (f"{prefix}sliding_window={sliding_window}: {served} attends the whole context (it reads no "
                f"layer_types); set {prefix}sliding_window null or {prefix}layer llama / qwen3")
    if layer == "mla" and attention_bias:
        return f"attention_bias=true: {served} has no attention biases; use {prefix}layer llama or qwen3"
    if layer in ("qwen3", "mla") and mlp_bias:
        return f"mlp_bias=true: {served} has no MLP biases; use {prefix}layer llama"
    if layer in ("qwen3", "mla") and hidden_act != "silu":
        return f"hidden_act={hidden_act!r}: {served} runs SiLU MLPs only; use {prefix}layer llama"
    return None


class MlaGeometry(BaseModel):
    """``draft.mla``: the MLA draft layer's geometry, each key the target's own value when null."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    q_lora_rank: int | None = Field(
        None, ge=1, description="Rank of the query's low-rank projection (q_a_proj -> q_a_layernorm -> q_b_proj); "
        "null: the target's. Required for a target without one (DeepSeek-V2-Lite): vLLM 0.32's deepseek_eagle3 "
        "loads only the low-rank query layout.")
    kv_lora_rank: int | None = Field(
        None, ge=1, description="Width of the compressed key/value latent (kv_a_proj_with_mqa -> kv_a_layernorm -> "
        "kv_b_proj); null: the target's.")
    qk_nope_head_dim: int | None = Field(
        None, ge=1, description="Per-head query/key channels without RoPE; null: the target's.")
    qk_rope_head_dim: int | None = Field(
        None, ge=2, multiple_of=2, description="Per-head query/key channels with RoPE (one key part shared by all "
        "heads); null: the target's.")
    v_head_dim: int | None = Field(None, ge=1, description="Per-head value channels; null: the target's.")


class Eagle3DraftConfig(SlidingWindowSection, DraftVocabSection, AcceptWeightingSection):
    """EAGLE-3 (arXiv:2503.01840), ``draft.method: eagle3``: ``num_layers`` decoder layers (one) over the fused
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
    layer: Literal["llama", "qwen3", "mla"] = Field(
        "llama", description="The draft decoder layer, each the one a vLLM EAGLE-3 draft module serves: llama "
        "(llama_eagle3), qwen3 (qwen3_eagle3: per-head RMSNorms on q and k before RoPE), mla (deepseek_eagle3: "
        "DeepSeek-V2/V3 multi-head latent attention, for MLA targets; geometry from the target, draft.mla to override).")
    mla: MlaGeometry = Field(
        default_factory=MlaGeometry, description="draft.layer mla: the latent attention geometry (q_lora_rank, "
        "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), each null = the target's.")
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
    num_layers: int = Field(
        1, ge=1, le=8, description="Draft decoder layers (EAGLE-3: 1). Layer 0 reads cat(embed, fc(aux)), each later "
        "one the hidden state only; vLLM's llama_eagle3 / qwen3_eagle3 / deepseek_eagle3 build "
        "transformer_layer_config.num_hidden_layers of them. Each layer adds its attention and MLP to every TTT step.")
    ttt_steps: int = Field(7, ge=1, le=16, description="Unrolled TTT steps K (EAGLE-3: 7).")
    gamma: float = Field(0.8, gt=0, le=1, description="TTT step k loss weight gamma**k.")
    accept_weighting: AcceptWeighting = accept_weighting_field()
    opd: OpdSplit = opd_field()
    opd_gamma: float = opd_gamma_field()

    @field_validator("layer", mode="before")
    @classmethod
    def _known_layer(cls, value: Any) -> Any:
        if value not in DRAFT_LAYERS:
            known = ", ".join(f"{k} (vLLM's {module})" for k, (module, _) in DRAFT_LAYERS.items())
            raise PydanticCustomError("draft_layer", f"{value!r} is no EAGLE-3 draft layer vLLM serves; known: {known}")
        return value

    @model_validator(mode="after")
    def _servable_layer(self) -> "Eagle3DraftConfig":
        problem = layer_option_problem(self.layer, norm_before_fc=self.norm_before_fc,
                                       sliding_window=self.sliding_window)
        if problem:
            raise PydanticCustomError("draft_layer", problem)
        if self.layer != "mla" and self.mla != MlaGeometry():
            raise PydanticCustomError("draft_layer", f"draft.mla is set but draft.layer is {self.layer}: the MLA "
                                      "geometry applies to draft.layer mla only")
        return self

    @model_validator(mode="after")
    def _one_start(self) -> "Eagle3DraftConfig":
        if self.init_from and (self.init_layer_from_target is not None or self.init_fc != "random"):
            raise ValueError("draft.init_from (a whole trained draft) and draft.init_layer_from_target / "
                             "draft.init_fc (a start from the target) both set the draft's start: set one")
        return self
