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

from .families import (
    Tensor,
    experts_per_token,
    is_mla,
    is_moe_layer,
    layer_types,
    model_type,
    mtp_layers,
    mtp_tensors,
    num_experts,
    weight_tensors,
)
from .resolve import load_config_json

if TYPE_CHECKING:
    from ..recipe import Recipe

# bytes per element of a dtype name: target.dtype (vLLM's "auto": the checkpoint's own, bf16 for
# modern targets) and data.hidden_states_dtype (fp8 shards add 16 B/token of scales)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "auto": 2}
MXFP4_BYTES_PER_PARAM = 4.25 / 8  # 4-bit values + one 8-bit scale per 32 (OCP microscaling)

# keys of every target's (text) config the estimates read (intermediate_size: where a layer is
# dense); a family adds its own (required_geometry_keys); a config without one is refused
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
    """Parameters of the target's language model by part, from its ``config.json``, as vLLM
    holds them (:func:`draftsmith.target.families.weight_tensors`: dense, MoE of the Qwen /
    DeepSeek / Mixtral kinds, MLA, hybrid linear attention, Gemma 4 sliding / global layers):
    ``embedding``, ``lm_head`` (absent when tied), ``attention``, ``mlp`` (dense layers),
    ``experts``, ``shared_experts``, ``router``, ``norms``. MTP layers are not in it
    (:func:`target_facts` ``mtp_parameters``): vLLM loads them only for ``method: mtp``.

    Raises:
        KeyError: a key the family's layers need is missing (its name).
    """
    counts: dict[str, int] = {}
    for tensor in weight_tensors(text_json(config_json)):
        counts[tensor.part] = counts.get(tensor.part, 0) + tensor.numel
    return counts


