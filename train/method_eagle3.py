"""The :class:`Eagle3Method` that ``train/eagle3.py`` runs (``draftsmith.methods`` names it).

EAGLE-3 (arXiv:2503.01840): the draft layer unrolled ``draft.ttt_steps`` times
(training-time test) on the fused aux hidden states, a divergence (``draft.loss``, forward KL
by default) against the target's distribution over the draft vocab.
The entry script's docstring (its ``--help``) lists what a run reads and writes.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from ..models.eagle3.config import EAGLE31_OPTIONS, Eagle3Config
from ..models.eagle3.model import Eagle3DraftModel
from ..recipe import Recipe
from .labels import ttt_plan, ttt_prediction_masks
from .losses import chunk_rows, chunked_distill, ttt_loss
from .method_base import DraftVocabMethod
from .validation import ValidationSpec, accepted_sums, chain_alphas, full_vocab_logits
from .warm_start import WarmStartError, fit_problems, load_init_weights, read_init_draft, warm_config

log = logging.getLogger("draftsmith.train.eagle3")


def eagle3_batch_plan(batch: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    """:meth:`Eagle3Method.batch_plan`: the batch plus :func:`~draftsmith.train.labels.ttt_plan`
    (module-level so DataLoader workers can pickle it)."""
    return {**batch, **ttt_plan(ttt_prediction_masks(batch["loss_mask"], steps, batch.get("document_ids")))}


class Eagle3Method(DraftVocabMethod):
    """EAGLE-3: fused aux states in, TTT unrolled ``draft.ttt_steps`` times, ``draft.loss`` against
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
            **{k: getattr(recipe.draft, k) for k in EAGLE31_OPTIONS},
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
        if self.recipe.draft.init_layer_from_target is not None:
            index, tensors = self.target_layer(self.recipe.draft.init_layer_from_target)
            unused = model.init_layer_from_target(tensors)
            log.info("draft.init_layer_from_target: the draft layer starts from target layer %d", index)
            if unused:
                log.warning("draft.init_layer_from_target: target layer %d tensors the draft layer has no place "
                            "for, not copied: %s", index, unused)
        if self.recipe.draft.init_fc == "last_aux":
            model.init_fc_last_aux()
        return model

    def target_layer(self, index: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Target decoder layer ``index`` (negative: from the last) -> (its 0-based index, its
        tensors named without the ``model.layers.{i}.`` prefix), read from the target checkpoint
        without loading the model.

        Raises:
            ValueError: ``index`` outside the target's ``num_hidden_layers`` (both named).
            KeyError: the checkpoint holds no tensor of that layer.
        """
        from ..data_prep.target import load_target_layer_tensors

        n = int(self.target_info["num_hidden_layers"])
        if not -n <= index < n:
            raise ValueError(f"draft.init_layer_from_target={index}: the target has {n} decoder layers "
                             f"(0..{n - 1}, or -{n}..-1)")
        index %= n
        return index, load_target_layer_tensors(self.target_dir, index)

    def batch_plan(self):
        """The TTT rows of each step as index tensors, computed on the CPU batch in the DataLoader
        (:func:`~draftsmith.train.labels.ttt_plan`), so the step never reads a mask back."""
        return functools.partial(eagle3_batch_plan, steps=self.recipe.draft.ttt_steps)

    def compute_loss(self, model, batch):
        """The TTT loss ``sum_k gamma**k D_k`` (``draft.loss``), computed inside the draft's forward
        in chunks of rows (:func:`~draftsmith.train.losses.chunked_distill`): no step keeps its
        ``(M_k, Vd)`` logits, and the target's distribution is computed once per batch at the
        rows some step needs. No host read when the batch carries its plan (:meth:`batch_plan`).
        Metrics are device tensors."""
        aux, final = self.training_states(model, batch)  # (B, T, 3H)
        K = self.recipe.draft.ttt_steps
        # packed rows (train.packing) carry per-document positions and document ids
        docs = batch.get("document_ids")
        plan = batch if "ttt_index" in batch else ttt_plan(ttt_prediction_masks(batch["loss_mask"], K, docs))
        return ttt_loss(model, batch["input_ids"], aux, final, plan, K, self.target_head, self.recipe.draft.gamma,
                        self.loss, self.recipe.train.loss_chunk_rows, self.global_denominators,
                        batch.get("position_ids"), docs)

    def validation_spec(self) -> ValidationSpec:
        """Chains of ``eval.num_speculative_tokens`` (the K vLLM serves) at ``train.eval_temperatures``;
        ``val_loss`` weights the first ``draft.ttt_steps`` steps by ``gamma**k`` as training does."""
        d = self.recipe.draft
        return ValidationSpec(self.recipe.eval.num_speculative_tokens, tuple(self.recipe.train.eval_temperatures),
                              tuple(d.gamma**k for k in range(d.ttt_steps)))

    @torch.no_grad()
    def validation_sums(self, model, batch):
        """Per-step loss / accuracy sums over the trained tokens and the simulated chains
        (:func:`~draftsmith.train.validation.chain_alphas`) of one validation batch, reduced in
        chunks of rows inside the draft's forward: neither the draft's ``(M_k, Vd)`` logits nor
        the target's ``(M_k, V)`` full-vocab logits of a step ever exist whole."""
        param = next(p for p in model.parameters() if p.is_floating_point())
        aux, final = self.target_states(batch)
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        spec = self.validation_spec()
        K_train, K_chain = self.recipe.draft.ttt_steps, spec.num_draft_tokens
        K = max(K_chain, K_train)
        masks = ttt_prediction_masks(mask, K, docs)  # once per batch: the TTT rows and the chains
        plan = ttt_plan(masks)
        counts = plan["ttt_counts_host"]
        device = final.device
        index = torch.split(plan["ttt_index"].to(device), counts)
        teacher_index = torch.split(plan["ttt_teacher_index"].to(device), counts)
        teacher = self.target_head(final.flatten(0, 1).index_select(0, plan["ttt_teacher_rows"].to(device)))
        lm_head = self.heads["lm_head"]
        if lm_head.device != device:
            lm_head = self.heads["lm_head"] = lm_head.to(device)
        final_rows = final.flatten(0, 1)
        temperatures = list(spec.temperatures)
        rows = chunk_rows(int(lm_head.shape[0]), self.recipe.train.loss_chunk_rows)
        d2t = self.d2t.to(device)

        def step_head(k: int, hidden: torch.Tensor, logits_fn):
            h = hidden.flatten(0, 1).index_select(0, index[k])  # (M_k, H)
            out = {}
            if k < K_train:
                d = chunked_distill(h, logits_fn, teacher, teacher_index[k], h.new_ones(counts[k]), self.loss,
                                    self.recipe.train.loss_chunk_rows)
                out["loss"], out["acc"] = float(d.row_loss.sum()), float(d.row_hit.sum())
            if k < K_chain:  # the target's distribution of x_{t+k+2} is its row at t + k + 1
                parts = [chain_alphas(logits_fn(h[s:s + rows]), full_vocab_logits(final_rows[index[k][s:s + rows] + k + 1],
                                                                                  lm_head),
                                      d2t, temperatures, self.recipe.train.eval_draft_sampling)
                         for s in range(0, counts[k], rows)]
                out["alphas"] = {t: torch.cat([p[t] for p in parts]) if parts else h.new_zeros(0) for t in temperatures}
            return out

        outs = model(batch["input_ids"], aux.to(param.dtype), K, None, batch.get("position_ids"), docs,
                     step_head=step_head)
        result = {}
        for k in range(K_train):
            result[f"loss_{k}"], result[f"acc_{k}"] = outs[k]["loss"], outs[k]["acc"]
            result[f"loss_{k}_count"] = result[f"acc_{k}_count"] = counts[k]
        result.update(accepted_sums([outs[k]["alphas"] for k in range(K_chain)], masks[:K_chain], temperatures))
        return result

    def checkpoint_extras(self, directory: Path) -> None:
        super().checkpoint_extras(directory, ttt_steps=self.recipe.draft.ttt_steps)
