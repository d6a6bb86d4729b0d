"""XPress's training side: the :class:`XPressMethod` (the method's ``training_method``,
:mod:`draftsmith.methods`), its loss and the dry run's estimates.

XPress trains on DFlash's data, anchors, block labels and slot weights
(:mod:`draftsmith.models.dflash.training`), over the target's whole vocab, a
:class:`~draftsmith.models.xpress.model.XPressDraftModel`. Its loss follows speculators 0.9's XPress
(``speculators/models/xpress/core.py`` and ``metrics.py``; docs/xpress.md, "Loss"):

    L(z)  = sum over the trained slots of w_k * sum_t lambda_t * D_t(p, z)  /  (number of trained slots)
    loss  = L(refined, teacher-forced)
          + consistency_weight * mean_{j=1..J} L(refined, Jacobi round j)
          + base_anchor_weight * L(drafter alone)

``D_t`` the ``draft.loss_weights`` terms (``ce``: cross-entropy against the target's argmax, the
others :func:`~draftsmith.train.losses.divergence`), ``p`` the target's distribution ``p_{a+k-1}`` of
slot k, ``w_k = exp(-(k-1)/gamma)`` (1 for the drafter term with ``base_anchor_full_weight``).
Teacher-forced: slot k's predecessor is the sequence's token; round 1 feeds the drafter's argmax,
round j the argmax of round j-1 (the Jacobi recurrence of inference; no gradient through the argmax).

Every term is computed in chunks of rows recomputed in backward (no ``(rows, V)`` tensor kept); the
refiner's latents (``(rows, r)``) are computed whole, since the mixer runs across the block.

``draft.accept_weighting`` / ``draft.opd`` (:func:`xpress_loss`'s ``accept``): one reach per block
slot, from the teacher-forced refined logits (the served chain at its Jacobi fixed point), weights
all three parts, each a slot's token prediction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...recipe import Recipe
from ...train.dry_run import Shapes, loss_chunk_rows
from ...train.losses import AcceptSpec, LossSpec, chunk_rows
from ...train.opd_loss import group_split, reverse_kl
from ..common import LayerGeometry
from ..dflash.training import (
    NUM_ANCHORS_KEY,
    DFlashMethod,
    block_labels,
    reach_metrics,
    sample_anchors,
    slot_metrics,
    teacher_rows,
)
from ..dflash.training import activation_estimate as dflash_activation_estimate
from ..dflash.training import parameter_estimate as dflash_parameter_estimate
from .config import REFINER_FIELDS, XPressConfig
from .model import XPressDraftModel, XPressTargets

log = logging.getLogger("draftsmith.train.xpress")

# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train an XPress draft (a DFlash block drafter with a causal refiner resolved by Jacobi passes).

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume]
    draftsmith train RECIPE.yaml --run-dir runs/x

Reads and writes what DFlash training does (the same prepared ``RUN_DIR/data``, with the draft
vocab equal to the target's).
"""


class XPressMethod(DFlashMethod):
    """XPress: DFlash's anchor blocks, the refiner's geometry from the recipe's ``draft`` section,
    the loss of :func:`xpress_loss`.

    Raises (at construction):
        ValueError: as :class:`~draftsmith.models.dflash.training.DFlashMethod`; a draft vocab smaller
            than the target's (``data.draft_vocab_size``).
    """

    name = "xpress"
    help_text = TRAIN_HELP
    config_class = XPressConfig
    model_class = XPressDraftModel

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        self.spec = XPressLossSpec.from_recipe(recipe.draft)
        log.info("xpress: rank %d, loss %s, consistency %g x %d rounds, drafter term %g", recipe.draft.xpress_rank,
                 dict(self.spec.terms), self.spec.consistency_weight, self.spec.rounds, self.spec.base_anchor_weight)

    def config_extra(self) -> dict[str, Any]:
        return {key: getattr(self.recipe.draft, key) for key in REFINER_FIELDS}

    def compute_loss(self, model, batch):
        aux, final = self.training_states(model, batch)
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        width = batch.get(NUM_ANCHORS_KEY)
        num_anchors = width if width is not None else min(self.recipe.draft.num_anchors, max(mask.shape[1] - 1, 1))
        anchors, valid = sample_anchors(mask, num_anchors, self.anchor_generator(mask.device), docs)
        return xpress_loss(model, batch["input_ids"], aux, final, mask, anchors, valid, self.target_head,
                           self.weights, self.spec, batch.get("position_ids"), docs, self.global_denominators,
                           self.recipe.train.loss_chunk_rows, accept=self.accept_spec())


