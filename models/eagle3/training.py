"""EAGLE-3's training side: the :class:`Eagle3Method` (the method's ``training_method``,
:mod:`draftsmith.methods`), its TTT rows and loss, and the dry run's estimates; its warm start
(``draft.init_from``) is :mod:`draftsmith.models.eagle3.warm_start`.

EAGLE-3 (arXiv:2503.01840): the draft layer unrolled ``draft.ttt_steps`` times
(training-time test) on the fused aux hidden states, a divergence (``draft.loss``, forward KL
by default) against the target's distribution over the draft vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ...draft_section import sliding_window_problem
from ...recipe import Recipe
from ...target import text_config
from ...train.dry_run import (
    LayerBytes,
    Shapes,
    fused_loss_bytes,
    gqa_expanded_kv,
    input_cast,
    loss_chunk_bytes,
    weight_copies,
)
from ...train.labels import ttt_prediction_masks
from ...train.losses import AcceptSpec, LossSpec, chunk_rows, chunked_distill
from ...train.opd_loss import opd_distill
from ...train.method_base import DraftVocabMethod
from ...train.validation import ValidationSpec, accepted_sums, chain_alphas, full_vocab_logits
from ..common import LayerGeometry
from .config import EAGLE31_OPTIONS, Eagle3Config
from .model import Eagle3DraftModel
from .warm_start import WarmStartError, fit_problems, load_init_weights, read_init_draft, warm_config

log = logging.getLogger("draftsmith.train.eagle3")


def eagle3_batch_plan(batch: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    """:meth:`Eagle3Method.batch_plan`: the batch plus :func:`ttt_plan`
    (module-level so DataLoader workers can pickle it)."""
    return {**batch, **ttt_plan(ttt_prediction_masks(batch["loss_mask"], steps, batch.get("document_ids")))}


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train an EAGLE-3 draft with training-time test.

    accelerate launch train/eagle3.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=3e-4]
    python train/eagle3.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``): target info, draft vocab and
hidden-state shards. Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to
``RUN_DIR/metrics.jsonl``.
"""


