"""The DSpark export format: ``{"method": "dspark"}`` in vLLM 0.32, architecture
``Qwen3DSparkModel`` (``model_executor/models/qwen3_dspark.py``; docs/dspark.md).

The tensors are DFlash's (:func:`~draftsmith.models.dflash.format.expected_dflash_weights`, the
names vLLM's ``load_weights`` prefixes with ``model.``) plus the Markov head and, when enabled,
the confidence head. vLLM's loader is not strict (a missing tensor keeps its init values), so an
export is checked against :func:`expected_dspark_weights`, name by name and shape by shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpoint, DraftLoadError, ExportError
from ..common import DraftCard, DraftFit, DraftFormat, check_tensor_set
from ..dflash.format import dflash_fit, expected_dflash_weights, load_dflash
from .config import DSPARK_ARCHITECTURE, DSparkConfig
from .model import DSparkDraftModel


def expected_dspark_weights(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DSpark export holds, with its shape: DFlash's set, ``markov_head.markov_w1.weight
    [V, r]``, ``markov_head.markov_w2.weight [Vd, r]`` and, with ``cfg.confidence_head``,
    ``confidence_head.proj.weight [1, H (+ r)]`` and ``confidence_head.proj.bias [1]``."""
    out = expected_dflash_weights(cfg)
    out.update({"markov_head.markov_w1.weight": (cfg.vocab_size, cfg.markov_rank),
                "markov_head.markov_w2.weight": (cfg.draft_vocab_size, cfg.markov_rank)})
    if cfg.confidence_head:
        out.update({"confidence_head.proj.weight": (1, cfg.confidence_input_size),
                    "confidence_head.proj.bias": (1,)})
    return out


def is_dspark_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a ``Qwen3DSparkModel`` draft, or of a speculators DSpark
    checkpoint (``speculators_model_type: "dspark"``)."""
    return (DSPARK_ARCHITECTURE in (config.get("architectures") or [])
            or config.get("speculators_model_type") == DSparkConfig.speculators_type)


def check_dspark_k(cfg: DSparkConfig, num_speculative_tokens: int | None) -> int:
    """The K an export proposes: ``block_size`` (vLLM 0.32 defaults ``num_speculative_tokens``
    to the DSpark config's ``block_size``, and its Qwen3-Omni DSpark check requires equality).

    Raises:
        ExportError: ``num_speculative_tokens`` other than ``block_size``: vLLM would run a
            query block of a length the draft was never trained on.
    """
    if num_speculative_tokens is not None and num_speculative_tokens != cfg.block_size:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens}: this DSpark draft was trained with "
                          f"block_size={cfg.block_size} (anchor + {cfg.block_size - 1} mask slots, every slot a "
                          f"prediction), so its exports propose {cfg.block_size} tokens; retrain with "
                          f"draft.block_size={num_speculative_tokens} for another K")
    return cfg.block_size


def export_dspark(ckpt: DraftCheckpoint, dtype: str, version: str,
                  num_speculative_tokens: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and ``config.json`` (:meth:`DSparkConfig.to_dspark`) of a DSpark checkpoint.

    Raises:
        ExportError: tensors that do not match :func:`expected_dspark_weights` (named);
            ``num_speculative_tokens`` other than ``block_size`` (:func:`check_dspark_k`).
    """
    cfg: DSparkConfig = ckpt.config
    want = expected_dspark_weights(cfg)
    state = {k: v for k, v in ckpt.state.items() if k in want or k not in ("d2t", "t2d")}
    check_tensor_set(state, want, str(ckpt.weights), "DSpark")
    check_dspark_k(cfg, num_speculative_tokens)
    target = ckpt.meta.target
    return state, cfg.to_dspark(dtype, {"version": version, "target_path": target.get("path"),
                                        "verifier": target.get("verifier", target.get("name_or_path"))})


def load_dspark(path: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> DSparkDraftModel:
    """A DSpark draft from an export folder, float32, eval mode.

    Args:
        embed_tokens: the target's input embedding ``[V, H]`` (vLLM shares it); None leaves zeros.
        lm_head: the target's ``lm_head`` (unused: DSpark exports always ship ``lm_head``).

    Raises:
        DraftLoadError: not a DSpark config, missing keys, missing / unexpected / mis-shaped tensors.
    """
    return load_dflash(path, embed_tokens, lm_head, config_class=DSparkConfig, model_class=DSparkDraftModel,
                       expected=expected_dspark_weights, layout="DSpark")


def dspark_fit(config: dict[str, Any]) -> DraftFit:
    """What a DSpark export (either layout) must agree on with the target (DFlash's rule: aux ids from 1).

    Raises:
        DraftLoadError: not a readable DSpark config.
    """
    return dflash_fit(config, DSparkConfig)


def dspark_card_facts(config: dict[str, Any]) -> list[str]:
    """The model card's lines about a DSpark export."""
    cfg = DSparkConfig.from_export(config)
    conf = (f"confidence head over {'hidden + Markov embedding' if cfg.confidence_head_with_markov else 'hidden'}"
            if cfg.confidence_head else "no confidence head")
    return [f"- method: DSpark, {cfg.num_layers} Qwen3-style decoder layers drafting a block of {cfg.block_size} "
            f"positions (the pending token + {cfg.block_size - 1} mask slots, each predicting the next token) in one "
            f"bidirectional forward, then a rank-{cfg.markov_rank} Markov correction left to right; {conf}",
            f"- context: aux hidden-state layer ids {cfg.aux_layer_ids} (vLLM convention), fused by fc",
            f"- draft vocab size: {cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens; mask token id "
            f"{cfg.mask_token_id}",
            f"- num_speculative_tokens {cfg.block_size} (block_size); vLLM serves it on GPU only (V2 model runner)"]


def default_k(config: dict[str, Any]) -> int | None:
    """The K a DSpark export proposes: ``block_size``."""
    try:
        return DSparkConfig.from_export(config).block_size
    except (KeyError, TypeError, ValueError):
        return None


DSPARK_FORMAT = DraftFormat(
    layout="DSpark", detect=is_dspark_export, export=export_dspark, load=load_dspark, fit=dspark_fit,
    card=DraftCard("DSpark", "DSpark: DFlash block drafting (arXiv:2602.06036) with a sequential Markov head",
                   dspark_card_facts, default_k),
    export_options=("num_speculative_tokens",), refines="dflash")
