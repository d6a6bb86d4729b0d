"""The DFlash export format (``{"method": "dflash"}`` in vLLM 0.32; docs/formats.md, "DFlash").

Format A (speculators, what :func:`export_dflash` writes) and Format B (z-lab / ModelOpt
``DFlashDraftModel`` with ``dflash_config``, read by :func:`load_dflash`); their ``config.json``
mappings are :class:`~draftsmith.models.dflash.config.DFlashConfig`'s.

vLLM's DFlash ``load_weights`` is not strict: a tensor missing from ``model.safetensors`` is
left at its random / ones init without any error. The export is therefore checked against
:func:`expected_dflash_weights`, name by name and shape by shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ...layout import DraftCheckpoint, DraftLoadError, ExportError, read_export
from ..common import SPECULATORS_VERSION, DraftCard, DraftFit, DraftFormat, check_tensor_set, verifier_of, with_target_embedding
from .config import CANDIDATE_HEAD_ARCHITECTURES, DFlashConfig
from .model import DFlashDraftModel


def expected_dflash_weights(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash export holds, with its shape (docs/formats.md, "DFlash").

    ``lm_head.weight [Vd, H]`` is always shipped (the trained head; with Vd = V vLLM keeps it
    when it differs from the target's). ``d2t [Vd]`` and ``t2d [V]`` only when Vd < V: with a
    full vocab vLLM has no ``draft_id_to_target_id`` parameter to load ``d2t`` into. Never
    ``mask_hidden`` (vLLM asserts) and no ``embed_tokens`` (the target's is shared).
    """
    H, Ht, nh, nkv, hd, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(cfg.aux_layer_ids) * Ht), "hidden_norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out.update({
            f"{p}input_layernorm.weight": (H,),
            f"{p}self_attn.q_proj.weight": (nh * hd, H),
            f"{p}self_attn.k_proj.weight": (nkv * hd, H),
            f"{p}self_attn.v_proj.weight": (nkv * hd, H),
            f"{p}self_attn.o_proj.weight": (H, nh * hd),
            f"{p}self_attn.q_norm.weight": (hd,),
            f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}post_attention_layernorm.weight": (H,),
            f"{p}mlp.gate_proj.weight": (I, H),
            f"{p}mlp.up_proj.weight": (I, H),
            f"{p}mlp.down_proj.weight": (H, I),
        })
        if cfg.attention_bias:
            out.update({f"{p}self_attn.q_proj.bias": (nh * hd,), f"{p}self_attn.k_proj.bias": (nkv * hd,),
                        f"{p}self_attn.v_proj.bias": (nkv * hd,), f"{p}self_attn.o_proj.bias": (H,)})
    out.update({"norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H)})
    if cfg.draft_vocab_size < cfg.vocab_size:
        out.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    return out


def is_dflash_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a DFlash draft (Format A or B), not a DFlash architecture with a
    candidate head (:data:`~draftsmith.models.dflash.config.CANDIDATE_HEAD_ARCHITECTURES`). A format
    that extends DFlash's passes this test too and says so (``DraftFormat.refines``): the registry
    gives such a config to it (:func:`draftsmith.methods.method_of_export`)."""
    if set(config.get("architectures") or []) & set(CANDIDATE_HEAD_ARCHITECTURES):
        return False
    return config.get("speculators_model_type") == "dflash" or "dflash_config" in config


def export_dflash(ckpt: DraftCheckpoint, dtype: str, version: str, num_speculative_tokens: int | None = None, *,
                  expected: Callable[[Any], dict[str, tuple[int, ...]]] = expected_dflash_weights,
                  layout: str = "DFlash") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The Format A (speculators) tensors and ``config.json`` of a DFlash checkpoint (or, with
    ``expected`` / ``layout``, of a DFlash-family checkpoint whose config class writes its own).

    Args:
        num_speculative_tokens: K written as the default proposal length; None or
            ``block_size - 1``. Anything else is refused: vLLM would feed the draft a block of a
            length it was never trained on (bidirectional attention over the whole block), an
            untested train/serve mismatch. A smaller K can still be passed to vLLM at serve time.

    Raises:
        ExportError: tensors that do not match :func:`expected_dflash_weights`;
            ``num_speculative_tokens`` other than ``block_size - 1``.
    """
    cfg: DFlashConfig = ckpt.config
    want = expected(cfg)
    # the checkpoint always carries the vocab buffers; with a full vocab vLLM takes neither
    state = {k: v for k, v in ckpt.state.items() if k in want or k not in ("d2t", "t2d")}
    check_tensor_set(state, want, str(ckpt.weights), layout)
    K = cfg.block_size - 1
    if num_speculative_tokens is not None and num_speculative_tokens != K:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens}: this draft was trained with "
                          f"block_size={cfg.block_size}, so its exports propose {K} tokens (serve a smaller K "
                          "through vLLM's speculative_config if needed, or retrain with draft.block_size=K+1)")
    target = ckpt.meta.target
    config = cfg.to_speculators(verifier_of(target), K, dtype, SPECULATORS_VERSION,
                                {"version": version, "target_path": target.get("path")})
    return state, config


