"""The Medusa export format, as vLLM <= 0.32 loads it (docs/formats.md, "Medusa and MLP speculator").

``speculative_config={"method": "medusa", "model": OUT_DIR, "num_speculative_tokens": K}``:
``config.json`` ``{architectures ["MedusaModel"], model_type "medusa", hidden_size, vocab_size,
num_heads, num_hidden_layers, truncated_vocab_size null, medusa_fc_bias true}``;
``model.safetensors`` with ``blocks.{k}.layers.{l}.weight|bias`` and ``lm_heads.{k}.weight``.
vLLM sizes the model from the config and drops weight names it does not know without a word,
so every name written here is one its ``Medusa`` module has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint, ExportError
from ..common import DraftCard, DraftFormat, checkpoint_model, load_head_export
from .model import MedusaConfig, MedusaModel


def medusa_weight_shapes(cfg: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an exported Medusa draft (vLLM names) with its shape."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    for k in range(cfg.num_heads):
        for layer in range(cfg.num_layers):
            out[f"blocks.{k}.layers.{layer}.weight"] = (H, H)
            out[f"blocks.{k}.layers.{layer}.bias"] = (H,)
        out[f"lm_heads.{k}.weight"] = (V, H)
    return out


def is_medusa_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a Medusa export (vLLM's ``MedusaModel``)."""
    return config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])


def export_medusa(ckpt: DraftCheckpoint, dtype: str, version: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The vLLM (<= 0.32) Medusa tensors and ``config.json`` of a checkpoint.

    Raises:
        ExportError: a draft config that disagrees with the recorded target (hidden size,
            vocab), or unexpected / mis-shaped / missing tensors.
    """
    cfg: MedusaConfig = ckpt.config
    model = checkpoint_model(ckpt, MedusaModel(cfg), medusa_weight_shapes(cfg), cfg.hidden_size, cfg.vocab_size)
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": None,
        "medusa_fc_bias": True,
        "torch_dtype": dtype,
        "draftsmith": {"version": version, "verifier": ckpt.meta.verifier, "head_decay": ckpt.meta.head_decay},
    }
    return model.state_dict(), config


def load_medusa(directory: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> MedusaModel:
    """Rebuild :class:`MedusaModel` from a Medusa export (float32); the target's tensors are
    not used (the heads are the draft's own).

    Raises:
        ExportError: not a Medusa export, or its tensors do not match its config.
    """
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if cfg.get("model_type") != "medusa":
        raise ExportError(f"{directory}/config.json: model_type {cfg.get('model_type')!r}, expected 'medusa'")
    model = MedusaModel(MedusaConfig(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                                     num_heads=cfg["num_heads"], num_layers=cfg["num_hidden_layers"]))
    return load_head_export(Path(directory), model, "")


def medusa_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about a Medusa export."""
    return [f"- method: Medusa, {config.get('num_heads')} heads (head k predicts the token k+1 ahead from the "
            f"target's last hidden state), {config.get('num_hidden_layers')} residual block(s) per head",
            f"- hidden size {config.get('hidden_size')}; vocab size {config.get('vocab_size')} (the target's)"]


MEDUSA_FORMAT = DraftFormat(layout="Medusa", detect=is_medusa_export, export=export_medusa, load=load_medusa,
                            card=DraftCard("Medusa", "Medusa heads (arXiv:2401.10774)", medusa_card_facts,
                                           lambda config: config.get("num_heads")))
