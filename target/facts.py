"""What the target's config says, as arithmetic: no weights are read and no device is touched.

The language-model part of a (possibly multimodal) config (:func:`text_config` of a
transformers config, :func:`text_json` of a ``config.json`` dict), its decoder layers and the
aux layer ids a draft reads (vLLM's convention: id ``L`` is the input of decoder layer ``L``),
the target's parameters and weight bytes as vLLM holds them (:func:`target_weight_bytes`, the
figure the data plan and the training dry run print), and the geometry checks that refuse a
config the estimates cannot read (:func:`validate_geometry`, :func:`check_lengths`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .resolve import load_config_json

if TYPE_CHECKING:
    from ..recipe import Recipe

# bytes per element of a dtype name: target.dtype (vLLM's "auto": the checkpoint's own, bf16 for
# modern targets) and data.hidden_states_dtype (fp8 shards add 16 B/token of scales)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "auto": 2}
MXFP4_BYTES_PER_PARAM = 4.25 / 8  # 4-bit values + one 8-bit scale per 32 (OCP microscaling)

# keys of the target's (text) config the estimates read; a config without one is refused
GEOMETRY_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                 "max_position_embeddings")


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) transformers config: its
    ``text_config`` when it has one, else the config itself."""
    return getattr(config, "text_config", None) or config


def text_json(config_json: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config.json."""
    text = config_json.get("text_config")
    return {**config_json, **text} if isinstance(text, dict) else config_json


def num_decoder_layers(config: Any) -> int:
    return int(text_config(config).num_hidden_layers)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers when a checkpoint names none: ``(2, N//2, N-3)``."""
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """The aux layer ids a draft of a target with ``num_layers`` decoder layers reads: the recipe's
    ``data.aux_layer_ids`` when given, else vLLM's default (:func:`default_aux_layer_ids`, the rule
    vLLM 0.32's ``get_eagle3_aux_hidden_state_layers`` uses for every family it serves EAGLE-3 on:
    Llama, Qwen3 / Qwen3-MoE / Qwen3.5, DeepSeek-V2/V3, gpt-oss), checked and sorted
    (:func:`validate_aux_layer_ids`). The one place every stage resolves them.

    Raises:
        ValueError: as :func:`validate_aux_layer_ids`.
    """
    return validate_aux_layer_ids(list(requested) if requested else default_aux_layer_ids(num_layers), num_layers)


def validate_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """Check the ids follow vLLM's convention (input of layer L, ``0 <= L < N``).

    Raises:
        ValueError: not three ids, duplicates, or an id out of ``[0, N)``.
    """
    ids = list(ids)
    if len(ids) != 3:
        raise ValueError(f"aux_layer_ids must list exactly 3 layer ids, got {ids}")
    if len(set(ids)) != 3:
        raise ValueError(f"aux_layer_ids must be distinct, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux_layer_ids {bad} out of range for a target with {num_layers} decoder layers "
            f"(valid: 0..{num_layers - 1}; id L = residual stream after L layers)"
        )
    return sorted(ids)


def target_parameter_counts(config_json: dict[str, Any]) -> dict[str, int]:
    """Parameters of a decoder-only target by part, from its ``config.json``: ``embedding``,
    ``lm_head`` (0 when tied), ``attention`` (q/k/v/o projections of every layer), ``mlp``
    (dense SwiGLU) or ``experts`` + ``router`` (mixture of experts: ``num_local_experts`` /
    ``num_experts`` with ``moe_intermediate_size`` or ``intermediate_size``). Norms and
    biases are left out (under 0.1% of any shipped target).

    Raises:
        KeyError: a geometry key (``hidden_size``, ``num_hidden_layers``, ``vocab_size``,
            ``num_attention_heads``, ``intermediate_size``) is missing.
    """
    t = text_json(config_json)
    H, L, V, heads = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"], t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    hd = t.get("head_dim") or H // heads
    counts = {"embedding": V * H, "lm_head": 0 if t.get("tie_word_embeddings") else V * H,
              "attention": L * (2 * H * heads * hd + 2 * H * kv * hd)}
    experts = t.get("num_local_experts") or t.get("num_experts") or 0
    if experts:
        inter = t.get("moe_intermediate_size") or t["intermediate_size"]
        counts["experts"] = L * experts * 3 * H * inter
        counts["router"] = L * H * experts
        shared = t.get("shared_expert_intermediate_size") or 0
        if shared:
            counts["shared_expert"] = L * 3 * H * shared
    else:
        counts["mlp"] = L * 3 * H * t["intermediate_size"]
    return counts


def target_weight_bytes(config_json: dict[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """Bytes of the target's weights as vLLM holds them: ``dtype`` (``target.dtype``) for
    everything, except the experts of an MXFP4 checkpoint (gpt-oss: ``quantization_config``
    ``quant_method: mxfp4``), held at 4.25 bits per parameter.

    Returns:
        ``{"parameters", "bytes", "quantization"}`` (``quantization`` is None or the method).
    """
    counts = target_parameter_counts(config_json)
    per = DTYPE_BYTES.get(dtype, 2)
    quant = (config_json.get("quantization_config") or {}).get("quant_method")
    total = 0.0
    for part, n in counts.items():
        total += n * (MXFP4_BYTES_PER_PARAM if quant == "mxfp4" and part == "experts" else per)
    return {"parameters": sum(counts.values()), "bytes": int(total), "quantization": quant}


def validate_geometry(config_json: dict[str, Any], source: str) -> None:
    """Refuse a target config without a key the estimates read (:data:`GEOMETRY_KEYS`; an
    all-MoE target's ``moe_intermediate_size`` stands for ``intermediate_size``).

    Raises:
        ValueError: one line naming the first missing / non-positive key and the file.
    """
    text = text_json(config_json)
    for key in GEOMETRY_KEYS:
        value = text.get(key)
        if key == "intermediate_size" and value is None:  # all-MoE targets (Qwen3.5) state the expert width only
            value = text.get("moe_intermediate_size")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            what = "missing" if value is None else f"{value!r} is not a positive integer"
            raise ValueError(f"{source}: target config key {key} {what} (needed for the memory estimate)")


def check_lengths(config_json: dict[str, Any], lengths: list[int], source: str, key: str = "data.max_length") -> None:
    """Refuse a sequence length beyond the target's ``max_position_embeddings`` (or below 2).

    Raises:
        ValueError: one line naming ``key``, the length and the target's limit.
    """
    limit = text_json(config_json).get("max_position_embeddings")
    for T in lengths:
        if T < 2:
            raise ValueError(f"{key}={T}: must be >= 2")
        if isinstance(limit, int) and T > limit:
            raise ValueError(f"{key}={T} exceeds the target's max_position_embeddings={limit} ({source})")


def config_from_json(config_json: dict[str, Any], trust_remote_code: bool = False) -> Any:
    """A transformers config object of ``config_json`` (through a temporary directory)."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="draftsmith-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_json))
        return AutoConfig.from_pretrained(tmp, trust_remote_code=trust_remote_code)


def load_config_only(recipe: Recipe, target_config: Path | None) -> Any:
    """The target's transformers config (see :func:`load_config_json`; config file only, never weights)."""
    config_json, _ = load_config_json(recipe, target_config)
    return config_from_json(config_json, recipe.target.trust_remote_code)