class Eagle3Method(DraftVocabMethod):
    """EAGLE-3: fused aux states in, TTT unrolled ``draft.ttt_steps`` times, ``draft.loss`` against
    the target distribution over the draft vocab."""

    name = "eagle3"
    help_text = TRAIN_HELP

    def __init__(self, recipe: Recipe, run_dir: Path, vocab_from_init: bool = False):
        """``vocab_from_init``: use the ``draft.init_from`` draft's own vocab (``d2t`` / ``t2d``)
        instead of the data's (evaluating a finished draft on other data, ``draftsmith simulate``).

        Raises:
            ValueError: ``draft.sliding_window`` larger than the target's context (one line).
            WarmStartError: ``draft.init_from`` unreadable or not fitting this run (before any step).
        """
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        self.init = None
        if recipe.draft.init_from:  # warm start: checked against this run before any step
            self.init = read_init_draft(recipe.draft.init_from)
            if vocab_from_init and "d2t" in self.init.tensors and "t2d" in self.init.tensors:
                self.use_vocab(self.init.tensors["d2t"].long(), self.init.tensors["t2d"].bool())
        target_config = AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code)
        problem = sliding_window_problem(recipe.draft.sliding_window,
                                         getattr(text_config(target_config), "max_position_embeddings", None))
        if problem:
            raise ValueError(f"{problem} ({self.target_dir})")
        self.config = Eagle3Config.from_target(
            target_config,
            draft_vocab_size=int(self.d2t.shape[0]),
            aux_layer_ids=self.target_info.aux_layer_ids,
            norm_before_residual=recipe.draft.norm_before_residual,
            sliding_window=recipe.draft.sliding_window,
            layer=recipe.draft.layer,
            num_layers=recipe.draft.num_layers,
            mla=recipe.draft.mla.model_dump(),
            **{k: getattr(recipe.draft, k) for k in EAGLE31_OPTIONS},
        )
        if self.init is not None:
            problems = fit_problems(self.init, self.target_info, self.d2t)
            if problems:
                raise WarmStartError(f"draft.init_from={recipe.draft.init_from} does not fit this run "
                                     f"(target {self.target_info.name_or_path}): " + "; ".join(problems))
            # the init draft's geometry and window (warm_config), but at least the target's context: a
            # draft published for a shorter one would otherwise be exported below the target's
            warm = warm_config(self.init, self.config)
            self.config = dataclasses.replace(warm, max_position_embeddings=max(
                warm.max_position_embeddings, self.config.max_position_embeddings))

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
        from ...target import load_target_layer_tensors

        n = int(self.target_info.num_hidden_layers)
        if not -n <= index < n:
            raise ValueError(f"draft.init_layer_from_target={index}: the target has {n} decoder layers "
                             f"(0..{n - 1}, or -{n}..-1)")
        index %= n
        return index, load_target_layer_tensors(self.target_dir, index)

    def batch_plan(self):
        """The TTT rows of each step as index tensors, computed on the CPU batch in the DataLoader
        (:func:`ttt_plan`), so the step never reads a mask back."""
        return functools.partial(eagle3_batch_plan, steps=self.recipe.draft.ttt_steps)

    def compute_loss(self, model, batch):
        """The TTT loss ``sum_k gamma**k D_k`` (``draft.loss``; with ``draft.accept_weighting`` each
        row of step k also weighted by its chain's acceptance over steps j < k), computed inside the draft's forward
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
                        batch.get("position_ids"), docs, fused=getattr(self.recipe.train, "fused_loss", None),
                        accept=AcceptSpec.from_recipe(self.recipe))

    def validation_spec(self) -> ValidationSpec:
        """Chains of ``eval.num_speculative_tokens`` (the K vLLM serves) at the recipe's validation
        temperatures (``train.eval_temperatures``, else the served ``eval.temperature`` and 0);
        ``val_loss`` weights the first ``draft.ttt_steps`` steps by ``gamma**k`` as training does."""
        d = self.recipe.draft
        return ValidationSpec(self.recipe.eval.num_speculative_tokens, tuple(self.recipe.validation_temperatures),
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
                                    self.recipe.train.loss_chunk_rows,
                                    fused=getattr(self.recipe.train, "fused_loss", None))
                out["loss"], out["acc"] = float(d.row_loss.sum()), float(d.row_hit.sum())
            if k < K_chain:  # the target's distribution of x_{t+k+2} is its row at t + k + 1
                parts = [chain_alphas(logits_fn(h[s:s + rows]), full_vocab_logits(final_rows[index[k][s:s + rows] + k + 1],
                                                                                  lm_head),
                                      d2t, temperatures, self.recipe.validation_draft_sampling)
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


# --------------------------------------------------------------------------------------
# The TTT rows and the TTT loss


def ttt_plan(masks: list[torch.Tensor]) -> dict[str, Any]:
    """Which rows each TTT step trains on, as index tensors: run on the CPU batch (in the
    DataLoader) so that the training step gathers with indices of known size instead of boolean
    masks (which read the mask back to the host).

    Step k trains position t when ``masks[k]`` selects it
    (:func:`~draftsmith.train.labels.ttt_prediction_masks`, computed once per batch by the
    caller); its teacher is the target's distribution of x_{t+k+2}, i.e. the target's row at
    position t+k+1.

    Args:
        masks: K ``(B, T)`` bool prediction masks, K >= 1.

    Returns:
        ``ttt_index (sum M_k,)`` int64 flat positions ``b * T + t``, step-major (step 0's M_0 rows
        first); ``ttt_teacher_rows (N,)`` int64 flat positions whose target distribution some step
        needs (each once); ``ttt_teacher_index (sum M_k,)`` int64 the row of ``ttt_teacher_rows``
        each trained row distils from; ``ttt_counts (K,)`` int64 M_k; ``ttt_counts_host`` the same
        as a list of python ints.
    """
    B, T = masks[0].shape
    device = masks[0].device
    flat = torch.arange(B * T, device=device).view(B, T)
    need = torch.zeros(B, T + 1, dtype=torch.bool, device=device)
    for k, sel in enumerate(masks):  # row t + k + 1 (< T for every selected t)
        need[:, k + 1 : T + 1] |= sel[:, : T - k]
    need = need[:, :T]
    lookup = need.flatten().cumsum(0) - 1  # flat position -> teacher row
    index = [flat[sel] for sel in masks]
    teacher_index = [lookup[i + k + 1] for k, i in enumerate(index)]
    counts = [int(i.numel()) for i in index]
    return {"ttt_index": torch.cat(index), "ttt_teacher_rows": flat[need],
            "ttt_teacher_index": torch.cat(teacher_index), "ttt_counts": torch.tensor(counts, dtype=torch.long),
            "ttt_counts_host": counts}


def ttt_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, plan: dict[str, Any],
             steps: int, head: Callable[[torch.Tensor], torch.Tensor], gamma: float, loss: LossSpec | None = None,
             chunk_size: int | None = None, global_denominators: Callable[[torch.Tensor], Any] | None = None,
             position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
             fused: str | bool | None = None,
             accept: AcceptSpec | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The TTT loss ``sum_k gamma**k D_k``: the draft unrolled ``steps`` times with the chunked
    divergence (:func:`~draftsmith.train.losses.chunked_distill`) as its step head, without host reads.

    Args:
        model: the :class:`~draftsmith.models.eagle3.Eagle3DraftModel` (possibly wrapped).
        input_ids / position_ids / document_ids: ``(B, T)`` the batch.
        aux: ``(B, T, 3*Ht)`` aux states in the draft's dtype; final: ``(B, T, Ht)`` the target's
            final hidden states.
        plan: :func:`ttt_plan` of the batch (its rows per step).
        steps: K. head: the target head over the draft vocab (``TargetDraftHead``), run once per
            batch at the rows some step needs. gamma: the step decay.
        loss: ``train.loss``; None: forward KL. chunk_size: rows per loss chunk.
        global_denominators: data parallel: ``(K,)`` local counts -> the global counts over the
            world size, or None on one process.
        fused: ``train.fused_loss`` (:func:`~draftsmith.train.losses.chunked_distill`'s ``fused``).
        accept: ``draft.accept_weighting`` (:class:`~draftsmith.train.losses.AcceptSpec`); None or
            ``none``: every row of step k weighs ``gamma**k`` (today's loss, bit for bit). Else row
            t of step k also weighs ``reach_k(t) = prod_{j<k} a_j(t)``, detached: the chain started
            at position t is the same flat position at every step (step k at t predicts x_{t+k+2}
            after the draft's own steps 0..k-1 at t), and ``a_j(t)`` is step j's argmax hit at t
            (hard) or its expected acceptance at the served temperature (soft); a step that has no
            row at t (its token outside the loss mask) passes the chain on (factor 1). The product
            is carried over a ``(B*T,)`` device vector from step to step: no host read. With
            ``accept.opd`` (``draft.opd``, :mod:`draftsmith.train.opd_loss`) the rows of step k >= 1
            also get ``gamma**k / M_k * (1 - reach_k(t)) * opd_gamma**k * KL(q || p)``.

    Returns:
        ``(loss, metrics)``: ``D_k`` is step k's summed (weighted) divergence over its M_k rows divided by
        M_k (or the data-parallel denominator; rows the chain does not reach count with weight 0);
        metrics ``loss``, ``loss_{k}``, ``acc_{k}`` (argmax agreement over the step's rows; unweighted),
        with ``accept`` also ``reach_{k}`` (k >= 1: the mean reach over step k's rows), detached
        0-dim tensors.
    """
    counts = plan["ttt_counts_host"]
    device = aux.device
    counts_t = plan["ttt_counts"].to(device, non_blocking=True)
    rows = final.flatten(0, 1).index_select(0, plan["ttt_teacher_rows"].to(device, non_blocking=True))
    teacher = head(rows)  # (N, Vd): the target's distribution, once per batch
    denominators = global_denominators(counts_t) if global_denominators is not None else None
    if denominators is None:
        denominators = counts_t.clamp_min(1).float()
    index = torch.split(plan["ttt_index"].to(device, non_blocking=True), counts)
    teacher_index = torch.split(plan["ttt_teacher_index"].to(device, non_blocking=True), counts)
    if accept is not None and accept.mode == "none":
        accept = None
    chain: list[torch.Tensor] = []  # accept: the (B*T,) product over the steps so far of each chain
    reach_sums: list[torch.Tensor] = []

    def step_head(k: int, hidden: torch.Tensor, logits_fn):
        h = hidden.flatten(0, 1).index_select(0, index[k])  # (M_k, H)
        if accept is None:
            weight = (gamma**k / denominators[k]).expand(counts[k])
            return chunked_distill(h, logits_fn, teacher, teacher_index[k], weight, loss, chunk_size, fused=fused)
        reach = chain[0].index_select(0, index[k]) if k else None  # (M_k,) prod_{j<k} a_j at each row's chain
        if k and accept.opd:  # draft.opd: one call, the rows the chain does not reach get the decayed reverse KL
            out = opd_distill(h, logits_fn, teacher, teacher_index[k], gamma**k / denominators[k], reach,
                              accept.opd_gamma**k, loss, chunk_size, accept=accept, fused=fused)
        else:
            weight = (gamma**k / denominators[k]) * reach if k else (gamma**k / denominators[k]).expand(counts[k])
            out = chunked_distill(h, logits_fn, teacher, teacher_index[k], weight, loss, chunk_size, fused=fused,
                                  accept=accept)
        if k:
            reach_sums.append(reach.sum())
        if k + 1 < steps:  # carry the chain: a_k at step k's rows (detached), times what they had
            factor = accept.factor(out)
            start = chain[0] if k else torch.ones(hidden.shape[0] * hidden.shape[1], device=h.device)
            chain[:] = [start.index_copy(0, index[k], factor if reach is None else reach * factor)]
        return out

    outs = model(input_ids, aux, steps, None, position_ids, document_ids, step_head=step_head)
    total = torch.stack([o.loss_sum for o in outs]).sum()
    loss_sum = torch.stack([o.row_loss.sum() for o in outs])
    acc = torch.stack([o.row_hit.sum() for o in outs]) / counts_t.clamp_min(1)
    metrics = {"loss": total.detach()}
    for k in range(steps):
        metrics[f"loss_{k}"], metrics[f"acc_{k}"] = loss_sum[k] / denominators[k], acc[k]
    if reach_sums:
        reach_mean = torch.stack(reach_sums) / counts_t[1:].clamp_min(1)
        for k in range(1, steps):
            metrics[f"reach_{k}"] = reach_mean[k - 1]
    return total, metrics


