"""The DFlash2 export format (vLLM 0.32: ``{"method": "dflash"}``, architecture ``DFlash2DraftModel``;
docs/dflash2.md): DFlash's (:mod:`draftsmith.models.dflash.format`) with the convolution and
selector tensors and keys. Format A (speculators, ``speculators_model_type: "dflash2"``) is what
:func:`export_dflash2` writes; Format B (the flat ``DFlash2DraftModel`` config) is read too.

vLLM's loader is not strict (a missing tensor keeps its ``torch.empty`` init), so the export is
checked name by name and shape by shape against :func:`expected_dflash2_weights`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint
from ..common import DraftCard, DraftFit, DraftFormat
from ..dflash.format import (dflash_card_facts, dflash_fit, default_k, expected_dflash_weights, export_dflash,
                             load_dflash)
from .config import DFlash2Config
from .model import DFlash2DraftModel


def expected_dflash2_weights(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash2 export holds, with its shape: DFlash's (full vocab: ``lm_head [V, H]``,
    no ``d2t`` / ``t2d``) plus per layer i ``layers.i.{attention,mlp}_conv.base_kernel [2, T, H]``
    and ``layers.i.{attention,mlp}_conv.kernel_projection.weight [2*T*G, H]``, and
    ``candidate_selector.{predecessor,successor}_codebook [V, r]``,
    ``candidate_selector.hidden_projection.weight [r, H]``."""
    H, T, G, r, V = cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_groups, cfg.selector_rank, cfg.vocab_size
    out = expected_dflash_weights(cfg)
    for i in range(cfg.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, T, H)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * T * G, H)
    out.update({"candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
                "candidate_selector.hidden_projection.weight": (r, H)})
    return out


def is_dflash2_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a DFlash2 draft (Format A or B)."""
    return (config.get("speculators_model_type") == DFlash2Config.speculators_type
            or DFlash2Config.architecture in (config.get("architectures") or []))


def export_dflash2(ckpt: DraftCheckpoint, dtype: str, version: str,
                   num_speculative_tokens: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The Format A tensors and ``config.json`` of a DFlash2 checkpoint
    (:func:`~draftsmith.models.dflash.format.export_dflash` with :func:`expected_dflash2_weights`).

    Args:
        num_speculative_tokens: None or ``block_size - 1`` (vLLM's convolution block is
            ``1 + num_speculative_tokens``, its attention block too).

    Raises:
        ExportError: tensors that differ from :func:`expected_dflash2_weights` (named); another K.
    """
    return export_dflash(ckpt, dtype, version, num_speculative_tokens, expected=expected_dflash2_weights,
                         layout="DFlash2")


def load_dflash2(path: Path, embed_tokens: torch.Tensor | None = None,
                 lm_head: torch.Tensor | None = None) -> DFlash2DraftModel:
    """A DFlash2 draft from an export folder (Format A or B), float32, eval mode; ``embed_tokens``
    / ``lm_head`` as :func:`~draftsmith.models.dflash.format.load_dflash`.

    Raises:
        DraftLoadError: not a DFlash2 config, missing keys, missing / unexpected / mis-shaped tensors.
    """
    return load_dflash(path, embed_tokens, lm_head, config_class=DFlash2Config, model_class=DFlash2DraftModel,
                       expected=expected_dflash2_weights, layout="DFlash2")


def dflash2_fit(config: dict[str, Any]) -> DraftFit:
    """What a DFlash2 export must agree on with the target (as DFlash's).

    Raises:
        DraftLoadError: not a readable DFlash2 config.
    """
    return dflash_fit(config, DFlash2Config)


def dflash2_default_k(config: dict[str, Any]) -> int | None:
    """The K a DFlash2 export proposes: ``block_size - 1``."""
    return default_k(config, DFlash2Config)


def dflash2_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about a DFlash2 export."""
    cfg = DFlash2Config.from_export(config)
    return dflash_card_facts(config, DFlash2Config) + [
        f"- grouped dynamic convolutions: {cfg.conv_kernel_size} taps, groups of {cfg.conv_group_size} channels; "
        f"candidate selector: rank {cfg.selector_rank} over the top {cfg.selector_top_k} candidates per slot"]


DFLASH2_FORMAT = DraftFormat(
    layout="DFlash2", detect=is_dflash2_export, export=export_dflash2, load=load_dflash2,
    fit=dflash2_fit,
    card=DraftCard("DFlash2", "DFlash2 block drafting with a candidate selector (z-lab DFlash2)", dflash2_card_facts,
                   dflash2_default_k),
    export_options=("num_speculative_tokens",))
