"""The :class:`Eagle3Method` that ``train/eagle3.py`` runs (``draftsmith.methods`` names it).

EAGLE-3 (arXiv:2503.01840): the draft layer unrolled ``train.ttt_steps`` times
(training-time test) on the fused aux hidden states, forward-KL loss against the target's
distribution over the draft vocab.
The entry script's docstring (its ``--help``) lists what a run reads and writes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..layout import DraftCheckpointConfig, read_vocab
from ..models.eagle3 import Eagle3Config, Eagle3DraftModel, ttt_prediction_mask
from ..recipe import Recipe
from .losses import TargetDraftHead, ttt_loss
from .method_base import TargetDataMethod

log = logging.getLogger("draftsmith.train.eagle3")


class Eagle3Method(TargetDataMethod):
    """EAGLE-3: fused aux states in, TTT unrolled ``train.ttt_steps`` times, forward-KL loss
    against the target distribution over the draft vocab."""

    name = "eagle3"

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        self.d2t, self.t2d = read_vocab(self.paths)
        self.config = Eagle3Config.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]),
            aux_layer_ids=self.target_info["aux_layer_ids"],
            norm_before_residual=recipe.draft.norm_before_residual,
        )
        if self.heads["lm_head"].shape[0] != self.t2d.shape[0]:
            raise ValueError(
                f"{self.paths.vocab}: t2d covers {self.t2d.shape[0]} target ids but the target lm_head has "
                f"{self.heads['lm_head'].shape[0]} rows (vocab built for another target?)"
            )
        self.target_head = TargetDraftHead.from_full(self.heads["lm_head"].float(), self.t2d)

    def build_model(self) -> Eagle3DraftModel:
        model = Eagle3DraftModel(self.config)
        init = self.recipe.draft.init_lm_head_from_target
        model.init_from_target(
            self.heads["embed_tokens"].float(),
            self.target_head.weight if init else None,
            self.heads["final_norm"].float() if init else None,
        )
        model.set_vocab_mapping(self.d2t, self.t2d)
        if self.recipe.draft.freeze_lm_head:
            model.lm_head.weight.requires_grad_(False)
        model.gradient_checkpointing = self.recipe.train.gradient_checkpointing
        return model

    def setup(self, accelerator) -> None:
        super().setup(accelerator)
        self.target_head.to(accelerator.device)

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.target_states(batch)
        aux = aux.to(param.dtype)  # (B, T, 3H)
        target_logits = self.target_head(final)  # (B, T, Vd), fp32
        K = self.recipe.train.ttt_steps
        # packed rows (train.packing) carry per-document positions and document ids
        docs = batch.get("document_ids")
        step_logits = model(batch["input_ids"], aux, K, batch["loss_mask"], batch.get("position_ids"), docs)
        # data parallel: normalise by the global token count (see ttt_loss)
        denominators = self.global_denominators(
            torch.stack([ttt_prediction_mask(batch["loss_mask"], k, docs).sum() for k in range(K)]))
        loss, m = ttt_loss(step_logits, target_logits, batch["loss_mask"], self.recipe.train.gamma, denominators,
                           docs)
        return loss, self.step_metrics(loss, m)

    def checkpoint_extras(self, directory: Path) -> None:
        DraftCheckpointConfig(method=self.name, config=self.config.to_dict(), target=self.target_info,
                              ttt_steps=self.recipe.train.ttt_steps).write(directory)
        save_file({"d2t": self.d2t, "t2d": self.t2d}, str(directory / "vocab.safetensors"))
