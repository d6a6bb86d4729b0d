"""The P-EAGLE export format (docs/formats.md, "P-EAGLE"; docs/parallel_drafts.md).

The export is the speculators ``peagle`` format vLLM 0.32 reads (``update_peagle`` hook ->
``PeagleLlamaForCausalLM`` = ``llama_eagle3.Eagle3LlamaForCausalLM``) and serves with
``{"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}``, K <= the
trained ``num_depths``:

- ``config.json``: ``speculators_model_type "peagle"``, ``mask_token_id`` (vLLM's
  ``pard_token``), ``norm_before_residual`` (always written; absent means False for peagle),
  ``norm_before_fc``, ``eagle_aux_hidden_state_layer_ids``, a ``num_layers``-layer
  ``transformer_layer_config`` (:meth:`~draftsmith.models.peagle.config.PEagleConfig.to_speculators`);
- ``model.safetensors``: exactly :func:`expected_peagle_weights` (vLLM's draft loader is not
  strict: a missing tensor would stay uninitialised, so the exporter refuses any other set).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint, DraftLoadError, ExportError, read_export
from ..common import SPECULATORS_VERSION, DraftCard, DraftFit, DraftFormat, check_tensor_set, verifier_of, with_target_embedding
from ..eagle3.format import expected_weight_shapes, with_identity_vocab
from .config import PEagleConfig
from .model import PEagleDraftModel


def expected_peagle_weights(cfg: PEagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a P-EAGLE export holds, with its shape (docs/formats.md, "P-EAGLE").

    ``fc [H, 3Ht]``, ``mask_hidden [1, 1, 3Ht]`` (raw aux space), ``layers.0.*`` as EAGLE-3's
    layer (2H q/k/v inputs, ``hidden_norm``), ``layers.i>=1.*`` plain Llama blocks (H inputs, no
    ``hidden_norm``), ``norm``, ``lm_head [Vd, H]``, ``d2t [Vd]``, ``t2d [V]``, and
    ``embed_tokens.weight [V, H]`` iff the embeddings were trained. (No ``input_norm`` /
    ``fc_norm``: this draft uses neither.)
    """
    H, Ht = cfg.hidden_size, cfg.target_hidden_size
    out = dict(expected_weight_shapes(cfg))  # every layer: num_layers is the config's
    out["mask_hidden"] = (1, 1, 3 * Ht)
    if cfg.train_embeddings:
        out["embed_tokens.weight"] = (cfg.vocab_size, H)
    return out


def is_peagle_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a P-EAGLE export (speculators ``peagle``)."""
    return config.get("speculators_model_type") == "peagle"


def export_peagle(ckpt: DraftCheckpoint, dtype: str, version: str,
                  num_speculative_tokens: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The export tensors and ``config.json`` of a P-EAGLE checkpoint: training-checkpoint
    names -> export names (``mask_hidden`` reshaped, ``embed_tokens`` renamed; frozen buffers
    never reach the checkpoint).

    Args:
        num_speculative_tokens: K written as the default proposal length (default: the
            trained ``num_depths``); must be <= ``num_depths``.

    Raises:
        ExportError: a tensor set other than :func:`expected_peagle_weights`; K outside
            ``[1, num_depths]``.
    """
    cfg: PEagleConfig = ckpt.config
    tensors = {}
    for k, v in ckpt.state.items():
        if k == "mask_hidden":
            v = v.reshape(1, 1, -1)
        elif k == "embed_tokens":
            k = "embed_tokens.weight"
        tensors[k] = v
    check_tensor_set(tensors, expected_peagle_weights(cfg), str(ckpt.weights), "P-EAGLE")
    k = cfg.num_depths if num_speculative_tokens is None else num_speculative_tokens
    target = ckpt.meta.target
    try:
        config = cfg.to_speculators(verifier_of(target), k, dtype, SPECULATORS_VERSION,
                                    {"version": version, "num_depths": cfg.num_depths,
                                     "train_embeddings": cfg.train_embeddings, "target_path": target.get("path")})
    except ValueError as exc:
        raise ExportError(f"{ckpt.path}: {exc}") from None
    return tensors, config


