"""The :class:`Eagle3Method` that ``train/eagle3.py`` runs (``draftsmith.methods`` names it).

EAGLE-3 (arXiv:2503.01840): the draft layer unrolled ``train.ttt_steps`` times
(training-time test) on the fused aux hidden states, a divergence (``train.loss``, forward KL
by default) against the target's distribution over the draft vocab.
The entry script's docstring (its ``--help``) lists what a run reads and writes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..models.eagle3 import Eagle3Config, Eagle3DraftModel, shift_left, ttt_prediction_mask
from ..recipe import Recipe
from .losses import ttt_loss
from .method_base import DraftVocabMethod
from .validation import ValidationSpec, full_vocab_logits, simulated_chain
from .warm_start import WarmStartError, fit_problems, load_init_weights, read_init_draft, warm_config

log = logging.getLogger("draftsmith.train.eagle3")


class Eagle3Method(DraftVocabMethod):
    """EAGLE-3: fused aux states in, TTT unrolled ``train.ttt_steps`` times, ``train.loss`` against
    the target distribution over the draft vocab."""

    name = "eagle3"

    def __init__(self, recipe: Recipe, run_dir: Path, vocab_from_init: bool = False):
        """``vocab_from_init``: use the ``draft.init_from`` draft's own vocab (``d2t`` / ``t2d``)
        instead of the data's (evaluating a finished draft on other data, ``draftsmith simulate``).

        Raises:
            WarmStartError: ``draft.init_from`` unreadable or not fitting this run (before any step).
        """
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        self.init = None
        if recipe.draft.init_from:  # warm start: checked against this run before any step
            self.init = read_init_draft(recipe.draft.init_from)
            if vocab_from_init and "d2t" in self.init.tensors and "t2d" in self.init.tensors:
                self.use_vocab(self.init.tensors["d2t"].long(), self.init.tensors["t2d"].bool())
        self.config = Eagle3Config.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]),
            aux_layer_ids=self.target_info["aux_layer_ids"],
            norm_before_residual=recipe.draft.norm_before_residual,
        )
        if self.init is not None:
            problems = fit_problems(self.init, self.target_info, self.d2t)
            if problems:
                raise WarmStartError(f"draft.init_from={recipe.draft.init_from} does not fit this run "
                                     f"(target {self.target_info['name_or_path']}): " + "; ".join(problems))
            self.config = warm_config(self.init, self.config)

    def build_model(self) -> Eagle3DraftModel:
        model = self.init_draft(Eagle3DraftModel(self.config))
        if self.init is not None:
            load_init_weights(model, self.init)
        return model

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
                           docs, self.loss)
        return loss, self.step_metrics(loss, m)

    def validation_spec(self) -> ValidationSpec:
        """Chains of ``eval.num_speculative_tokens`` (the K vLLM serves) at ``train.eval_temperatures``;
        ``val_loss`` weights the first ``train.ttt_steps`` steps by ``gamma**k`` as training does."""
        t = self.recipe.train
        return ValidationSpec(self.recipe.eval.num_speculative_tokens, tuple(t.eval_temperatures),
                              tuple(t.gamma**k for k in range(t.ttt_steps)))

    @torch.no_grad()
    def validation_sums(self, model, batch):
        """Per-step loss / accuracy sums over the trained tokens and the simulated chains
        (:func:`~draftsmith.train.validation.simulated_chain`) of one validation batch."""
        param = next(p for p in model.parameters() if p.is_floating_point())
        aux, final = self.target_states(batch)
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        K = max(self.recipe.eval.num_speculative_tokens, self.recipe.train.ttt_steps)
        step_logits = model(batch["input_ids"], aux.to(param.dtype), K, mask, batch.get("position_ids"), docs)
        _, m = ttt_loss(step_logits[: self.recipe.train.ttt_steps], self.target_head(final), mask,
                        self.recipe.train.gamma, None, docs, self.loss)
        out = {}
        for k, (lk, ak, nk) in enumerate(zip(m.loss, m.acc, m.tokens)):
            out[f"loss_{k}"], out[f"acc_{k}"] = lk * nk, ak * nk
            out[f"loss_{k}_count"] = out[f"acc_{k}_count"] = nk
        spec = self.validation_spec()
        K = spec.num_draft_tokens
        masks = [ttt_prediction_mask(mask, k, docs) for k in range(K)]
        lm_head = self.heads["lm_head"]
        if lm_head.device != final.device:
            lm_head = self.heads["lm_head"] = lm_head.to(final.device)

        def target_logits(k: int) -> torch.Tensor:  # the target's full-vocab logits of x_{t+k+2}
            return full_vocab_logits(shift_left(final, k + 1)[masks[k]], lm_head)

        out.update(simulated_chain(step_logits[:K], masks, target_logits, self.d2t, list(spec.temperatures),
                                   self.recipe.train.eval_draft_sampling))
        return out

    def checkpoint_extras(self, directory: Path) -> None:
        super().checkpoint_extras(directory, ttt_steps=self.recipe.train.ttt_steps)