# --------------------------------------------------------------------------------------
# The loss


@dataclass(frozen=True)
class XPressLossSpec:
    """The XPress loss: the per-slot mix ``terms`` (``draft.loss_weights``: ``(name, weight)``, ``ce``
    or a :func:`~draftsmith.train.losses.divergence`), the divergences' options (``draft.lk_kl_*``,
    ``draft.distill_temperature``) and the weights of the three parts (speculators' defaults)."""

    terms: tuple[tuple[str, float], ...] = (("ce", 0.1), ("tv", 0.9))
    consistency_weight: float = 0.3
    consistency_passes: int = 3
    base_anchor_weight: float = 0.6
    base_anchor_full_weight: bool = False
    divergence: LossSpec = field(default_factory=LossSpec)

    @classmethod
    def from_recipe(cls, draft_cfg) -> XPressLossSpec:
        return cls(tuple(draft_cfg.loss_weights.items()), draft_cfg.consistency_weight, draft_cfg.consistency_passes,
                   draft_cfg.base_anchor_weight, draft_cfg.base_anchor_full_weight, LossSpec.from_recipe(draft_cfg))

    @property
    def divergence_weight(self) -> float:
        """The summed weight of the divergence terms (all but ``ce``): ``draft.opd``'s reverse KL
        takes their place on a slot's unreached share at this weight."""
        return sum(w for name, w in self.terms if name != "ce")

    @property
    def rounds(self) -> int:
        """Jacobi rounds of the consistency term (0 when its weight is 0)."""
        return self.consistency_passes if self.consistency_weight > 0 else 0

    def row_terms(self, target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``(n_terms, C)`` per-row value of each term between the target logits and the draft's
        ``(C, V)`` (float32)."""
        out = []
        for name, _ in self.terms:
            if name == "ce":
                out.append(F.cross_entropy(logits, target.argmax(-1), reduction="none"))
            else:
                spec = self.divergence
                out.append(LossSpec(name, spec.lk_kl_scale, spec.lk_kl_decay, spec.target_temperature)(target, logits))
        return torch.stack(out)


@dataclass
class RefinedOut:
    """One term over M slot rows (:func:`refined_rows`).

    Attributes:
        loss_sum: scalar ``sum_m weight_m * sum_t lambda_t * D_t`` (with grad).
        term_sums: ``(n_terms,)`` ``sum_m weight_m * D_t`` per term, unweighted by lambda (detached).
        row_loss: ``(M,)`` ``sum_t lambda_t * D_t`` per row (detached).
        row_hit: ``(M,)`` float, 1 where the argmax is the target's argmax.
        row_argmax: ``(M,)`` int64 argmax of each row's logits (the next Jacobi round's tokens).
        row_reach: with an ``accept``, ``(M,)`` float32 the reach each row's weight was multiplied by.
    """

    loss_sum: torch.Tensor
    term_sums: torch.Tensor
    row_loss: torch.Tensor
    row_hit: torch.Tensor
    row_argmax: torch.Tensor
    row_reach: torch.Tensor | None = None


def _refined_chunk(model: Any, normed: torch.Tensor, latent: torch.Tensor | None, teacher: torch.Tensor,
                   teacher_index: torch.Tensor, weight: torch.Tensor, spec: XPressLossSpec,
                   accept: AcceptSpec | None = None, reach: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    logits = model.lm_head(normed)
    if latent is not None:
        logits = logits + model.xpress_head.w2(latent)
    logits = logits.float()  # (C, V)
    target = teacher.index_select(0, teacher_index).float()
    terms = spec.row_terms(target, logits)  # (n, C)
    # the weights are Python floats: no host-to-device copy per chunk inside the step
    row = spec.terms[0][1] * terms[0]
    for (_, w), term in zip(spec.terms[1:], terms[1:]):
        row = row + w * term
    argmax = logits.argmax(-1)
    hit = (argmax == target.argmax(-1)).float()
    if accept is None:
        return (weight * row).sum(), (terms * weight).sum(1).detach(), row.detach(), hit, argmax
    # draft.accept_weighting / draft.opd: whole blocks; the reach from these logits, or the one passed in
    reach, accepted, rejected = group_split(accept, target, logits, hit, weight, reach)
    total = (accepted * row).sum()
    if rejected is not None:
        total = total + spec.divergence_weight * (rejected * reverse_kl(spec.divergence, target, logits)).sum()
    return total, (terms * accepted).sum(1).detach(), row.detach(), hit, argmax, reach


def refined_rows(model: Any, normed: torch.Tensor, latent: torch.Tensor | None, teacher: torch.Tensor,
                 teacher_index: torch.Tensor, weight: torch.Tensor, spec: XPressLossSpec,
                 chunk_size: int | None = None, accept: AcceptSpec | None = None,
                 reach: torch.Tensor | None = None) -> RefinedOut:
    """One part of the XPress loss over M slot rows, in chunks of rows recomputed in backward.

    Args:
        model: the :class:`~draftsmith.models.xpress.model.XPressDraftModel` (unwrapped module).
        normed: ``(M, H)`` final-normed slot hidden states; latent: ``(M, r)`` the refiner's latent
            of each row (logits ``lm_head(n) + w2(latent)``) or None (the drafter alone, ``lm_head(n)``).
        teacher: ``(N, V)`` target logits; teacher_index / weight: ``(M,)``.
        spec: :class:`XPressLossSpec`; chunk_size: rows per chunk (None: ``chunk_rows`` of V).
        accept: ``draft.accept_weighting`` / ``draft.opd`` over groups of ``Bk - 1`` rows (M whole
            blocks; the chunks then hold whole blocks): each row's weight times its reach
            (``term_sums`` too), with ``draft.opd`` plus ``divergence_weight * weight * (1 - reach) *
            opd_gamma**j * KL(q || p)`` at slot j + 1 (:func:`~draftsmith.train.opd_loss.group_split`).
        reach: with ``accept``, ``(M,)`` float32 detached reach to apply (the drafter and Jacobi parts
            take the teacher-forced part's); None: from these rows' own logits.
    """
    rows = chunk_rows(teacher.shape[-1], chunk_size)
    if accept is not None:
        rows = max(accept.group, rows // accept.group * accept.group)
    grad = torch.is_grad_enabled() and normed.requires_grad
    outs = []
    for s in range(0, normed.shape[0], rows):
        args = (model, normed[s:s + rows], None if latent is None else latent[s:s + rows], teacher,
                teacher_index[s:s + rows], weight[s:s + rows], spec)
        if accept is not None:
            args = (*args, accept, None if reach is None else reach[s:s + rows])
        outs.append(checkpoint(_refined_chunk, *args, use_reentrant=False) if grad else _refined_chunk(*args))
    return RefinedOut(torch.stack([o[0] for o in outs]).sum(), torch.stack([o[1] for o in outs]).sum(0),
                      *(torch.cat([o[i] for o in outs]) for i in (2, 3, 4)),
                      row_reach=None if accept is None else torch.cat([o[5] for o in outs]))


@dataclass
class XPressOut:
    """What :func:`xpress_block_loss` returns: the teacher-forced refined rows, one
    :class:`RefinedOut` per Jacobi round, and the drafter's own rows (None when its weight is 0)."""

    tf: RefinedOut
    rounds: list[RefinedOut]
    base: RefinedOut | None


def xpress_block_loss(model: Any, hidden: torch.Tensor, targets: XPressTargets) -> XPressOut:
    """The XPress loss parts of A anchor blocks per row (``targets.compute``; runs inside the model's
    forward).

    Args:
        model: the :class:`~draftsmith.models.xpress.model.XPressDraftModel` (unwrapped module).
        hidden: ``(B, A, Bk, H)`` pre-norm block hidden states (slot 0: the anchor's).
        targets: :class:`~draftsmith.models.xpress.model.XPressTargets`.
    """
    spec: XPressLossSpec = targets.options or XPressLossSpec()
    B, A, Bk, H = hidden.shape
    head = model.xpress_head
    normed = model.norm(hidden)
    hcache = head.hidden_cache(normed.reshape(B * A, Bk, H))  # (B*A, Bk, 2r)
    rows = normed[:, :, 1:].reshape(-1, H)  # slots 1..Bk-1
    index = targets.teacher_index.reshape(-1)

    accept = getattr(targets, "accept", None)
    reach = None  # with accept: the teacher-forced part's, for the others

    def run(prev: torch.Tensor | None, weight: torch.Tensor) -> RefinedOut:
        latent = None if prev is None else head.latent(prev, hcache)[:, 1:].reshape(-1, head.rank)
        return refined_rows(model, rows, latent, targets.teacher, index, weight.reshape(-1), spec, targets.chunk_size,
                            accept=accept, reach=reach)

    prev = targets.prev.reshape(B * A, Bk)
    tf = run(prev, targets.weight) if accept is not None else None  # first: its reach weights the others
    reach = None if tf is None else tf.row_reach
    base = run(None, targets.base_weight) if spec.base_anchor_weight > 0 else None
    tf = tf if tf is not None else run(prev, targets.weight)  # without accept: after the drafter term, as before
    rounds: list[RefinedOut] = []
    if spec.rounds:
        if base is not None:
            pred = base.row_argmax
        else:
            with torch.no_grad():
                step = chunk_rows(targets.teacher.shape[-1], targets.chunk_size)
                pred = torch.cat([model.lm_head(rows[s:s + step]).argmax(-1) for s in range(0, rows.shape[0], step)])
        for _ in range(spec.rounds):
            out = run(torch.cat([prev[:, :2], pred.view(B * A, Bk - 1)[:, :-1]], dim=1), targets.weight)
            rounds.append(out)
            pred = out.row_argmax
    return XPressOut(tf, rounds, base)


def xpress_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, head: Any,
                weights: torch.Tensor, spec: XPressLossSpec | None = None, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                global_denominators: Callable[[torch.Tensor], Any] | None = None,
                chunk_size: int | None = None,
                accept: AcceptSpec | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One XPress loss over given anchors, without host reads (the module docstring's formula).

    Labels are DFlash's (:func:`~draftsmith.models.dflash.training.block_labels`, no EAGLE shift):
    slot k of anchor a drafts ``x_{a+k}`` against ``p_{a+k-1}``; its teacher-forced predecessor is
    ``x_{a+k-1}`` (slot 0: ``x_{a-1}``, or the anchor itself where the anchor starts its document).

    Args:
        model: the XPress draft (possibly wrapped); input_ids / loss_mask / position_ids /
            document_ids ``(B, T)``; aux ``(B, T, n*Ht)``; final ``(B, T, Ht)``; anchors /
            anchor_valid ``(B, A)``; head: the target head (full vocab).
        weights: ``(Bk,)`` DFlash slot weights (:func:`~draftsmith.models.dflash.training.slot_weights`).
        spec: :class:`XPressLossSpec` (None: speculators' defaults).
        global_denominators: data parallel: ``(1,)`` local trained-slot count -> the global count.
        chunk_size: rows per loss chunk.
        accept: ``draft.accept_weighting`` (:class:`~draftsmith.train.losses.AcceptSpec`, its group
            ``Bk - 1``); None or ``none``: the loss above, bit for bit. Else slot k's reach is the
            detached product over slots 1..k-1 of its block of the argmax hit (hard) or the expected
            acceptance at the served temperature (soft) of the *teacher-forced refined* logits
            (where the earlier slots were accepted, the Jacobi passes settle them on the sequence's
            tokens, so these are the logits that draft slot k when served), computed in that part's
            own chunks (an untrained slot passes the chain on). All three parts are weighted by it
            (each teaches slot k's token: the refined one given its true or its Jacobi
            predecessors, and the drafter's seed), the ``ce`` term of ``draft.loss_weights`` too;
            the Jacobi rounds and the drafter term do not use their own hits (a round's early miss
            is what the next round repairs). The denominator stays the trained-slot count. With
            ``accept.opd`` (``draft.opd``) each part's unreached share trains reverse KL of its own
            logits instead, ``divergence_weight * w * (1 - reach) * opd_gamma**(k-1) * KL(q || p)``.

    Returns:
        ``(loss, metrics)``; metrics (detached 0-dim tensors): ``loss``; ``tf_loss``,
        ``consistency_loss`` (with rounds), ``base_anchor_loss`` (with its weight > 0) before their
        weights; ``<term>_loss`` of each ``loss_weights`` term of the teacher-forced part (before
        its lambda); ``loss_{k-1}`` / ``acc_{k-1}`` per slot k and ``acceptance_length`` of the last
        Jacobi round (the teacher-forced rows without rounds); ``tf_acc`` and ``base_acc``; with
        ``accept`` ``reach_{k-1}`` (the mean reach of slot k over its trained rows) and the
        ``<term>_loss`` weighted by the reach.
    """
    spec = spec or XPressLossSpec()
    Bk = weights.shape[0]
    B, A = anchors.shape
    label_pos, label_mask = block_labels(anchors, anchor_valid, loss_mask, Bk, document_ids)  # (B, A, Bk)
    teacher, teacher_index = teacher_rows(final, label_pos, head)  # p_{a+k-1}
    trained = label_mask[:, :, 1:]
    weight = weights.to(loss_mask.device)[1:] * trained
    tokens = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)  # x_{a+k}
    before = (anchors - 1).clamp_min(0)
    first = anchors == 0
    if document_ids is not None:
        first = first | (document_ids.gather(1, before) != document_ids.gather(1, anchors))
    predecessor = torch.where(first, tokens[..., 0], input_ids.gather(1, before))
    if accept is not None and accept.mode == "none":
        accept = None
    if accept is not None and accept.group != Bk - 1:
        raise ValueError(f"xpress_loss: accept weighting over groups of {accept.group} rows, blocks have {Bk - 1} slots")
    targets = XPressTargets(teacher=teacher, teacher_index=teacher_index[:, :, 1:], weight=weight,
                            base_weight=trained.float() if spec.base_anchor_full_weight else weight,
                            prev=torch.cat([predecessor[..., None], tokens[..., :-1]], dim=-1),
                            compute=xpress_block_loss, options=spec, chunk_size=chunk_size, accept=accept)
    out: XPressOut = model(input_ids, aux, anchors, anchor_valid, position_ids=position_ids,
                           document_ids=document_ids, targets=targets)
    local = trained.sum().float()
    denominator = global_denominators(local.reshape(1)) if global_denominators is not None else None
    scale = denominator[0] if denominator is not None else local.clamp_min(1e-6)
    total = out.tf.loss_sum / scale
    metrics = {"tf_loss": total.detach()}
    for (name, _), value in zip(spec.terms, out.tf.term_sums):
        metrics[f"{name}_loss"] = (value / scale).detach()
    if out.rounds:
        consistency = torch.stack([r.loss_sum for r in out.rounds]).mean() / scale
        total = total + spec.consistency_weight * consistency
        metrics["consistency_loss"] = consistency.detach()
    if out.base is not None:
        base = out.base.loss_sum / scale
        total = total + spec.base_anchor_weight * base
        metrics["base_anchor_loss"] = base.detach()
    shape, n = (B, A, Bk - 1), trained.sum().clamp_min(1)
    last = out.rounds[-1] if out.rounds else out.tf
    metrics.update(slot_metrics(last.row_loss.view(shape), last.row_hit.view(shape), trained))
    metrics["tf_acc"] = ((out.tf.row_hit.view(shape) * trained).sum() / n).detach()
    if out.base is not None:
        metrics["base_acc"] = ((out.base.row_hit.view(shape) * trained).sum() / n).detach()
    if out.tf.row_reach is not None:
        metrics.update(reach_metrics(out.tf.row_reach.view(shape), trained))
    metrics["loss"] = total.detach()
    return total, metrics


# --------------------------------------------------------------------------------------
# The dry run's estimates


def refiner_parameters(vocab_size: int, hidden_size: int, block_size: int, rank: int, mlp_hidden: int) -> int:
    """Parameters of the refiner: ``w1`` and ``w2`` ``[V, r]``, ``down_h`` / ``down_g`` ``[r, H]``,
    ``in_proj [r, 3r]``, ``mix.L [r, Bk, Bk]``, the SwiGLU (3 r x m)."""
    r = rank
    return 2 * vocab_size * r + 2 * hidden_size * r + 3 * r * r + r * block_size * block_size + 3 * r * mlp_hidden


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """XPress counterpart of :func:`~draftsmith.models.dflash.training.parameter_estimate`: DFlash's
    counts plus the refiner (:func:`refiner_parameters`); the loss computes the block's logits once
    per part (teacher-forced, each consistency round, the drafter term).

    Raises:
        ValueError: ``data.draft_vocab_size`` below the target vocab (the refiner is defined over the
            target vocab; :class:`~draftsmith.models.xpress.config.XPressConfig` refuses it too).
    """
    if recipe.data.draft_vocab_size < vocab_size:
        raise ValueError(f"data.draft_vocab_size={recipe.data.draft_vocab_size}: XPress drafts over the full target "
                         f"vocab ({vocab_size}; vLLM 0.33's refiner has no d2t): set data.draft_vocab_size to "
                         f"{vocab_size} or more")
    counts, logits_bytes = dflash_parameter_estimate(recipe, geometry, vocab_size)
    d = recipe.draft
    counts["refiner"] = refiner_parameters(vocab_size, geometry.hidden_size, d.block_size, d.xpress_rank,
                                           d.xpress_rank * d.xpress_mlp_ratio)
    parts = 1 + (d.consistency_passes if d.consistency_weight > 0 else 0) + (1 if d.base_anchor_weight > 0 else 0)
    return counts, logits_bytes * parts


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """XPress: :func:`~draftsmith.models.dflash.training.activation_estimate` plus, per loss part,
    the refiner's fp32 latents of the ``Eb`` block rows kept for backward (``in_proj``, mixer and
    SwiGLU: about ``4r + 3m`` floats per row) and one more fp32 ``(rows, V)`` loss chunk (the bias)."""
    out = dflash_activation_estimate(recipe, s, trainable)
    d = recipe.draft
    Eb = s.B * max(1, min(d.num_anchors, s.T - 1)) * d.block_size
    parts = 1 + (d.consistency_passes if d.consistency_weight > 0 else 0) + (1 if d.base_anchor_weight > 0 else 0)
    r, m = d.xpress_rank, d.xpress_rank * d.xpress_mlp_ratio
    out["refiner_latents"] = (parts * (4 * r + 3 * m) + 2 * r) * Eb * 4
    out["refiner_bias_chunk"] = loss_chunk_rows(recipe, Eb, s.V) * s.V * 4
    return out