# --------------------------------------------------------------------------------------
# The dry run's estimates


def draft_parameter_count(cfg: Eagle3Config) -> dict[str, int]:
    """Trainable parameters of the EAGLE-3 draft by part, plus the frozen shared embedding
    (the EAGLE-3.1 norms before ``fc``, 3 * Ht each for ``norm_before_fc`` and ``fc_norm``, under "norms").
    ``cfg.num_layers`` layers: the first reads 2H (``cat(embed, hidden)``) and has ``hidden_norm``,
    each later one reads H."""
    H, Ht, I, L = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.num_layers
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim

    def attention(d_in: int) -> int:
        if cfg.layer == "mla":  # q_a, q_b, kv_a_proj_with_mqa, kv_b, o_proj (models/eagle3/mla.py)
            nh, ql, kvl, v = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim
            return d_in * (ql + kvl + cfg.qk_rope_head_dim) + ql * q + kvl * nh * (cfg.qk_nope_head_dim + v) + nh * v * H
        return d_in * (q + 2 * kv) + q * H

    norms = 4 * H + (L - 1) * 2 * H  # layer 0: input, hidden, post-attention; each later: input, post; the final norm
    if cfg.layer == "mla":  # the two latent norms of every layer
        norms += L * (cfg.q_lora_rank + cfg.kv_lora_rank)
    return {
        "fc": 3 * Ht * H,
        "attention": attention(2 * H) + (L - 1) * attention(H),
        "mlp": L * 3 * H * I,
        "norms": norms + 3 * Ht * (int(cfg.norm_before_fc) + int(cfg.fc_norm)),
        "lm_head": cfg.draft_vocab_size * H,
        "frozen_embedding": cfg.vocab_size * H,
    }


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """EAGLE-3 parameter counts by part (of the :class:`Eagle3Config` of ``geometry`` with the
    recipe's EAGLE-3.1 options), and (the registry's second value) an upper bound of unchunked
    TTT logits per micro-batch, K steps of (B*T, Vd) fp32 logits + their softmax grads;
    :func:`~draftsmith.train.dry_run.memory_estimate` uses the method's own terms
    (:func:`activation_estimate`) instead."""
    logits_bytes = (recipe.draft.ttt_steps * recipe.train.batch_size * recipe.data.max_length
                    * geometry.draft_vocab_size * 4 * 3)
    fields = geometry.fields()
    if recipe.draft.layer == "mla":  # the latent attention's own projections (geometry.mla, draft.mla's overrides)
        fields.update(mla_fields(recipe, geometry))
    cfg = Eagle3Config(**fields, layer=recipe.draft.layer, num_layers=recipe.draft.num_layers,
                       **{k: getattr(recipe.draft, k) for k in EAGLE31_OPTIONS})
    return draft_parameter_count(cfg), logits_bytes


