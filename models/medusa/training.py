"""Medusa's training side: the :class:`MedusaMethod` (the method's ``training_method``,
:mod:`draftsmith.methods`) and the dry run's estimates.

Medusa-1 (arXiv:2401.10774): K ResBlock heads on the target's final hidden
state, head k trained with cross-entropy on x_{t+k+2} weighted ``draft.head_decay**k``
(the heads' labels and loss are :class:`~draftsmith.train.method_base.HeadMethod`'s, shared with
the MLP speculator).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...recipe import Recipe
from ...train.dry_run import Shapes, fused_loss_bytes, head_estimate, loss_chunk_rows
from ...train.method_base import HeadMethod
from ..common import LayerGeometry
from .model import MedusaConfig, MedusaModel


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train Medusa-1 heads on the target's final hidden states.

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=1e-3]
    draftsmith train RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``): target info and hidden-state
shards (only ``final_hidden_states`` is used) or, with ``data.hidden_states_mode: online``,
token ids with the target run in the job. Head k learns x_{t+k+2} with cross-entropy
against the (regenerated) reply tokens, weighted ``draft.head_decay**k`` (Medusa-1,
arXiv:2401.10774). Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics
(``loss_{k}``, ``acc_{k}`` per head) to ``RUN_DIR/metrics.jsonl``.
"""


class MedusaMethod(HeadMethod):
    """Medusa-1: K ResBlock heads on the final hidden state, full-vocab lm_heads, optionally
    started from the target's ``lm_head`` (``draft.init_from_target``)."""

    name = "medusa"
    help_text = TRAIN_HELP

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        H, V = self.check_target_vocab()
        cfg = recipe.draft
        self.config = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=cfg.num_heads, num_layers=cfg.num_layers)
        self.num_heads = cfg.num_heads

    def build_model(self) -> MedusaModel:
        model = MedusaModel(self.config)
        if self.recipe.draft.init_from_target:
            model.init_from_target(self.heads["lm_head"].float())
        return model

    def head_forward(self, model: nn.Module, final: torch.Tensor, tokens: torch.Tensor, head_fn: Any) -> list[Any]:
        return model(final, head_fn=head_fn)  # head k's rows (M, H) and lm_heads[k] to head_fn

    def draft_config(self) -> dict[str, Any]:
        return self.config.to_dict()


# --------------------------------------------------------------------------------------
# The dry run's estimates


def medusa_parameter_count(recipe: Recipe, hidden_size: int, vocab_size: int) -> dict[str, int]:
    """Trainable parameters of a Medusa draft by part (full target vocab)."""
    H, V, m = hidden_size, vocab_size, recipe.draft
    return {"resblocks": m.num_heads * m.num_layers * (H * H + H), "lm_heads": m.num_heads * V * H}


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """Medusa's parameter counts by part (:func:`medusa_parameter_count`; ``geometry`` gives the
    hidden size) and the logits estimate of its heads (:func:`~draftsmith.train.dry_run.head_estimate`)."""
    counts = medusa_parameter_count(recipe, geometry.hidden_size, vocab_size)
    return head_estimate(counts, recipe.draft.num_heads, recipe, vocab_size)


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """Medusa: K heads over the M = B*T gathered rows, each ``draft.num_layers`` ResBlocks and a
    full-vocab ``lm_head`` trained with chunked cross-entropy. The peak is the larger of the end
    of forward (under bf16 autocast every head's bf16 ``lm_head`` copy, K x V x H x 2 B, and the
    rows' ResBlock tensors, ``4 + 8 * K * layers`` B per unit of H) and the backward of a head
    (its bf16 ``lm_head`` weight and gradients, 3 x V x H x 2 B, and its rows)."""
    K, L, V, M = recipe.draft.num_heads, recipe.draft.num_layers, s.V, s.E
    cast = s.act_bytes if s.precision == "amp-bf16" else 0
    forward = {"head_weight_copies": K * V * s.H * cast, "block_weight_copies": K * L * s.H * s.H * cast,
               "rows": M * s.H * (4 + 8 * K * L), "loss_chunk": 2 * loss_chunk_rows(recipe, M, V) * V * 4}
    fused = fused_loss_bytes(recipe, s, M, K, V, labels=True)
    if fused is not None:  # every head's gradients held from forward; its bf16 weight copy freed after its call
        forward = {**forward, **fused, "head_weight_copies": 0}
    backward = {"head_weight_and_gradients": 3 * V * s.H * s.act_bytes, "rows": M * s.H * (4 + 8 * L)}
    return forward if sum(forward.values()) >= sum(backward.values()) else backward
