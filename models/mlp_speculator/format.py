"""The MLP-speculator export format: IBM's ``MLPSpeculatorPreTrainedModel`` layout (fms-extras;
vLLM <= 0.32's ``MLPSpeculator``; docs/formats.md, "Medusa and MLP speculator").

``config.json`` ``{architectures ["MLPSpeculatorPreTrainedModel"], model_type "mlp_speculator",
vocab_size, emb_dim, inner_dim, n_predict, top_k_tokens_per_head, n_candidates, tie_weights,
scale_input}``; ``model.safetensors`` with ``speculator.{emb,proj,head,ln}.{i}.weight`` and
``speculator.ln.{i}.bias`` for every stage (tied stages repeat the shared tensor, as IBM's
checkpoints do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint, ExportError
from ..common import DraftCard, DraftFormat, checkpoint_model, load_head_export
from .model import MLPSpeculator, MLPSpeculatorConfig

MLP_PREFIX = "speculator."


def mlp_speculator_weight_shapes(cfg: MLPSpeculatorConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of :class:`MLPSpeculator` (unprefixed module names) with its shape; the
    export adds ``speculator.``."""
    H, D, V = cfg.emb_dim, cfg.inner_dim, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.n_predict):
        out[f"emb.{i}.weight"] = (V, D)
        out[f"proj.{i}.weight"] = (D, H if i == 0 else D)
        out[f"head.{i}.weight"] = (V, D)
        out[f"ln.{i}.weight"] = (D,)
        out[f"ln.{i}.bias"] = (D,)
    return out


def is_mlp_speculator_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of an ``MLPSpeculatorPreTrainedModel`` export."""
    return config.get("model_type") == "mlp_speculator"


def export_mlp_speculator(ckpt: DraftCheckpoint, dtype: str,
                          version: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The ``MLPSpeculatorPreTrainedModel`` tensors and ``config.json`` of a checkpoint.

    Raises:
        ExportError: as :func:`~draftsmith.models.medusa.format.export_medusa`.
    """
    cfg: MLPSpeculatorConfig = ckpt.config
    model = checkpoint_model(ckpt, MLPSpeculator(cfg), mlp_speculator_weight_shapes(cfg), cfg.emb_dim, cfg.vocab_size)
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": cfg.vocab_size,
        "emb_dim": cfg.emb_dim,
        "inner_dim": cfg.inner_dim,
        "n_predict": cfg.n_predict,
        # tree width per stage for engines that build candidate trees (IBM's default shape)
        "top_k_tokens_per_head": [max(1, 5 - i) for i in range(cfg.n_predict)],
        "n_candidates": 5,
        "tie_weights": cfg.tie_weights,
        "scale_input": cfg.scale_input,
        "torch_dtype": dtype,
        "draftsmith": {"version": version, "verifier": ckpt.meta.verifier, "head_decay": ckpt.meta.head_decay},
    }
    return {MLP_PREFIX + k: v for k, v in model.state_dict().items()}, config


def load_mlp_speculator(directory: Path, embed_tokens: torch.Tensor | None = None,
                        lm_head: torch.Tensor | None = None) -> MLPSpeculator:
    """Rebuild :class:`MLPSpeculator` from an ``MLPSpeculatorPreTrainedModel`` export (float32);
    the target's tensors are not used.

    Raises:
        ExportError: not an MLP-speculator export, or its tensors do not match its config.
    """
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if cfg.get("model_type") != "mlp_speculator":
        raise ExportError(f"{directory}/config.json: model_type {cfg.get('model_type')!r}, expected 'mlp_speculator'")
    model = MLPSpeculator(MLPSpeculatorConfig(
        emb_dim=cfg["emb_dim"], inner_dim=cfg["inner_dim"], vocab_size=cfg["vocab_size"], n_predict=cfg["n_predict"],
        tie_weights=cfg["tie_weights"], scale_input=cfg["scale_input"]))
    return load_head_export(Path(directory), model, MLP_PREFIX)


def mlp_speculator_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about an MLP-speculator export."""
    return [f"- method: MLP speculator, {config.get('n_predict')} stages (each predicts one more token from the "
            "previous stage's state and token embedding)",
            f"- embedding size {config.get('emb_dim')}, inner size {config.get('inner_dim')}; vocab size "
            f"{config.get('vocab_size')} (the target's); tied stages {config.get('tie_weights')}"]


MLP_SPECULATOR_FORMAT = DraftFormat(
    layout="MLP speculator", detect=is_mlp_speculator_export, export=export_mlp_speculator, load=load_mlp_speculator,
    card=DraftCard("MLP speculator", "an MLP speculator (arXiv:2404.19124)", mlp_speculator_card_facts,
                   lambda config: config.get("n_predict")))
