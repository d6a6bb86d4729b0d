"""The XPress export format (docs/xpress.md): what vLLM 0.33 serves as ``{"method": "dflash"}``
with architecture ``Qwen3XPressModel`` (``model_executor/models/qwen3_xpress.py``), and beside it
what speculators 0.9 reads.

- ``config.json``: Format B (:meth:`~draftsmith.models.xpress.config.XPressConfig.to_native`), the
  flat Qwen3 config vLLM 0.33 builds the draft from. vLLM 0.33 has no speculators ``"xpress"``
  type (``transformers_utils/configs/speculators/algos.py``), so a speculators config cannot be
  served; speculators, for its part, reads only ``speculators_model_type`` configs (without one it
  converts the folder as a plain DFlash draft and refuses the refiner's tensors).
- ``speculators_config.json`` (:func:`speculators_sidecar`): the same draft as speculators'
  ``XPressSpeculatorConfig``; with :data:`SPECULATORS_KEY_MAPPING` (also written in it, under
  ``draftsmith``), ``XPressDraftModel.from_pretrained(export, config=..., key_mapping=...)`` loads
  the one ``model.safetensors``.

vLLM's loader is not strict (a missing tensor keeps its init values; only ``xpress_head.mix.L`` is
required), so the export is checked name by name and shape by shape against
:func:`expected_xpress_weights`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint
from ..common import SPECULATORS_VERSION, DraftCard, DraftFit, DraftFormat, verifier_of
from ..dflash.format import dflash_card_facts, dflash_fit, expected_dflash_weights, export_dflash, load_dflash
from .config import XPRESS_ARCHITECTURES, XPressConfig
from .model import XPressDraftModel

SPECULATORS_CONFIG = "speculators_config.json"
"""The export's second config file: the draft as speculators 0.9's ``XPressSpeculatorConfig``."""

SPECULATORS_KEY_MAPPING: dict[str, str] = {
    r"^xpress_head\.w1\.": "refiner_head.token_embed.",
    r"^xpress_head\.w2\.": "refiner_head.readout.",
    r"^xpress_head\.mix\.L$": "refiner_head.mix_l",
    r"^xpress_head\.mlp\.gate_proj\.": "refiner_head.mlp_gate.",
    r"^xpress_head\.mlp\.up_proj\.": "refiner_head.mlp_up.",
    r"^xpress_head\.mlp\.down_proj\.": "refiner_head.mlp_down.",
    r"^xpress_head\.": "refiner_head.",
}
"""transformers' ``from_pretrained(key_mapping=...)`` from the export's tensor names to speculators
0.9's ``XPressRefinerHead`` names (the first pattern that matches a name renames it); the DFlash
drafter's names are the same in both."""


def expected_xpress_weights(cfg: XPressConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an XPress export holds, with its shape: DFlash's over the full vocab (``lm_head
    [V, H]``, no ``d2t`` / ``t2d``) plus the nine tensors vLLM 0.33's ``Qwen3XPressForCausalLM.load_weights``
    maps into its refiner: ``xpress_head.w1.weight [V, r]``, ``xpress_head.down_h.weight`` and
    ``xpress_head.down_g.weight [r, H]``, ``xpress_head.in_proj.weight [r, 3r]``, ``xpress_head.mix.L
    [r, Bk, Bk]`` (raw, as trained), ``xpress_head.mlp.{gate,up}_proj.weight [m, r]``,
    ``xpress_head.mlp.down_proj.weight [r, m]``, ``xpress_head.w2.weight [V, r]``."""
    H, V, Bk, r, m = cfg.hidden_size, cfg.vocab_size, cfg.block_size, cfg.xpress_rank, cfg.mlp_hidden
    out = expected_dflash_weights(cfg)
    out.update({"xpress_head.w1.weight": (V, r), "xpress_head.down_h.weight": (r, H),
                "xpress_head.down_g.weight": (r, H), "xpress_head.in_proj.weight": (r, 3 * r),
                "xpress_head.mix.L": (r, Bk, Bk), "xpress_head.mlp.gate_proj.weight": (m, r),
                "xpress_head.mlp.up_proj.weight": (m, r), "xpress_head.mlp.down_proj.weight": (r, m),
                "xpress_head.w2.weight": (V, r)})
    return out


def is_xpress_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of an XPress draft (Format B, an XPress architecture) and for
    its ``speculators_config.json`` (Format A, ``speculators_model_type: "xpress"``)."""
    return (config.get("speculators_model_type") == XPressConfig.speculators_type
            or bool(set(config.get("architectures") or []) & set(XPRESS_ARCHITECTURES)))


