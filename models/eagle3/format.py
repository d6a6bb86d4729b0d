"""The EAGLE-3 export format vLLM loads (``{"method": "eagle3"}``; docs/formats.md, "EAGLE-3").

- speculators (default; vLLM detects it by ``speculators_config``): ``config.json`` with
  ``architectures ["Eagle3DraftModel"]``, ``speculators_model_type "eagle3"``, the verifier,
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``,
  ``norm_before_residual`` (always written: vLLM assumes True when absent) and a
  ``transformer_layer_config`` of ``num_hidden_layers`` layers (1 unless ``draft.num_layers``);
  weights ``fc``, ``layers.{i}.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``
  (with ``attention_bias`` / ``mlp_bias`` also the ``{q,k,v,o}_proj`` / ``{gate,up,down}_proj`` biases,
  which vLLM's ``llama_eagle3`` loads when the layer config sets those keys).
  EAGLE-3.1 (docs/formats.md, "EAGLE-3.1"): the top-level keys ``norm_before_fc``, ``fc_norm``,
  ``norm_output`` (written, all three, when any is on) and the tensors ``input_norm.weight``
  ``[3 * Ht]`` (``norm_before_fc``) and ``fc_norm.{0,1,2}.weight`` ``[Ht]`` (``fc_norm``).
- legacy (``legacy=True``): a Llama config with ``architectures ["LlamaForCausalLMEagle3"]``,
  ``eagle_config``, layer 0's weights under ``midlayer.*`` (later layers keep ``layers.{i}.*``,
  which vLLM's legacy loader reads alike).

The draft layer (``Eagle3Config.layer``, docs/formats.md, "EAGLE-3 draft layers") decides the layer
config and the attention tensors: ``qwen3`` writes a Qwen3 layer config (speculators:
``transformer_layer_config.model_type "qwen3"``; legacy: ``architectures ["Eagle3Qwen3ForCausalLM"]``)
and adds ``self_attn.q_norm`` / ``k_norm``; ``mla`` is always written in the legacy layout, a
``deepseek_v2`` config with ``architectures ["Eagle3DeepseekV2ForCausalLM"]`` and DeepSeek-V2's
attention tensors (:func:`attention_weight_shapes`).

The speculators library's own ``eagle3`` checkpoints are the speculators format too, read by the
same loader (docs/speculators_interop.md): they also ship ``embed_tokens.weight`` (used when
present), and no ``d2t`` / ``t2d`` when the draft vocab is the whole target vocab (read as the
identity mapping, :func:`with_identity_vocab`).

The ``config.json`` mappings are :class:`~draftsmith.models.eagle3.config.Eagle3Config`'s
(``to_speculators`` / ``to_legacy`` / ``from_export``); this module holds the tensor set, the
detector, the exporter and the loader :data:`EAGLE3_FORMAT` gives the registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint, DraftLoadError, read_export
from ..common import SPECULATORS_VERSION, DraftCard, DraftFit, DraftFormat, check_tensor_set, verifier_of, with_target_embedding
from .config import LEGACY_ARCHITECTURES, Eagle3Config, Eagle3ExportFacts, layer_of

LAYER_NAMES = {"llama": "Llama", "qwen3": "Qwen3", "mla": "DeepSeek MLA"}  # the model card's words
from .model import Eagle3DraftModel


def expected_weight_shapes(cfg: Eagle3Config, prefix: str = "layers.0.") -> dict[str, tuple[int, ...]]:
    """Every tensor an exported EAGLE-3 draft holds, with its shape.

    ``fc``, the decoder layers (:func:`layer_weight_shapes`; layer 0 under ``prefix``, layer i >= 1
    of ``num_layers`` under ``layers.{i}.``), ``norm``, ``lm_head``, ``d2t``, ``t2d``.
    EAGLE-3.1: ``norm_before_fc`` adds ``input_norm.weight`` ``[3 * Ht]``, ``fc_norm`` adds
    ``fc_norm.{i}.weight`` ``[Ht]`` for i in 0..2 (vLLM's ``LlamaModel.input_norm`` / ``fc_norm``);
    ``norm_output`` adds none.
    """
    H, Ht = cfg.hidden_size, cfg.target_hidden_size
    optional: dict[str, tuple[int, ...]] = {}
    if cfg.norm_before_fc:
        optional["input_norm.weight"] = (3 * Ht,)
    if cfg.fc_norm:
        optional.update({f"fc_norm.{i}.weight": (Ht,) for i in range(3)})
    layers = layer_weight_shapes(cfg, 0, prefix)
    for i in range(1, cfg.num_layers):
        layers |= layer_weight_shapes(cfg, i)
    return optional | {"fc.weight": (H, 3 * Ht)} | layers | {
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def layer_weight_shapes(cfg: Eagle3Config, index: int, prefix: str | None = None) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer ``index`` under ``prefix`` (default ``layers.{index}.``).

    Layer 0 reads ``cat(embed, hidden)`` (2H q/k/v inputs) and has ``hidden_norm``; a later layer
    reads the hidden state (H inputs) and has none, as vLLM's EAGLE-3 models build them.
    With ``attention_bias`` a layer has ``{q,k,v,o}_proj.bias`` and with ``mlp_bias``
    ``{gate,up,down}_proj.bias``: vLLM's ``llama_eagle3`` reads both keys from the layer config
    (``attention_bias`` -> ``qkv_proj`` and ``o_proj`` bias, ``mlp_bias`` -> ``gate_up_proj`` and
    ``down_proj`` bias) and loads the biases under these names, so they are exported too.
    """
    prefix = f"layers.{index}." if prefix is None else prefix
    H, nh, nkv, hd, I = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    attn = f"{prefix}self_attn."
    out: dict[str, tuple[int, ...]] = {}
    if cfg.attention_bias:  # Qwen3's o_proj has no bias (vLLM's Qwen3Attention)
        out.update({f"{attn}q_proj.bias": (nh * hd,), f"{attn}k_proj.bias": (nkv * hd,),
                    f"{attn}v_proj.bias": (nkv * hd,)})
        if cfg.layer == "llama":
            out[f"{attn}o_proj.bias"] = (H,)
    if cfg.mlp_bias:
        out.update({f"{prefix}mlp.gate_proj.bias": (I,), f"{prefix}mlp.up_proj.bias": (I,),
                    f"{prefix}mlp.down_proj.bias": (H,)})
    out |= attention_weight_shapes(cfg, attn, 2 * H if index == 0 else H) | {
        f"{prefix}mlp.gate_proj.weight": (I, H),
        f"{prefix}mlp.up_proj.weight": (I, H),
        f"{prefix}mlp.down_proj.weight": (H, I),
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
    }
    if index == 0:
        out[f"{prefix}hidden_norm.weight"] = (H,)
    return out


def attention_weight_shapes(cfg: Eagle3Config, attn: str = "layers.0.self_attn.",
                            d_in: int | None = None) -> dict[str, tuple[int, ...]]:
    """A draft layer attention's weights (biases aside) under prefix ``attn``, by ``cfg.layer``, for
    ``d_in`` inputs (default 2H, the first layer's):
    Llama's q/k/v/o projections; Qwen3's plus ``q_norm`` / ``k_norm`` ``[hd]``; MLA's
    ``q_a_proj [q_lora_rank, d_in]``, ``q_a_layernorm [q_lora_rank]``, ``q_b_proj [nh * hd_qk,
    q_lora_rank]``, ``kv_a_proj_with_mqa
    [kv_lora_rank + r, d_in]``, ``kv_a_layernorm [kv_lora_rank]``, ``kv_b_proj [nh * (qk_nope_head_dim +
    v_head_dim), kv_lora_rank]``, ``o_proj [H, nh * v_head_dim]`` (DeepSeek-V2's names, which vLLM's
    ``deepseek_eagle3`` loads, fusing ``q_a_proj`` and ``kv_a_proj_with_mqa``)."""
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    d_in = 2 * H if d_in is None else d_in
    if cfg.layer == "mla":
        r_kv, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        return {f"{attn}q_a_proj.weight": (cfg.q_lora_rank, d_in), f"{attn}q_a_layernorm.weight": (cfg.q_lora_rank,),
                f"{attn}q_b_proj.weight": (nh * hd, cfg.q_lora_rank),
                f"{attn}kv_a_proj_with_mqa.weight": (r_kv + r, d_in), f"{attn}kv_a_layernorm.weight": (r_kv,),
                f"{attn}kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r_kv),
                f"{attn}o_proj.weight": (H, nh * cfg.v_head_dim)}
    out = {f"{attn}q_proj.weight": (nh * hd, d_in), f"{attn}k_proj.weight": (nkv * hd, d_in),
           f"{attn}v_proj.weight": (nkv * hd, d_in), f"{attn}o_proj.weight": (H, nh * hd)}
    if cfg.layer == "qwen3":
        out |= {f"{attn}q_norm.weight": (hd,), f"{attn}k_norm.weight": (hd,)}
    return out


def is_eagle3_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of an EAGLE-3 export (speculators or legacy layout)."""
    return (config.get("speculators_model_type") == "eagle3"
            or bool(set(LEGACY_ARCHITECTURES.values()) & set(config.get("architectures") or [])))


def export_eagle3(ckpt: DraftCheckpoint, dtype: str, version: str, legacy: bool = False,
                  num_speculative_tokens: int = 3,
                  embed_tokens: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The export tensors and ``config.json`` of an EAGLE-3 checkpoint.

    Args:
        legacy: the legacy layout (``LlamaForCausalLMEagle3`` / ``Eagle3Qwen3ForCausalLM``) instead of
            speculators. An MLA draft is always written in the legacy layout
            (``Eagle3DeepseekV2ForCausalLM``, a ``deepseek_v2`` config): vLLM 0.32's speculators
            reader maps ``transformer_layer_config.model_type`` llama and qwen3 only.
        num_speculative_tokens: K written as the default proposal length.
        embed_tokens: optionally include the target embedding ``[V, H]`` (vLLM otherwise
            shares the target's).

    Raises:
        ExportError: missing or mis-shaped tensors (tensors the layout does not have are left out).
    """
    cfg: Eagle3Config = ckpt.config
    legacy = legacy or cfg.layer == "mla"  # vLLM 0.32's speculators reader builds llama / qwen3 layers only
    want = expected_weight_shapes(cfg)
    state = {k: v for k, v in ckpt.state.items() if k in want}
    check_tensor_set(state, want, str(ckpt.weights), "EAGLE-3")
    tensors = {(k.replace("layers.0.", "midlayer.") if legacy else k): v for k, v in state.items()}
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens
    meta, target = ckpt.meta, ckpt.meta.target
    if legacy:
        config = cfg.to_legacy(dtype, {"version": version, "verifier": target.get("verifier", target["name_or_path"])})
    else:
        config = cfg.to_speculators(verifier_of(target), num_speculative_tokens, dtype, SPECULATORS_VERSION,
                                    {"version": version, "ttt_steps": meta.ttt_steps, "target_path": target.get("path")})
    return tensors, config


def load_eagle3(path: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> Eagle3DraftModel:
    """An EAGLE-3 export (speculators format, or legacy ``LlamaForCausalLMEagle3`` with
    ``midlayer.*`` weights) as a float32 model in eval mode.

    Args:
        embed_tokens: the target's input embedding ``[V, H]``, used when the export has none
            (vLLM shares the target's embedding the same way).
        lm_head: unused (the draft has its own head).

    Raises:
        DraftLoadError: a config.json that is no EAGLE-3 export (:meth:`Eagle3Config.from_export`),
            missing / unexpected / mis-shaped tensors, or no embedding anywhere.
    """
    config, state, weights = read_export(Path(path), Eagle3Config.from_export)
    with_identity_vocab(state, config)
    embed = state.pop("embed_tokens.weight", embed_tokens)
    if embed is None:
        raise DraftLoadError(f"{weights}: no embed_tokens.weight and no target embedding given")
    model = Eagle3DraftModel(config)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise DraftLoadError(f"{weights}: {exc}") from exc
    if result.missing_keys or result.unexpected_keys:
        raise DraftLoadError(f"{weights}: missing tensors {result.missing_keys}, "
                             f"unexpected tensors {result.unexpected_keys}")
    return with_target_embedding(model, embed, path)


def with_identity_vocab(state: dict[str, torch.Tensor], cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """``state`` with the identity vocab mapping (``d2t`` zeros ``[V]``, ``t2d`` all True ``[V]``)
    when the draft predicts over the whole target vocab and ships none: the speculators library
    saves no ``d2t`` / ``t2d`` then, and vLLM maps no ids. Any other ``state`` is returned as is."""
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" not in state and "t2d" not in state:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return state


def eagle3_fit(config: dict[str, Any]) -> DraftFit:
    """What an EAGLE-3 export's ``config.json`` (either layout) must agree on with the target:
    read as vLLM reads it (:class:`Eagle3ExportFacts`), never raising for a missing key."""
    facts = Eagle3ExportFacts.read(config)
    return DraftFit(hidden_size=facts.hidden_size, target_hidden_size=facts.target_hidden_size,
                    vocab_size=facts.vocab_size, draft_vocab_size=facts.draft_vocab_size,
                    aux_layer_ids=facts.aux_layer_ids, verifier=facts.verifier, aux_count=3)


def eagle3_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about an EAGLE-3 export (either layout)."""
    facts = Eagle3ExportFacts.read(config)
    archs = config.get("architectures") or []
    fmt = "speculators" if facts.format == "speculators" else f"legacy {archs[0] if archs else ''}".strip()
    layer = layer_of(config.get("transformer_layer_config") or {} if facts.format == "speculators" else config)
    return [f"- method: EAGLE-3 (one {LAYER_NAMES[layer]} decoder layer over three target hidden states), format {fmt}",
            f"- aux hidden-state layer ids: {facts.aux_layer_ids} (vLLM convention: residual stream after L layers)",
            f"- draft vocab size: {facts.draft_vocab_size} of the target's {facts.vocab_size} tokens "
            "(d2t / t2d included)",
            f"- hidden size {facts.hidden_size}; norm_before_residual {facts.norm_before_residual}; "
            f"default num_speculative_tokens {facts.num_speculative_tokens or 3}"] + (
        ["- EAGLE-3.1 options: " + ", ".join(f"{k} {v}" for k, v in facts.eagle31.items())]
        if any(facts.eagle31.values()) else [])


EAGLE3_FORMAT = DraftFormat(
    layout="EAGLE-3", detect=is_eagle3_export, export=export_eagle3, load=load_eagle3, fit=eagle3_fit,
    card=DraftCard("EAGLE-3", "EAGLE-3 (arXiv:2503.01840)", eagle3_card_facts,
                   lambda config: Eagle3ExportFacts.read(config).num_speculative_tokens),
    export_options=("legacy", "num_speculative_tokens", "embed_tokens"), k_from_recipe=True)
