"""The :class:`MedusaMethod` that ``train/medusa.py`` runs (``draftsmith.methods`` names it).

Medusa-1 (arXiv:2401.10774): K ResBlock heads on the target's final hidden
state, head k trained with cross-entropy on x_{t+k+2} weighted ``draft.head_decay**k``.
The entry script's docstring (its ``--help``) lists what a run reads and writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.medusa.model import MedusaConfig, MedusaModel
from ..recipe import Recipe
from .method_base import HeadMethod


class MedusaMethod(HeadMethod):
    """Medusa-1: K ResBlock heads on the final hidden state, full-vocab lm_heads, optionally
    started from the target's ``lm_head`` (``draft.init_from_target``)."""

    name = "medusa"

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
