"""The EAGLE-3 export format vLLM loads (``{"method": "eagle3"}``; docs/formats.md, "EAGLE-3").

- speculators (default; vLLM detects it by ``speculators_config``): ``config.json`` with
  ``architectures ["Eagle3DraftModel"]``, ``speculators_model_type "eagle3"``, the verifier,
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``,
  ``norm_before_residual`` (always written: vLLM assumes True when absent) and a one-layer
  ``transformer_layer_config``; weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``
  (with ``attention_bias`` / ``mlp_bias`` also the ``{q,k,v,o}_proj`` / ``{gate,up,down}_proj`` biases,
  which vLLM's ``llama_eagle3`` loads when the layer config sets those keys).
  EAGLE-3.1 (docs/formats.md, "EAGLE-3.1"): the top-level keys ``norm_before_fc``, ``fc_norm``,
  ``norm_output`` (written, all three, when any is on) and the tensors ``input_norm.weight``
  ``[3 * Ht]`` (``norm_before_fc``) and ``fc_norm.{0,1,2}.weight`` ``[Ht]`` (``fc_norm``).
- legacy (``legacy=True``): a Llama config with ``architectures ["LlamaForCausalLMEagle3"]``,
  ``eagle_config``, weights under ``midlayer.*``.

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
from .config import Eagle3Config, Eagle3ExportFacts
from .model import Eagle3DraftModel


def expected_weight_shapes(cfg: Eagle3Config, prefix: str = "layers.0.") -> dict[str, tuple[int, ...]]:
    """Every tensor an exported EAGLE-3 draft holds, with its shape.

    With ``attention_bias`` the draft layer has ``{q,k,v,o}_proj.bias`` and with ``mlp_bias``
    ``{gate,up,down}_proj.bias``: vLLM's ``llama_eagle3`` reads both keys from the layer config
    (``attention_bias`` -> ``qkv_proj`` and ``o_proj`` bias, ``mlp_bias`` -> ``gate_up_proj`` and
    ``down_proj`` bias) and loads the biases under these names, so they are exported too.
    EAGLE-3.1: ``norm_before_fc`` adds ``input_norm.weight`` ``[3 * Ht]``, ``fc_norm`` adds
    ``fc_norm.{i}.weight`` ``[Ht]`` for i in 0..2 (vLLM's ``LlamaModel.input_norm`` / ``fc_norm``);
    ``norm_output`` adds none.
    """
    H, Ht, nh, nkv, hd, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    optional: dict[str, tuple[int, ...]] = {}
    if cfg.attention_bias:
        optional.update({f"{prefix}self_attn.q_proj.bias": (nh * hd,), f"{prefix}self_attn.k_proj.bias": (nkv * hd,),
                         f"{prefix}self_attn.v_proj.bias": (nkv * hd,), f"{prefix}self_attn.o_proj.bias": (H,)})
    if cfg.mlp_bias:
        optional.update({f"{prefix}mlp.gate_proj.bias": (I,), f"{prefix}mlp.up_proj.bias": (I,),
                         f"{prefix}mlp.down_proj.bias": (H,)})
    if cfg.norm_before_fc:
        optional["input_norm.weight"] = (3 * Ht,)
    if cfg.fc_norm:
        optional.update({f"fc_norm.{i}.weight": (Ht,) for i in range(3)})
    return optional | {
        "fc.weight": (H, 3 * Ht),
        f"{prefix}self_attn.q_proj.weight": (nh * hd, 2 * H),
        f"{prefix}self_attn.k_proj.weight": (nkv * hd, 2 * H),
        f"{prefix}self_attn.v_proj.weight": (nkv * hd, 2 * H),
        f"{prefix}self_attn.o_proj.weight": (H, nh * hd),
        f"{prefix}mlp.gate_proj.weight": (I, H),
        f"{prefix}mlp.up_proj.weight": (I, H),
        f"{prefix}mlp.down_proj.weight": (H, I),
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}hidden_norm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def is_eagle3_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of an EAGLE-3 export (speculators or legacy layout)."""
    return (config.get("speculators_model_type") == "eagle3"
            or "LlamaForCausalLMEagle3" in (config.get("architectures") or []))


def export_eagle3(ckpt: DraftCheckpoint, dtype: str, version: str, legacy: bool = False,
                  num_speculative_tokens: int = 3,
                  embed_tokens: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The export tensors and ``config.json`` of an EAGLE-3 checkpoint.

    Args:
        legacy: the legacy ``LlamaForCausalLMEagle3`` layout instead of speculators.
        num_speculative_tokens: K written as the default proposal length.
        embed_tokens: optionally include the target embedding ``[V, H]`` (vLLM otherwise
            shares the target's).

    Raises:
        ExportError: missing or mis-shaped tensors (tensors the layout does not have are left out).
    """
    cfg: Eagle3Config = ckpt.config
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
    fmt = "speculators" if facts.format == "speculators" else "legacy LlamaForCausalLMEagle3"
    return [f"- method: EAGLE-3 (one Llama decoder layer over three target hidden states), format {fmt}",
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