def peagle_config(raw: dict[str, Any]) -> PEagleConfig:
    """The :class:`PEagleConfig` of a P-EAGLE ``config.json``.

    Raises:
        ValueError: another format (names its ``speculators_model_type``).
        KeyError: a required key is missing.
    """
    if not is_peagle_export(raw):
        raise ValueError(f"not a P-EAGLE export (speculators_model_type {raw.get('speculators_model_type')!r})")
    return PEagleConfig.from_speculators(raw)


def load_peagle(export_dir: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> PEagleDraftModel:
    """A P-EAGLE export as a float32 model in eval mode.

    Args:
        embed_tokens: the target's input embedding ``[V, H]``, used when the export has none
            (vLLM shares the target's embedding the same way).
        lm_head: unused (the draft has its own head).

    Raises:
        DraftLoadError: not a P-EAGLE export, a missing key, a tensor set other than
            :func:`expected_peagle_weights`, or no embedding anywhere.
    """
    cfg, state, weights = read_export(Path(export_dir), peagle_config)
    with_identity_vocab(state, cfg)
    cfg.train_embeddings = False  # loaded for inference: the embedding is a buffer either way
    want = expected_peagle_weights(cfg)
    want.pop("embed_tokens.weight", None)
    embed = state.pop("embed_tokens.weight", embed_tokens)
    try:
        check_tensor_set(state, want, str(weights), "P-EAGLE")
    except ExportError as exc:
        raise DraftLoadError(str(exc)) from None
    if embed is None:
        raise DraftLoadError(f"{weights}: no embed_tokens.weight and no target embedding given")
    model = PEagleDraftModel(cfg)
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    model.load_state_dict(state, strict=True)
    return with_target_embedding(model, embed, export_dir)


def peagle_fit(config: dict[str, Any]) -> DraftFit:
    """What a P-EAGLE export's ``config.json`` must agree on with the target: the EAGLE-3 facts
    plus ``mask_token_id`` (a target token) and K no larger than the trained ``num_depths``.

    Raises:
        DraftLoadError: not a P-EAGLE export.
    """
    if not is_peagle_export(config):
        raise DraftLoadError("config.json: not a P-EAGLE export")
    layer = config.get("transformer_layer_config") or {}
    mask = config.get("mask_token_id")
    k = default_k(config)
    return DraftFit(hidden_size=layer.get("hidden_size"), target_hidden_size=config.get("target_hidden_size"),
                    vocab_size=layer.get("vocab_size"), draft_vocab_size=config.get("draft_vocab_size"),
                    aux_layer_ids=list(config.get("eagle_aux_hidden_state_layer_ids") or []),
                    verifier=(config.get("speculators_config") or {}).get("verifier") or {}, aux_count=3,
                    mask_token_id=mask if isinstance(mask, int) else -1, num_speculative_tokens=k,
                    max_speculative_tokens=(config.get("draftsmith") or {}).get("num_depths"))


def peagle_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about a P-EAGLE export."""
    cfg = PEagleConfig.from_speculators(config)
    return [f"- method: P-EAGLE, EAGLE-3 with parallel drafting: {cfg.num_layers} decoder layers propose up to "
            f"{cfg.num_depths} tokens in one forward (the bonus token + mask slots of token id {cfg.mask_token_id})",
            f"- aux hidden-state layer ids: {cfg.aux_layer_ids} (vLLM convention: residual stream after L layers)",
            f"- draft vocab size: {cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens (d2t / t2d "
            f"included); trained embeddings {cfg.train_embeddings}",
            f"- hidden size {cfg.hidden_size}; default num_speculative_tokens {default_k(config)}, at most "
            f"{cfg.num_depths} (the trained depths)"]


def default_k(config: dict[str, Any]) -> int | None:
    """The K a P-EAGLE export proposes by default (its first proposal method's)."""
    return next((p.get("speculative_tokens") for p in (config.get("speculators_config") or {}).get("proposal_methods")
                 or []), None)


PEAGLE_FORMAT = DraftFormat(
    layout="P-EAGLE", detect=is_peagle_export, export=export_peagle, load=load_peagle, fit=peagle_fit,
    card=DraftCard("P-EAGLE", "P-EAGLE parallel drafting (arXiv:2602.01469)", peagle_card_facts, default_k),
    export_options=("num_speculative_tokens",))