def mla_fields(recipe: Recipe, geometry: LayerGeometry) -> dict[str, Any]:
    """The MLA draft layer's config fields (``draft.layer: mla``): the target's latent attention
    geometry (:attr:`LayerGeometry.mla`) with ``draft.mla``'s overrides, ``head_dim`` the query / key
    width ``qk_nope_head_dim + qk_rope_head_dim`` and one key / value head per query head.

    Raises:
        ValueError: the target has no multi-head latent attention (the recipe's check names the key).
    """
    if not geometry.mla:
        raise ValueError("draft.layer=mla: the target has no multi-head latent attention (no kv_lora_rank in its config)")
    overrides = recipe.draft.mla.model_dump()
    out = {k: overrides.get(k) if overrides.get(k) is not None else geometry.mla.get(k) for k in geometry.mla}
    return {**out, "head_dim": (out["qk_nope_head_dim"] or 0) + (out["qk_rope_head_dim"] or 0),
            "num_key_value_heads": geometry.num_attention_heads}


# EAGLE-3, per TTT step: the layer's tensors kept for backward (no checkpointing). Under bf16
# autocast (fp32 weights) the RMSNorm / residual stream stays fp32 and the (T, 2H) layer input is
# cast to bf16 once per projection; under DeepSpeed's bf16 weights they are bf16 throughout.
EAGLE3_STEP = {"amp-bf16": LayerBytes(H=45.2, I=8.4, Q=3.9, KV=14.9),
               "bf16": LayerBytes(H=24.6, I=8.7, Q=4.3, KV=11.2),
               "fp32": LayerBytes(H=49.2, I=16.3, Q=11.3, KV=16.3)}
