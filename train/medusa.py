"""Train Medusa-1 heads on the target's final hidden states.

    accelerate launch train/medusa.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=1e-3]
    python train/medusa.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``data_prep/prepare.py``): target info and hidden-state
shards (only ``final_hidden_states`` is used) or, with ``data.hidden_states_mode: online``,
token ids with the target run in the job. Head k learns x_{t+k+2} with cross-entropy
against the (regenerated) reply tokens, weighted ``train.head_decay**k`` (Medusa-1,
arXiv:2401.10774). Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics
(``loss_{k}``, ``acc_{k}`` per head) to ``RUN_DIR/metrics.jsonl``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.models.medusa import MedusaConfig, MedusaModel
from draftsmith.recipe import Recipe
from draftsmith.train.losses import HeadTargets
from draftsmith.train.method_base import HeadMethod, train_main


class MedusaMethod(HeadMethod):
    """Medusa-1: K ResBlock heads on the final hidden state, full-vocab lm_heads, optionally
    started from the target's ``lm_head`` (``draft.medusa.init_from_target``)."""

    name = "medusa"

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        H, V = self.check_target_vocab()
        cfg = recipe.draft.medusa
        self.config = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=cfg.num_heads, num_layers=cfg.num_layers)
        self.num_heads = cfg.num_heads

    def build_model(self) -> MedusaModel:
        model = MedusaModel(self.config)
        if self.recipe.draft.medusa.init_from_target:
            model.init_from_target(self.heads["lm_head"].float())
        return model

    def head_logits(self, model: nn.Module, final: torch.Tensor, targets: HeadTargets) -> torch.Tensor:
        return model(final).squeeze(2)  # (K, M, 1, V) -> (K, M, V)

    def draft_config(self) -> dict[str, Any]:
        return self.config.to_dict()


def main(argv: list[str] | None = None) -> int:
    return train_main(MedusaMethod, "train/medusa.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