def load_dflash(path: Path, embed_tokens: torch.Tensor | None = None, lm_head: torch.Tensor | None = None, *,
                config_class: type[DFlashConfig] = DFlashConfig, model_class: type[DFlashDraftModel] = DFlashDraftModel,
                expected: Callable[[Any], dict[str, tuple[int, ...]]] = expected_dflash_weights,
                layout: str = "DFlash") -> DFlashDraftModel:
    """A DFlash draft from an export folder (Format A or B), float32, eval mode (a DFlash-family
    draft with ``config_class`` / ``model_class`` / ``expected`` / ``layout``).

    Args:
        embed_tokens: the target's input embedding ``[V, H]``, used when the export has none
            (vLLM shares the target's embedding the same way); None with no embedding in the
            export leaves a zero embedding (enough to inspect weights, not to propose).
        lm_head: the target's ``lm_head [V, H]``, used when a full-vocab export (Format B) ships
            none: vLLM then shares the target's head.

    Raises:
        DraftLoadError: not a DFlash config, missing keys, missing / unexpected / mis-shaped tensors.
    """
    path = Path(path)
    cfg, state, weights = read_export(path, config_class.from_export)
    embed = state.pop("embed_tokens.weight", embed_tokens)
    if "lm_head.weight" not in state and lm_head is not None and cfg.draft_vocab_size == cfg.vocab_size:
        state["lm_head.weight"] = lm_head.float()
    try:
        check_tensor_set(state, expected(cfg), str(weights), layout)
    except ExportError as exc:
        raise DraftLoadError(str(exc)) from None
    model = model_class(cfg)
    if cfg.draft_vocab_size == cfg.vocab_size:  # identity mapping
        state.update(d2t=torch.zeros(cfg.vocab_size, dtype=torch.long),
                     t2d=torch.ones(cfg.vocab_size, dtype=torch.bool))
    model.load_state_dict(state, strict=False)
    return with_target_embedding(model, embed, path)


def dflash_fit(config: dict[str, Any], config_class: type[DFlashConfig] = DFlashConfig) -> DraftFit:
    """What a DFlash export's ``config.json`` must agree on with the target (aux ids from 1:
    aux id 0 is the embedding output, never a DFlash context layer).

    Raises:
        DraftLoadError: not a readable DFlash config.
    """
    try:
        cfg = config_class.from_export(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftLoadError(f"config.json: {exc}") from None
    return DraftFit(hidden_size=cfg.hidden_size, target_hidden_size=cfg.target_hidden_size,
                    vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
                    aux_layer_ids=list(cfg.aux_layer_ids),
                    verifier=(config.get("speculators_config") or {}).get("verifier") or {}, aux_min=1)


def dflash_card_facts(config: dict[str, Any], config_class: type[DFlashConfig] = DFlashConfig) -> list[str]:
    """The model card's lines about a DFlash(-family) export (Format A or B)."""
    cfg = config_class.from_export(config)
    layout = ("speculators" if config.get("speculators_model_type") == cfg.speculators_type
              else f"z-lab / ModelOpt {cfg.architecture}")
    return [f"- method: {cfg.architecture.removesuffix('DraftModel')}, {cfg.num_layers} Qwen3-style decoder layers that draft a block of {cfg.block_size} "
            f"positions (the pending token + {cfg.block_size - 1} mask slots) in one bidirectional forward, format "
            f"{layout}",
            f"- context: aux hidden-state layer ids {cfg.aux_layer_ids} (vLLM convention: residual stream after L "
            "layers), fused by fc",
            f"- draft vocab size: {cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens; mask token id "
            f"{cfg.mask_token_id}",
            f"- hidden size {cfg.hidden_size}; num_speculative_tokens {cfg.block_size - 1} (block_size - 1, "
            "as trained)"]


def default_k(config: dict[str, Any], config_class: type[DFlashConfig] = DFlashConfig) -> int | None:
    """The K a DFlash export proposes: ``block_size - 1``."""
    try:
        return config_class.from_export(config).block_size - 1
    except (KeyError, TypeError, ValueError):
        return None


DFLASH_FORMAT = DraftFormat(
    layout="DFlash", detect=is_dflash_export, export=export_dflash, load=load_dflash, fit=dflash_fit,
    card=DraftCard("DFlash", "DFlash block drafting (arXiv:2602.06036)", dflash_card_facts, default_k),
    export_options=("num_speculative_tokens",))