def quantization(config_json: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` (``{}`` when unquantised); a multimodal
    config's may sit in ``text_config``."""
    q = config_json.get("quantization_config") or text_json(config_json).get("quantization_config")
    return q if isinstance(q, dict) else {}


def _not_converted(name: str, skip: list[str]) -> bool:
    """Whether checkpoint tensor ``name`` matches an entry of ``modules_to_not_convert`` /
    ``ignored_layers`` (a whole module path or a dotted suffix such as ``mlp.gate``)."""
    dotted = f".{name}."
    return any(f".{entry.strip('.')}." in dotted or name == entry for entry in skip)


def _tensor_bytes(tensor: Tensor, per: float, quant: dict[str, Any]) -> float:
    method = quant.get("quant_method")
    if method == "mxfp4" and tensor.part == "experts" and len(tensor.shape) == 2:
        return tensor.numel * MXFP4_BYTES_PER_PARAM
    if method == "fp8" and tensor.linear and tensor.part not in ("embedding", "lm_head", "router"):
        skip = list(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or [])
        if not _not_converted(tensor.name, skip):
            block = quant.get("weight_block_size")
            rows, cols = tensor.shape[0], tensor.shape[-1]
            # per-block fp32 scales (DeepSeek-style [128, 128]); per-tensor: one scale
            scales = (-(-rows // int(block[0])) * -(-cols // int(block[1]))) if block else 1
            return tensor.count * (rows * cols + 4 * scales)
    return tensor.numel * per


def target_weight_bytes(config_json: dict[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """Bytes of the target's weights as vLLM holds them: ``dtype`` (``target.dtype``) for
    everything, except what the checkpoint's ``quantization_config`` quantises:

    - ``quant_method: mxfp4`` (gpt-oss): the experts at 4.25 bits per parameter;
    - ``quant_method: fp8``: every projection of the decoder layers (attention, MLA, DeltaNet,
      dense MLP, experts, shared experts) at 1 byte per parameter plus one fp32 scale per
      ``weight_block_size`` block (``[128, 128]``; per-tensor without it); embeddings, the
      ``lm_head``, routers, norms and the modules ``modules_to_not_convert`` /
      ``ignored_layers`` names stay at ``dtype``.

    Returns:
        ``{"parameters", "bytes", "bytes_by_part", "quantization"}`` (``bytes_by_part``: the
        parts of :func:`target_parameter_counts`; ``quantization`` is None or the method).
    """
    per = DTYPE_BYTES.get(dtype, 2)
    quant = quantization(config_json)
    tensors = weight_tensors(text_json(config_json))
    by_part: dict[str, float] = {}
    for x in tensors:
        by_part[x.part] = by_part.get(x.part, 0.0) + _tensor_bytes(x, per, quant)
    return {"parameters": sum(x.numel for x in tensors), "bytes": int(sum(by_part.values())),
            "bytes_by_part": {part: int(b) for part, b in by_part.items()},
            "quantization": quant.get("quant_method")}


def target_facts(config_json: dict[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """What serving the target costs, from its ``config.json`` alone.

    Returns:
        ``parameters`` / ``bytes`` / ``quantization`` (:func:`target_weight_bytes`), ``counts``
        (:func:`target_parameter_counts`), ``active_parameters`` (per token: everything but the
        routed experts a token does not pick, ``num_experts_per_tok / E`` of them),
        ``moe`` (routed experts, experts per token), ``mtp_layers`` / ``mtp_parameters`` /
        ``mtp_bytes`` (the MTP layers, not in ``parameters``), ``layer_kinds`` (count per
        attention kind), ``kv_bytes_per_token`` (KV cache of one token over the layers that keep
        it for the whole sequence: ``2 x kv_heads x head_dim`` per full-attention layer,
        ``kv_lora_rank + qk_rope_head_dim`` per MLA layer, at ``dtype``),
        ``sliding_kv_bytes_per_token`` and ``sliding_window`` (the sliding layers' share, held for
        at most ``sliding_window`` tokens), ``state_bytes_per_sequence`` (DeltaNet layers: the
        conv state ``(kernel - 1) x conv_dim`` at ``dtype`` and the recurrent state
        ``value_heads x key_dim x value_dim`` at ``mamba_ssm_dtype``, float32 by default; constant
        in the sequence length).
    """
    t = text_json(config_json)
    per = DTYPE_BYTES.get(dtype, 2)
    weights = target_weight_bytes(config_json, dtype)
    counts = target_parameter_counts(config_json)
    E, k = num_experts(t), experts_per_token(t)
    active = weights["parameters"] - (counts.get("experts", 0) * (E - k) // E if E and k else 0)
    kinds = layer_types(t)
    heads = int(t["num_attention_heads"])
    kv, hd = int(t.get("num_key_value_heads") or heads), int(t.get("head_dim") or int(t["hidden_size"]) // heads)
    full = sliding = 0
    first_shared = len(kinds) - int(t.get("num_kv_shared_layers") or 0)
    for i, kind in enumerate(kinds):
        if kind == "mla":
            full += (int(t["kv_lora_rank"]) + int(t["qk_rope_head_dim"])) * per
        elif kind in ("full_attention", "sliding_attention") and i < first_shared:
            k_heads, dim, mult = kv, hd, 2
            if kind == "full_attention" and model_type(t).startswith("gemma4"):
                dim = int(t.get("global_head_dim") or 512)
                if t.get("attention_k_eq_v"):
                    k_heads, mult = int(t.get("num_global_key_value_heads") or kv), 1
            if kind == "sliding_attention":
                sliding += mult * k_heads * dim * per
            else:
                full += mult * k_heads * dim * per
    state = 0
    if "linear_attention" in kinds:
        nk, nv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
        dk, dv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
        ssm = DTYPE_BYTES.get(str(t.get("mamba_ssm_dtype") or "float32"), 4)
        conv = (int(t.get("linear_conv_kernel_dim") or 4) - 1) * (2 * nk * dk + nv * dv) * per
        state = kinds.count("linear_attention") * (conv + nv * dk * dv * ssm)
    mtp = mtp_tensors(t)
    per_mtp = {**quantization(config_json)}
    return {**weights, "counts": counts, "active_parameters": active,
            "moe": {"experts": E, "experts_per_token": k} if E else None,
            "mtp_layers": mtp_layers(t), "mtp_parameters": sum(x.numel for x in mtp),
            "mtp_bytes": int(sum(_tensor_bytes(x, per, per_mtp) for x in mtp)),
            "layer_kinds": {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)},
            "kv_bytes_per_token": full, "sliding_kv_bytes_per_token": sliding,
            "sliding_window": t.get("sliding_window") if sliding else None,
            "state_bytes_per_sequence": state}


def required_geometry_keys(config_json: dict[str, Any]) -> tuple[str, ...]:
    """The keys the estimates read for this target's family: :data:`GEOMETRY_KEYS` (``intermediate_size``
    only when some layer is dense), plus the experts' (``moe_intermediate_size`` unless the experts
    use ``intermediate_size``, gpt-oss / MiniMax), MLA's (``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``) and the DeltaNet layers' (``linear_*``)."""
    t = text_json(config_json)
    keys = [k for k in GEOMETRY_KEYS if k != "intermediate_size"]
    layers = int(t["num_hidden_layers"]) if isinstance(t.get("num_hidden_layers"), int) else 0
    gemma = model_type(t).startswith("gemma4")
    if not num_experts(t) or gemma or any(not is_moe_layer(t, i) for i in range(layers)):
        keys.append("intermediate_size")
    if num_experts(t):  # the experts' width: moe_intermediate_size, else (gpt-oss) intermediate_size
        width = "moe_intermediate_size" if t.get("moe_intermediate_size") is not None \
            or t.get("num_local_experts") is None else "intermediate_size"
        if width not in keys:
            keys.append(width)
    if is_mla(t):
        keys += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    if layers and "linear_attention" in layer_types(t):
        keys += ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"]
    return tuple(keys)


def validate_geometry(config_json: dict[str, Any], source: str) -> None:
    """Refuse a target config without a key the estimates read for its family
    (:func:`required_geometry_keys`): a dense Llama needs ``intermediate_size``, an all-MoE
    Qwen3.5 does not, DeepSeek needs its MLA ranks.

    Raises:
        ValueError: one line naming the first missing / non-positive key and the file.
    """
    text = text_json(config_json)
    for key in required_geometry_keys(config_json):
        value = text.get(key)
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