# ... with draft.gradient_checkpointing: what each step keeps (its inputs and keys / values) and
# the one step recomputed in backward
EAGLE3_CKPT_KEPT = {"amp-bf16": LayerBytes(H=9.2, KV=10.2), "bf16": LayerBytes(H=1.2, KV=10.4),
                    "fp32": LayerBytes(H=12.0, KV=16.0)}
EAGLE3_CKPT_STEP = {"amp-bf16": LayerBytes(H=40.1, I=10.7, Q=1.2), "bf16": LayerBytes(H=35.3, I=13.0),
                    "fp32": LayerBytes(H=49.2, I=16.3, Q=11.3, KV=16.3)}


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """EAGLE-3: K unrolled steps of the ``draft.num_layers`` decoder layers over ``B x T`` tokens, attention over the
    concatenated step keys (SDPA with a bool mask: memory linear in T; the mask's float bias,
    ``(k + 1) T^2`` elements at step k, is kept for backward), the teacher's distribution over
    the draft vocab once per batch (``(B*T, Vd)`` in the target's dtype on a GPU) and the chunked loss."""
    # each of the L layers keeps its tensors per step (layers >= 1 read H, not 2H: an upper bound)
    K, L = recipe.draft.ttt_steps, recipe.draft.num_layers
    if s.checkpointing:
        layers = K * L * EAGLE3_CKPT_KEPT[s.precision](s, s.E) + EAGLE3_CKPT_STEP[s.precision](s, s.E)
    else:
        layers = K * L * EAGLE3_STEP[s.precision](s, s.E)
    flex = getattr(recipe.train, "attention_backend", "sdpa") == "flex"
    masks = 0 if flex else K * (K + 1) // 2 * s.T * s.T * s.act_bytes * (s.B if s.packing else 1)
    # SDPA keeps step k's concatenated keys / values, (k + 1) T rows, expanded to nh heads on a GPU
    steps_kept = 1 if s.checkpointing else K
    expanded = 0 if flex else L * gqa_expanded_kv(s, s.E * sum(k + 1 for k in range(K - steps_kept, K)))
    out = {"layers": layers, "attention_masks": masks, "gqa_expanded_kv": expanded, "teacher": s.E * s.Vd * s.target_bytes,
           "loss_chunk": loss_chunk_bytes(recipe, s.E, s.Vd), "input_cast": input_cast(s, s.n_aux),
           "weight_copies": weight_copies(s, trainable)}
    return {**out, **(fused_loss_bytes(recipe, s, s.E, K) or {})}
