"""Every weight tensor of a target, per family, from its ``config.json`` alone.

:func:`weight_tensors` lists the tensors vLLM holds for a decoder-only target (or the language
model of a multimodal one), named as in the Hugging Face checkpoint (``model.layers.3.mlp.gate``)
so that a quantisation config's ``modules_to_not_convert`` / ``ignore`` entries match them. The
families and the ``config.json`` keys read:

- **dense** (Llama, Qwen3): ``intermediate_size``, GQA (``num_key_value_heads``, ``head_dim``).
- **MoE, Qwen style** (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): ``num_experts``,
  ``moe_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers`` (dense layers at
  ``intermediate_size``), ``shared_expert_intermediate_size`` (one gated shared expert).
- **MoE, DeepSeek style** (DeepSeek-V3, Kimi-K2.x, GLM-4.5): ``n_routed_experts``,
  ``n_shared_experts`` (shared experts of ``n_shared_experts * moe_intermediate_size``),
  ``first_k_dense_replace`` dense layers, then one MoE layer every ``moe_layer_freq``.
- **MoE, Mixtral style** (gpt-oss, MiniMax-M2): ``num_local_experts`` in every layer, experts of
  ``moe_intermediate_size`` or ``intermediate_size``.
- **MLA** (DeepSeek-V3, Kimi): ``q_lora_rank`` (null: a plain ``q_proj``), ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``.
- **hybrid linear attention** (Qwen3-Next, Qwen3.5): ``layer_types`` (or one full-attention
  layer every ``full_attention_interval``), Gated DeltaNet layers of ``linear_num_key_heads`` x
  ``linear_key_head_dim`` keys, ``linear_num_value_heads`` x ``linear_value_head_dim`` values and
  a causal conv of ``linear_conv_kernel_dim``; the full-attention layers have an output gate
  (``q_proj`` twice as wide).
- **sliding / global attention** (Gemma 4): ``layer_types``, ``sliding_window``; global layers
  use ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` heads
  whose values are the keys (no ``v_proj``); ``num_kv_shared_layers`` last layers reuse earlier
  KV (no ``k_proj`` / ``v_proj``, and a double-wide MLP under ``use_double_wide_mlp``);
  ``enable_moe_block`` adds ``num_experts`` experts beside the dense MLP.
- **MTP** (multi-token prediction layers vLLM loads for ``method: mtp``, not for EAGLE-3):
  ``num_nextn_predict_layers`` (DeepSeek / GLM: a decoder layer, ``enorm`` / ``hnorm``,
  ``eh_proj`` and, as the checkpoints store them, its own embedding and head) and
  ``mtp_num_hidden_layers`` (Qwen3-Next / Qwen3.5: a full-attention MoE layer, ``fc``, norms; the
  target's embedding and head are shared). :func:`mtp_tensors` lists them.

Each tensor is a :class:`Tensor` (part, name, shape, count): parts are ``embedding``,
``lm_head``, ``attention`` (incl. MLA and the linear-attention mixers), ``mlp`` (dense),
``experts``, ``shared_experts``, ``router``, ``norms`` (RMSNorm weights and the small
per-head vectors: DeltaNet ``A_log`` / ``dt_bias``, attention sinks). Biases are counted where
the config turns them on (``attention_bias``; gpt-oss's experts). Buffers transformers keeps
out of ``parameters()`` but vLLM loads as weights (DeepSeek / GLM ``e_score_correction_bias``)
are in ``router``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

GATED_ATTENTION_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
"""``model_type`` of the families whose full-attention ``q_proj`` also emits a sigmoid output gate."""

QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe",
                 "gemma4_text", "gemma4")
"""``model_type`` of the families with per-head RMSNorm on queries and keys."""


@dataclass(frozen=True)
class Tensor:
    """One weight of the target as vLLM loads it.

    Attributes:
        part: the bucket it is counted in (module docstring).
        name: its checkpoint name without ``.weight`` (``model.layers.0.self_attn.q_proj``).
        shape: ``(out, in)`` of a linear, ``(n,)`` of a vector, ``(V, H)`` of an embedding.
        count: how many such tensors (the experts of one layer are one entry, ``count`` = E).
        linear: a projection a weight-only quantisation method may quantise (fp8 blocks).
    """

    part: str
    name: str
    shape: tuple[int, ...]
    count: int = 1
    linear: bool = False

    @property
    def numel(self) -> int:
        n = self.count
        for d in self.shape:
            n *= d
        return n


def _int(t: dict[str, Any], key: str, default: int | None = None) -> int:
    value = t.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    return int(value)


def model_type(t: dict[str, Any]) -> str:
    return str(t.get("model_type") or "")


#: A multi-head latent attention config's geometry keys, in the order vLLM's ``DeepseekV2MLAAttention``
#: takes them (the MLA draft layer's ``draft.mla`` keys too).
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm_moe_dsa")
"""``model_type`` of the multi-head latent attention families (a config of one without the MLA keys is refused)."""


def is_mla(t: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-5): an MLA ``model_type`` or any
    of the MLA keys (``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``)."""
    return model_type(t) in MLA_TYPES or any(t.get(k) is not None
                                             for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"))


def layer_types(t: dict[str, Any]) -> list[str]:
    """The attention kind of each decoder layer: ``full_attention``, ``sliding_attention``,
    ``linear_attention`` or ``mla``. From ``layer_types`` when the config lists it; Qwen3-Next /
    Qwen3.5 without it: one full-attention layer every ``full_attention_interval`` (the last of
    each group); Gemma 4 without it: transformers' 5 sliding : 1 full pattern."""
    n = _int(t, "num_hidden_layers")
    if is_mla(t):
        return ["mla"] * n
    types = t.get("layer_types")
    if isinstance(types, list) and len(types) >= n:
        return [str(x) for x in types[:n]]
    if t.get("linear_num_value_heads") is not None or t.get("full_attention_interval") is not None:
        every = _int(t, "full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if model_type(t).startswith("gemma4"):
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        kinds[-1] = "full_attention"
        return kinds
    return ["full_attention"] * n


def num_experts(t: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0: a dense target)."""
    return int(t.get("n_routed_experts") or t.get("num_local_experts") or t.get("num_experts") or 0)


def experts_per_token(t: dict[str, Any]) -> int:
    return int(t.get("num_experts_per_tok") or t.get("top_k_experts") or t.get("experts_per_token") or 0)


def expert_intermediate_size(t: dict[str, Any]) -> int:
    return int(t.get("moe_intermediate_size") or t["intermediate_size"])


def is_moe_layer(t: dict[str, Any], i: int) -> bool:
    """Whether decoder layer ``i`` routes through experts (module docstring for the rules)."""
    if not num_experts(t):
        return False
    if model_type(t).startswith("gemma4"):
        return bool(t.get("enable_moe_block"))
    if t.get("n_routed_experts") is not None:  # DeepSeek / GLM
        freq = _int(t, "moe_layer_freq", 1)
        return i >= _int(t, "first_k_dense_replace", 0) and i % freq == 0
    if t.get("num_local_experts") is not None:  # gpt-oss, MiniMax
        return True
    step = _int(t, "decoder_sparse_step", 1)
    return i not in (t.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _attention(t: dict[str, Any], i: int, kind: str, p: str) -> Iterator[Tensor]:
    H, heads = _int(t, "hidden_size"), _int(t, "num_attention_heads")
    a = f"{p}.self_attn"
    mtype = model_type(t)
    bias = bool(t.get("attention_bias"))
    if kind == "mla":
        nope, rope, v = _int(t, "qk_nope_head_dim"), _int(t, "qk_rope_head_dim"), _int(t, "v_head_dim")
        kv_rank, q_rank = _int(t, "kv_lora_rank"), t.get("q_lora_rank")
        if q_rank:
            yield Tensor("attention", f"{a}.q_a_proj", (int(q_rank), H), linear=True)
            yield Tensor("norms", f"{a}.q_a_layernorm", (int(q_rank),))
            yield Tensor("attention", f"{a}.q_b_proj", (heads * (nope + rope), int(q_rank)), linear=True)
        else:
            yield Tensor("attention", f"{a}.q_proj", (heads * (nope + rope), H), linear=True)
        yield Tensor("attention", f"{a}.kv_a_proj_with_mqa", (kv_rank + rope, H), linear=True)
        yield Tensor("norms", f"{a}.kv_a_layernorm", (kv_rank,))
        yield Tensor("attention", f"{a}.kv_b_proj", (heads * (nope + v), kv_rank), linear=True)
        yield Tensor("attention", f"{a}.o_proj", (H, heads * v), linear=True)
        return
    if kind == "linear_attention":
        a = f"{p}.linear_attn"
        nk, nv = _int(t, "linear_num_key_heads"), _int(t, "linear_num_value_heads")
        dk, dv = _int(t, "linear_key_head_dim"), _int(t, "linear_value_head_dim")
        conv = 2 * nk * dk + nv * dv
        yield Tensor("attention", f"{a}.in_proj_qkvz", (2 * nk * dk + 2 * nv * dv, H), linear=True)
        yield Tensor("attention", f"{a}.in_proj_ba", (2 * nv, H), linear=True)
        yield Tensor("attention", f"{a}.conv1d", (conv, 1, _int(t, "linear_conv_kernel_dim", 4)))
        yield Tensor("norms", f"{a}.dt_bias", (nv,))
        yield Tensor("norms", f"{a}.A_log", (nv,))
        yield Tensor("norms", f"{a}.norm", (dv,))
        yield Tensor("attention", f"{a}.out_proj", (H, nv * dv), linear=True)
        return
    kv = _int(t, "num_key_value_heads", heads)
    hd = int(t.get("head_dim") or H // heads)
    gemma = mtype.startswith("gemma4")
    k_eq_v = False
    shared_kv = False
    if gemma:
        if kind == "full_attention":
            hd = _int(t, "global_head_dim", 512)
            k_eq_v = bool(t.get("attention_k_eq_v"))
            if k_eq_v and t.get("num_global_key_value_heads") is not None:
                kv = _int(t, "num_global_key_value_heads")
        first_shared = _int(t, "num_hidden_layers") - _int(t, "num_kv_shared_layers", 0)
        shared_kv = i >= first_shared
    q_out = heads * hd * (2 if mtype in GATED_ATTENTION_TYPES and t.get("attn_output_gate", True) else 1)
    yield Tensor("attention", f"{a}.q_proj", (q_out, H), linear=True)
    if bias:
        yield Tensor("attention", f"{a}.q_proj.bias", (q_out,))
    if not shared_kv:
        for proj in ("k_proj",) + (() if k_eq_v else ("v_proj",)):
            yield Tensor("attention", f"{a}.{proj}", (kv * hd, H), linear=True)
            if bias:
                yield Tensor("attention", f"{a}.{proj}.bias", (kv * hd,))
    yield Tensor("attention", f"{a}.o_proj", (H, heads * hd), linear=True)
    if bias and mtype not in ("glm4_moe", "qwen2", "qwen2_moe"):
        yield Tensor("attention", f"{a}.o_proj.bias", (H,))
    if mtype == "minimax_m2":  # RMSNorm over all heads at once
        yield Tensor("norms", f"{a}.q_norm", (heads * hd,))
        yield Tensor("norms", f"{a}.k_norm", (kv * hd,))
    elif mtype in QK_NORM_TYPES or t.get("use_qk_norm"):
        yield Tensor("norms", f"{a}.q_norm", (hd,))
        if not shared_kv:
            yield Tensor("norms", f"{a}.k_norm", (hd,))
    if mtype == "gpt_oss":
        yield Tensor("norms", f"{a}.sinks", (heads,))


def _swiglu(part: str, name: str, H: int, inter: int, count: int = 1, bias: bool = False) -> Iterator[Tensor]:
    yield Tensor(part, f"{name}.gate_proj", (inter, H), count, linear=True)
    yield Tensor(part, f"{name}.up_proj", (inter, H), count, linear=True)
    yield Tensor(part, f"{name}.down_proj", (H, inter), count, linear=True)
    if bias:
        yield Tensor(part, f"{name}.gate_up_proj_bias", (2 * inter,), count)
        yield Tensor(part, f"{name}.down_proj_bias", (H,), count)


def _mlp(t: dict[str, Any], i: int, p: str, moe: bool) -> Iterator[Tensor]:
    H = _int(t, "hidden_size")
    mtype = model_type(t)
    if mtype.startswith("gemma4"):
        first_shared = _int(t, "num_hidden_layers") - _int(t, "num_kv_shared_layers", 0)
        wide = 2 if t.get("use_double_wide_mlp") and 0 < first_shared <= i else 1
        yield from _swiglu("mlp", f"{p}.mlp", H, _int(t, "intermediate_size") * wide)
        if moe:
            E, inter = num_experts(t), _int(t, "moe_intermediate_size")
            yield Tensor("router", f"{p}.router.proj", (E, H))
            yield Tensor("router", f"{p}.router.scale", (H,))
            yield Tensor("router", f"{p}.router.per_expert_scale", (E,))
            yield from _swiglu("experts", f"{p}.experts", H, inter, E)
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                yield Tensor("norms", f"{p}.{norm}", (H,))
        return
    if not moe:
        yield from _swiglu("mlp", f"{p}.mlp", H, _int(t, "intermediate_size"))
        return
    E, inter = num_experts(t), expert_intermediate_size(t)
    m = f"{p}.block_sparse_moe" if mtype == "minimax_m2" else f"{p}.mlp"
    yield Tensor("router", f"{m}.gate", (E, H))
    if mtype == "gpt_oss":
        yield Tensor("router", f"{m}.gate.bias", (E,))
    if t.get("n_routed_experts") is not None or mtype == "minimax_m2":  # noaux_tc routing bias
        yield Tensor("router", f"{m}.gate.e_score_correction_bias", (E,))
    yield from _swiglu("experts", f"{m}.experts", H, inter, E, bias=mtype == "gpt_oss")
    shared = int(t.get("n_shared_experts") or 0) * inter if t.get("n_routed_experts") is not None else 0
    if shared:
        yield from _swiglu("shared_experts", f"{m}.shared_experts", H, shared)
    elif t.get("shared_expert_intermediate_size"):
        yield from _swiglu("shared_experts", f"{m}.shared_expert", H, _int(t, "shared_expert_intermediate_size"))
        yield Tensor("router", f"{m}.shared_expert_gate", (1, H))


def decoder_layer(t: dict[str, Any], i: int, prefix: str, kind: str | None = None,
                  moe: bool | None = None) -> Iterator[Tensor]:
    """The tensors of decoder layer ``i`` under ``prefix`` (``model.layers.{i}``), its attention
    ``kind`` and MoE-ness as the config says unless given (MTP layers force them)."""
    H = _int(t, "hidden_size")
    kind = kind or layer_types(t)[i]
    moe = is_moe_layer(t, i) if moe is None else moe
    yield from _attention(t, i, kind, prefix)
    yield from _mlp(t, i, prefix, moe)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if model_type(t).startswith("gemma4"):
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if t.get("hidden_size_per_layer_input"):
            P = _int(t, "hidden_size_per_layer_input")
            yield Tensor("attention", f"{prefix}.per_layer_input_gate", (P, H), linear=True)
            yield Tensor("attention", f"{prefix}.per_layer_projection", (H, P), linear=True)
            norms.append("post_per_layer_input_norm")
    for norm in norms:
        yield Tensor("norms", f"{prefix}.{norm}", (H,))


def weight_tensors(t: dict[str, Any]) -> list[Tensor]:
    """Every weight of the target's language model (``t``: the text part of ``config.json``,
    :func:`draftsmith.target.facts.text_json`), MTP layers excluded (:func:`mtp_tensors`).

    Raises:
        KeyError: a key the family's layers need is missing (the key's name).
    """
    H, L, V = _int(t, "hidden_size"), _int(t, "num_hidden_layers"), _int(t, "vocab_size")
    out = [Tensor("embedding", "model.embed_tokens", (V, H))]
    if model_type(t).startswith("gemma4") and t.get("hidden_size_per_layer_input"):
        P = _int(t, "hidden_size_per_layer_input")
        out.append(Tensor("embedding", "model.embed_tokens_per_layer", (_int(t, "vocab_size_per_layer_input", V), L * P)))
        out.append(Tensor("attention", "model.per_layer_model_projection", (L * P, H), linear=True))
        out.append(Tensor("norms", "model.per_layer_projection_norm", (P,)))
    for i in range(L):
        out.extend(decoder_layer(t, i, f"model.layers.{i}"))
    out.append(Tensor("norms", "model.norm", (H,)))
    if not t.get("tie_word_embeddings"):
        out.append(Tensor("lm_head", "lm_head", (V, H)))
    return out


def mtp_layers(t: dict[str, Any]) -> int:
    """MTP layers the checkpoint ships (``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``)."""
    return int(t.get("num_nextn_predict_layers") or t.get("mtp_num_hidden_layers") or 0)


def mtp_tensors(t: dict[str, Any]) -> list[Tensor]:
    """The weights of the checkpoint's multi-token-prediction layers (module docstring): what
    vLLM loads on top of the target for ``speculative_config.method: mtp``; empty when the
    config declares none."""
    n = mtp_layers(t)
    if not n:
        return []
    H, L, V = _int(t, "hidden_size"), _int(t, "num_hidden_layers"), _int(t, "vocab_size")
    out: list[Tensor] = []
    if t.get("num_nextn_predict_layers"):  # DeepSeek / GLM: model.layers.{L + k}
        for k in range(n):
            p = f"model.layers.{L + k}"
            out.append(Tensor("mtp", f"{p}.embed_tokens", (V, H)))
            out += [Tensor("mtp", f"{p}.{norm}", (H,)) for norm in ("enorm", "hnorm", "shared_head.norm")]
            out.append(Tensor("mtp", f"{p}.eh_proj", (H, 2 * H), linear=True))
            out.append(Tensor("mtp", f"{p}.shared_head.head", (V, H)))
            out += [Tensor("mtp", x.name, x.shape, x.count, x.linear)
                    for x in decoder_layer(t, L + k, p, kind="mla" if is_mla(t) else "full_attention",
                                           moe=bool(num_experts(t)))]
        return out
    for k in range(n):  # Qwen3-Next / Qwen3.5: mtp.*, embedding and head shared with the target
        out += [Tensor("mtp", x.name, x.shape, x.count, x.linear)
                for x in decoder_layer(t, L, f"mtp.layers.{k}", kind="full_attention", moe=bool(num_experts(t)))]
    out.append(Tensor("mtp", "mtp.fc", (H, 2 * H), linear=True))
    out += [Tensor("mtp", f"mtp.{norm}", (H,)) for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    return out