def export_xpress(ckpt: DraftCheckpoint, dtype: str, version: str,
                  num_speculative_tokens: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the vLLM 0.33 ``config.json`` (Format B) of an XPress checkpoint; the
    verifier and the provenance go under ``draftsmith`` (:func:`speculators_sidecar` reads them).

    Args:
        num_speculative_tokens: None or ``block_size - 1``: vLLM 0.33 builds the refiner's mixer for
            ``xpress_block_size`` and runs it over ``1 + num_speculative_tokens`` rows.

    Raises:
        ExportError: tensors that differ from :func:`expected_xpress_weights` (named); another K.
    """
    state, _ = export_dflash(ckpt, dtype, version, num_speculative_tokens, expected=expected_xpress_weights,
                             layout="XPress")
    cfg: XPressConfig = ckpt.config
    target = ckpt.meta.target
    config = cfg.to_native(dtype)
    config["draftsmith"] = {"version": version, "target_path": target.get("path"), "verifier": verifier_of(target),
                            "num_target_layers": cfg.num_target_layers}
    return state, config


def speculators_sidecar(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"speculators_config.json": ...}``: the export's ``config.json`` (Format B) as speculators
    0.9's ``XPressSpeculatorConfig`` (Format A: ``speculators_model_type: "xpress"``, the verifier of
    ``draftsmith.verifier``), with :data:`SPECULATORS_KEY_MAPPING` under ``draftsmith``."""
    cfg = XPressConfig.from_export(config)
    extra = config.get("draftsmith") or {}
    verifier = extra.get("verifier") or {"name_or_path": None, "architectures": []}
    provenance = {k: v for k, v in extra.items() if k not in ("verifier", "num_target_layers")}
    out = cfg.to_speculators(verifier, cfg.block_size - 1, config.get("torch_dtype", "float32"), SPECULATORS_VERSION,
                             dict(provenance, key_mapping=SPECULATORS_KEY_MAPPING, weights="model.safetensors"))
    return {SPECULATORS_CONFIG: out}


def load_xpress(path: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> XPressDraftModel:
    """An XPress draft from an export folder (its ``config.json``: Format B, or A), float32, eval
    mode; ``embed_tokens`` / ``lm_head`` as :func:`~draftsmith.models.dflash.format.load_dflash`.

    Raises:
        DraftLoadError: not an XPress config, missing keys, missing / unexpected / mis-shaped tensors.
    """
    return load_dflash(path, embed_tokens, lm_head, config_class=XPressConfig, model_class=XPressDraftModel,
                       expected=expected_xpress_weights, layout="XPress")


def xpress_fit(config: dict[str, Any]) -> DraftFit:
    """What an XPress export must agree on with the target (DFlash's, the verifier from
    ``draftsmith.verifier`` in Format B).

    Raises:
        DraftLoadError: not a readable XPress config.
    """
    fit = dflash_fit(config, XPressConfig)
    return fit if fit.verifier else replace(fit, verifier=(config.get("draftsmith") or {}).get("verifier") or {})


def xpress_default_k(config: dict[str, Any]) -> int | None:
    """The K an XPress export proposes: ``block_size - 1`` (the only K vLLM 0.33 runs it at)."""
    try:
        return XPressConfig.from_export(config).block_size - 1
    except (KeyError, TypeError, ValueError):
        return None


def xpress_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about an XPress export."""
    cfg = XPressConfig.from_export(config)
    topc = f"the drafter's top {cfg.xpress_topc} tokens per slot" if cfg.xpress_topc else "the whole vocab"
    return dflash_card_facts(config, XPressConfig) + [
        f"- causal refiner: rank {cfg.xpress_rank}, SwiGLU {cfg.mlp_hidden}; {cfg.num_jacobi_passes} Jacobi passes "
        f"over {topc} (vLLM 0.33+, GPU; speculators 0.9 reads `{SPECULATORS_CONFIG}`)"]


XPRESS_FORMAT = DraftFormat(
    layout="XPress", detect=is_xpress_export, export=export_xpress, load=load_xpress, fit=xpress_fit,
    card=DraftCard("XPress", "XPress: DFlash block drafting with a causal refiner resolved by Jacobi passes",
                   xpress_card_facts, xpress_default_k),
    export_options=("num_speculative_tokens",), refines="dflash", sidecars=speculators_sidecar)
