"""The MTP export: the target's ``config.json`` and the fine-tuned MTP layer's tensors under the
names the target checkpoint ships them with (docs/mtp.md).

vLLM (0.32) serves it as ``speculative_config={"method": "mtp", "model": OUT_DIR,
"num_speculative_tokens": K}``: ``SpeculativeConfig`` builds the draft's ``ModelConfig`` from
``OUT_DIR/config.json`` (``model_type`` ``deepseek_v3`` / ``qwen3_next``, rewritten by
``hf_config_override`` to ``deepseek_mtp`` / ``qwen3_next_mtp``: ``DeepSeekMTPModel`` /
``Qwen3NextMTP``) and loads every ``*.safetensors`` of ``OUT_DIR``; the loaders keep only the
MTP layer's names (``model.layers.{num_hidden_layers}.*`` / ``mtp.*``) and vLLM's proposer
then replaces the layer's embedding and ``lm_head`` with the target's
(``_maybe_share_embeddings`` / ``_maybe_share_lm_head``: always for MTP at pipeline parallel 1),
so the export carries neither. Without ``model``, vLLM loads the MTP layer from the target's
own checkpoint (the untrained one).

``config.json`` is the target's with ``quantization_config`` dropped (the export's weights are
unquantised even for an FP8 target, and vLLM would otherwise expect FP8 MTP tensors) and the
export's dtype as both ``torch_dtype`` and ``dtype``: transformers 5 writes ``dtype`` into a
target's config and reads it before ``torch_dtype``, so a target's ``dtype`` kept as it was would
state float32 for bf16 weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint, ExportError
from ..common import DraftCard, DraftFit, DraftFormat
from .config import FAMILIES, MTPConfig, family_of, shipped_layer_count
from .model import MTPDraftModel
from .weights import load_mtp_state, to_checkpoint


def mtp_weight_shapes(cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an exported MTP layer (shipped names) with its shape."""
    with torch.device("meta"):
        model = MTPDraftModel(cfg)
    return {k: tuple(v.shape) for k, v in to_checkpoint(model.state_dict(), cfg).items()}


def is_mtp_export(config: dict[str, Any]) -> bool:
    """True for a ``config.json`` of a target family with MTP layers that declares some (an MTP
    export, or the target itself: vLLM reads both the same way)."""
    family = family_of(config)
    return family is not None and shipped_layer_count(config, family) > 0


def export_mtp(ckpt: DraftCheckpoint, dtype: str, version: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The shipped-name tensors and ``config.json`` of a checkpoint's MTP layer.

    Raises:
        ExportError: a draft config that disagrees with the recorded target (hidden size, vocab),
            or tensors missing / mis-shaped for the config.
    """
    cfg = MTPConfig(**ckpt.config) if isinstance(ckpt.config, dict) else ckpt.config
    target = ckpt.meta.target
    for key, have in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if target.get(key) != have:
            raise ExportError(f"{ckpt.path / 'draft_config.json'}: draft {key} is {have} but the target it was "
                              f"trained on has target.{key}={target.get(key)!r}")
    state = {k: v for k, v in ckpt.state.items() if k.startswith("mtp.")}
    want = mtp_weight_shapes(cfg)
    tensors = to_checkpoint(state, cfg)
    bad = sorted(set(want) ^ set(tensors)) + sorted(k for k in want if k in tensors and tuple(tensors[k].shape) != want[k])
    if bad:
        raise ExportError(f"{ckpt.weights}: MTP tensors missing, unexpected or mis-shaped: {bad[:8]}")
    config = {k: v for k, v in cfg.target_config.items() if k != "quantization_config"}
    config["torch_dtype"] = config["dtype"] = dtype
    config["draftsmith"] = {"version": version, "method": "mtp", "verifier": ckpt.meta.verifier,
                            "ttt_steps": ckpt.meta.ttt_steps}
    return tensors, config


def load_mtp(directory: Path, embed_tokens: torch.Tensor | None = None,
             lm_head: torch.Tensor | None = None) -> MTPDraftModel:
    """Rebuild :class:`MTPDraftModel` (float32, eval mode) from an MTP export (or a target
    checkpoint that ships its MTP layer) with the target's ``embed_tokens`` / ``lm_head``
    ``[V, H]`` (vLLM shares both; without them the model computes no logits).

    Raises:
        ExportError: not an MTP config, or its MTP tensors are missing / mis-shaped.
    """
    from ...target import checkpoint_weight_map, load_target_tensors

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    family = family_of(config)
    if family is None or not shipped_layer_count(config, family):
        raise ExportError(f"{directory}/config.json: model_type {config.get('model_type')!r} declares no MTP layer "
                          f"({', '.join(FAMILIES)})")
    config.pop("draftsmith", None)
    cfg = MTPConfig(family.name, config, shipped_layer_count(config, family))
    model = MTPDraftModel(cfg)
    weight_map = checkpoint_weight_map(directory)
    prefix = family.layer_prefix(cfg.num_hidden_layers, 0)
    tensors = load_target_tensors(directory, {n: [n] for n in weight_map if n.startswith(prefix)}, weight_map)
    try:
        load_mtp_state(model, tensors)
    except (KeyError, ValueError) as exc:
        raise ExportError(f"{directory}: {exc}") from None
    if embed_tokens is not None and lm_head is not None:
        model.init_from_target(embed_tokens.float(), lm_head.float())
    return model.float().eval()


def mtp_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about an MTP export."""
    family = family_of(config)
    return [f"- method: the target's own multi-token-prediction layer ({family.name if family else '?'}), fine-tuned; "
            "vLLM reuses it for every drafted token",
            f"- hidden size {config.get('hidden_size')}; vocab size {config.get('vocab_size')} (the target's embedding "
            "and lm_head, shared at load time)"]


def mtp_fit(config: dict[str, Any]) -> DraftFit:
    """What an MTP export must agree on with its target: hidden size, vocab (it computes with the
    target's embedding and ``lm_head``) and architecture (the family's decoder layer)."""
    return DraftFit(hidden_size=config.get("hidden_size"), target_hidden_size=None,
                    vocab_size=config.get("vocab_size"), draft_vocab_size=None, aux_layer_ids=None,
                    verifier={"architectures": config.get("architectures"),
                              "name_or_path": (config.get("draftsmith") or {}).get("verifier")})


MTP_FORMAT = DraftFormat(layout="MTP", detect=is_mtp_export, export=export_mtp, load=load_mtp, fit=mtp_fit,
                         card=DraftCard("MTP", "multi-token prediction (DeepSeek-V3, arXiv:2412.19437)",
                                        mtp_card_facts, lambda config: 1))
