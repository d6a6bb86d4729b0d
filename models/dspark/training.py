"""DSpark's training side: the :class:`DSparkMethod` (the method's ``training_method``,
:mod:`draftsmith.methods`), its loss and the dry run's estimates.

DSpark = DFlash's block drafter (:mod:`draftsmith.models.dflash.training`: the same data, anchors,
mask token and batch plan) + a Markov head + a confidence head. Block slot k of anchor a (k =
0..Bk-1, the anchor slot included) is trained towards ``x_{a+k+1}`` / ``p_{a+k}`` with the
Markov bias of the true previous token ``x_{a+k}``, weighted ``exp(-k/gamma)``
(:func:`dspark_loss`, after vllm-project/speculators PR #677). ``draft.accept_weighting`` and
``draft.opd`` weight a block's slots by the reach of its own chain, slots 0..k-1 before slot k
(:func:`dspark_loss`: the CE and divergence terms; the confidence head's BCE keeps the plain weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...recipe import Recipe
from ...train.dry_run import Shapes
from ...train.losses import AcceptSpec, DistillOut, LossSpec, acceptance_probability, chunk_rows
from ...train.opd_loss import group_split, reverse_kl
from ..common import LayerGeometry
from ..dflash.training import (
    NUM_ANCHORS_KEY,
    DFlashMethod,
    block_labels,
    reach_metrics,
    sample_anchors,
    slot_metrics,
    slot_weights,
    teacher_rows,
)
from ..dflash.training import activation_estimate as dflash_activation_estimate
from ..dflash.training import parameter_estimate as dflash_parameter_estimate
from .config import DSparkConfig
from .model import DSparkDraftModel, DSparkTargets

log = logging.getLogger("draftsmith.train.dspark")


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train a DSpark draft (DFlash block drafting + Markov head + confidence head).

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume] [--set draft.markov_rank=64]
    draftsmith train RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``, the same data as EAGLE-3 and
DFlash). Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to ``RUN_DIR/metrics.jsonl``.
"""


class DSparkMethod(DFlashMethod):
    """DSpark: DFlash's anchor blocks, every slot a next-token prediction, Markov-corrected logits,
    the loss of :func:`dspark_loss`.

    Raises (at construction): as :class:`~draftsmith.models.dflash.training.DFlashMethod`.
    """

    name = "dspark"
    help_text = TRAIN_HELP

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        draft = recipe.draft
        self.config = DSparkConfig(**self.config.to_dict(), markov_rank=draft.markov_rank,
                                   confidence_head=draft.confidence_head,
                                   confidence_head_with_markov=draft.confidence_head_with_markov)
        self.weights = dspark_slot_weights(draft.block_size, self.gamma)
        self.spec = DSparkLossSpec.from_recipe(draft)
        log.info("dspark: markov rank %d, confidence head %s, loss %.2g*CE + %.2g*%s + %.2g*BCE", draft.markov_rank,
                 draft.confidence_head, draft.ce_weight, draft.distill_weight, draft.loss, draft.confidence_weight)

    def build_model(self) -> DSparkDraftModel:
        return self.init_draft(DSparkDraftModel(self.config))

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.training_states(model, batch)  # draft.aux_noise_std applies here too
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        width = batch.get(NUM_ANCHORS_KEY)
        num_anchors = width if width is not None else min(self.recipe.draft.num_anchors, max(mask.shape[1] - 1, 1))
        anchors, valid = sample_anchors(mask, num_anchors, self.anchor_generator(mask.device), docs)
        return dspark_loss(model, batch["input_ids"], aux.to(param.dtype), final, mask, anchors, valid,
                           self.target_head, self.t2d, self.weights, self.spec, batch.get("position_ids"), docs,
                           self.global_denominators, self.recipe.train.loss_chunk_rows,
                           accept=self.accept_spec(anchor_slot_drafted=True))  # every slot is a prediction


# --------------------------------------------------------------------------------------
# The loss: anchor blocks with a Markov head and a confidence head


@dataclass(frozen=True)
class DSparkLossSpec:
    """The DSpark loss terms' weights and the divergence (``draft.ce_weight``,
    ``draft.distill_weight``, ``draft.confidence_weight``, ``draft.loss``)."""

    distill: LossSpec = LossSpec("tv")
    ce_weight: float = 0.1
    distill_weight: float = 0.9
    confidence_weight: float = 1.0

    @classmethod
    def from_recipe(cls, draft_cfg) -> DSparkLossSpec:
        return cls(LossSpec.from_recipe(draft_cfg), draft_cfg.ce_weight, draft_cfg.distill_weight,
                   draft_cfg.confidence_weight)


def dspark_slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``(Bk,)`` loss weight ``exp(-k/gamma)`` of DSpark slot k = 0..Bk-1 (every slot, the anchor's
    included, is a prediction): DFlash's :func:`~draftsmith.models.dflash.training.slot_weights` of a
    block one longer, its anchor dropped."""
    return slot_weights(block_size + 1, gamma)[1:]


@dataclass
class DSparkOut(DistillOut):
    """:class:`DistillOut` of the DSpark rows (``row_loss``: the weighted sum of the terms per row)
    plus ``row_alpha (M,)``: the acceptance probability ``1 - TV`` of each row (detached), the
    confidence head's target. With an :class:`~draftsmith.train.losses.AcceptSpec`: ``row_reach``
    ``(M,)`` each row's reach, and with ``draft.opd`` ``row_rejected`` ``(M,)`` its ``KL(q || p)``."""

    row_alpha: torch.Tensor | None = None


def _dspark_chunk(model: Any, hidden: torch.Tensor, embed: torch.Tensor, teacher: torch.Tensor,
                  teacher_index: torch.Tensor, labels: torch.Tensor, label_ok: torch.Tensor, weight: torch.Tensor,
                  spec: DSparkLossSpec, accept: AcceptSpec | None = None) -> tuple[torch.Tensor, ...]:
    logits = model.markov_logits(hidden, embed).float()  # (C, Vd)
    target = teacher.index_select(0, teacher_index).float()  # (C, Vd)
    alpha = acceptance_probability(torch.log_softmax(target, -1), torch.log_softmax(logits, -1)).detach()
    ce = F.cross_entropy(logits, labels, reduction="none") * label_ok
    if accept is not None:
        return _dspark_chunk_accept(model, hidden, embed, target, logits, alpha, ce, weight, spec, accept)
    row = spec.ce_weight * ce + spec.distill_weight * spec.distill(target, logits)
    if model.confidence_head is not None:  # always in the graph (weight 0 or not): DDP / FSDP see it used
        conf = model.confidence_logit(hidden, embed)
        row = row + spec.confidence_weight * F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
    hit = logits.argmax(-1) == target.argmax(-1)
    return (weight * row).sum(), row.detach(), hit.float(), alpha


def _dspark_chunk_accept(model: Any, hidden: torch.Tensor, embed: torch.Tensor, target: torch.Tensor,
                         logits: torch.Tensor, alpha: torch.Tensor, ce: torch.Tensor, weight: torch.Tensor,
                         spec: DSparkLossSpec, accept: AcceptSpec) -> tuple[torch.Tensor, ...]:
    """:func:`_dspark_chunk` of C rows (whole blocks) with ``accept``: the token-prediction terms
    (CE, divergence) weighted ``weight * reach``, the confidence BCE ``weight``; with ``draft.opd``
    also ``distill_weight * weight * opd_gamma**k * (1 - reach) * KL(q || p)``, all from the chunk's
    logits (:func:`~draftsmith.train.opd_loss.group_split`)."""
    hit = (logits.argmax(-1) == target.argmax(-1)).float()
    reach, accepted, rejected = group_split(accept, target, logits, hit, weight)
    predict = spec.ce_weight * ce + spec.distill_weight * spec.distill(target, logits)  # (C,)
    total, row = (accepted * predict).sum(), predict
    if model.confidence_head is not None:  # calibration: every trained row, reached or not
        conf = model.confidence_logit(hidden, embed)
        bce = spec.confidence_weight * F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
        total, row = total + (weight * bce).sum(), row + bce
    if rejected is None:
        return total, row.detach(), hit, alpha, reach, hit.new_zeros(0)
    r = reverse_kl(spec.distill, target, logits)
    return total + spec.distill_weight * (rejected * r).sum(), row.detach(), hit, alpha, reach, r.detach()


def dspark_rows(model: Any, hidden: torch.Tensor, embed: torch.Tensor, targets: Any) -> DSparkOut:
    """The DSpark loss of M slot rows, in chunks of rows recomputed in backward (as
    :func:`~draftsmith.train.losses.chunked_distill`): per row ``ce_weight * CE(z, y) +
    distill_weight * D(p, softmax(z)) + confidence_weight * BCE(sigmoid(c), 1 - TV(p, softmax(z)))``
    with ``z`` the Markov-corrected logits, ``y`` the true next token (CE only where it is in the
    draft vocab), ``p`` the target's distribution and ``c`` the confidence logit (the BCE target is
    detached).

    Args:
        model: the :class:`~draftsmith.models.dspark.model.DSparkDraftModel` (unwrapped module).
        hidden: ``(M, H)`` pre-norm slot rows; embed: ``(M, r)`` Markov embeddings of each row's
            previous token.
        targets: the :class:`~draftsmith.models.dspark.model.DSparkTargets` (rows flattened alike).

    With ``targets.accept`` (``draft.accept_weighting`` / ``draft.opd``, a group of ``Bk`` rows: the
    rows are whole blocks in slot order) the chunks hold whole blocks and the CE and divergence
    terms of a row weigh ``weight * reach`` (:func:`_dspark_chunk_accept`).

    Returns:
        :class:`DSparkOut` (``loss_sum`` with grad).
    """
    spec = targets.options or DSparkLossSpec()
    accept = getattr(targets, "accept", None)
    rows = chunk_rows(targets.teacher.shape[-1], targets.chunk_size)
    if accept is not None:
        rows = max(accept.group, rows // accept.group * accept.group)
    flat = [t.reshape(-1) for t in (targets.teacher_index, targets.labels, targets.label_ok.float(), targets.weight)]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    outs = []
    for s in range(0, hidden.shape[0], rows):
        args = (model, hidden[s:s + rows], embed[s:s + rows], targets.teacher, *(t[s:s + rows] for t in flat), spec)
        if accept is not None:
            args = (*args, accept)
        outs.append(checkpoint(_dspark_chunk, *args, use_reentrant=False) if grad else _dspark_chunk(*args))
    total = torch.stack([o[0] for o in outs]).sum()
    row_loss, row_hit, row_alpha = (torch.cat([o[i] for o in outs]) for i in (1, 2, 3))
    if accept is None:
        return DSparkOut(total, row_loss, row_hit, row_alpha)
    return DSparkOut(total, row_loss, row_hit, row_alpha, row_reach=torch.cat([o[4] for o in outs]),
                     row_rejected=torch.cat([o[5] for o in outs]) if accept.opd else None)


def dspark_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, head: Any,
                t2d: torch.Tensor, weights: torch.Tensor, spec: DSparkLossSpec | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                global_denominators: Callable[[torch.Tensor], Any] | None = None,
                chunk_size: int | None = None,
                accept: AcceptSpec | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One DSpark loss over given anchors, without host reads. Follows the DSpark loss of
    vllm-project/speculators PR #677 ("Add DSpark speculator (DFlash + Markov + confidence
    head)"): ``0.1 * CE + 0.9 * TV`` on every block slot, slot k weighted ``exp(-k/4)``, plus
    ``1.0 * BCE(confidence, 1 - TV)`` (the weights, the divergence and the decay are the recipe's).

    Labels (``sample_from_anchor``): slot k of anchor a predicts ``x_{a+k+1}``, its teacher is
    ``p_{a+k}`` and its Markov bias uses the true previous token ``x_{a+k}`` (teacher forcing);
    they are DFlash's :func:`~draftsmith.models.dflash.training.block_labels` /
    :func:`~draftsmith.models.dflash.training.teacher_rows` of a
    block one slot longer, its slot 0 dropped.

    Args:
        model: the DSpark draft (possibly wrapped); input_ids / loss_mask / position_ids /
            document_ids ``(B, T)``; aux ``(B, T, n*Ht)``; final ``(B, T, Ht)``; anchors /
            anchor_valid ``(B, A)``; head: the target head over the draft vocab.
        t2d: ``(V,)`` bool, the target ids in the draft vocab.
        weights: ``(Bk,)`` slot weights (:func:`dspark_slot_weights`).
        spec: :class:`DSparkLossSpec` (None: speculators' defaults).
        global_denominators / chunk_size: as :func:`~draftsmith.models.dflash.training.dflash_loss`.
        accept: ``draft.accept_weighting`` (:class:`~draftsmith.train.losses.AcceptSpec`, its group
            ``Bk``: every DSpark slot, the anchor's included, is a drafted token); None or ``none``:
            the loss above, bit for bit. Else slot k's chain is slots 0..k-1 of its block and its
            reach the detached product over them of the argmax hit of the Markov-corrected logits
            (hard) or their expected acceptance at the served temperature (soft), computed from the
            chunk's own logits (:func:`~draftsmith.train.opd_loss.group_split`, an untrained slot
            passing the chain on). Weighted by it: the CE and the divergence terms (they teach the
            slot's token). Not weighted: the confidence BCE (it calibrates: it must learn that
            slots after a miss are unreliable, from those very rows). The denominator stays
            ``sum(w)``. With ``accept.opd`` (``draft.opd``) the unreached share of slot k's
            divergence term trains reverse KL instead, ``distill_weight * w * (1 - reach) *
            opd_gamma**k * KL(q || p)``; its CE is dropped there.

    Returns:
        ``(loss, metrics)``: ``loss = sum(w * row) / sum(w)``; metrics ``loss``, ``loss_{k}`` /
        ``acc_{k}`` per slot k (argmax agreement with the target), ``acceptance_length``,
        ``alpha`` (mean ``1 - TV`` over trained rows), with ``accept`` ``reach_{k}`` (the mean
        reach of slot k over its trained rows; ``reach_0`` is 1), all detached 0-dim tensors.
    """
    Bk = weights.shape[0]
    B, A = anchors.shape
    label_pos, label_mask = block_labels(anchors, anchor_valid, loss_mask, Bk + 1, document_ids)  # (B, A, Bk+1)
    teacher, teacher_index = teacher_rows(final, label_pos, head)  # slot j of the longer block: p_{a+j-1}
    label_pos, label_mask, teacher_index = label_pos[:, :, 1:], label_mask[:, :, 1:], teacher_index[:, :, 1:]
    tokens = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)  # x_{a+k+1}, target ids
    t2d = t2d.to(tokens.device)
    # target id -> draft id where in the draft vocab (draft ids ascend with target ids: data_prep/vocab.py)
    draft_id = (t2d.long().cumsum(0) - 1).clamp_min(0)
    weight = weights.to(loss_mask.device) * label_mask
    if accept is not None and accept.mode == "none":
        accept = None
    if accept is not None and accept.group != Bk:
        raise ValueError(f"dspark_loss: accept weighting over groups of {accept.group} rows, blocks have {Bk} slots")
    targets = DSparkTargets(teacher=teacher, teacher_index=teacher_index, labels=draft_id[tokens], label_ok=t2d[tokens],
                            weight=weight, compute=dspark_rows, options=spec, chunk_size=chunk_size, accept=accept)
    out = model(input_ids, aux, anchors, anchor_valid, position_ids=position_ids, document_ids=document_ids,
                targets=targets)
    local = weight.sum()
    denominator = global_denominators(local.reshape(1)) if global_denominators is not None else None
    total = out.loss_sum / (denominator[0] if denominator is not None else local.clamp_min(1e-6))
    rows = (B, A, Bk)
    metrics = {"loss": total.detach()}
    metrics.update(slot_metrics(out.row_loss.view(rows), out.row_hit.view(rows), label_mask))
    trained = label_mask.flatten().float()
    metrics["alpha"] = ((out.row_alpha * trained).sum() / trained.sum().clamp_min(1.0)).detach()
    if out.row_reach is not None:
        metrics.update(reach_metrics(out.row_reach.view(rows), label_mask))
    return total, metrics


# --------------------------------------------------------------------------------------
# The dry run's estimates


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """DSpark: DFlash's counts (:func:`~draftsmith.models.dflash.training.parameter_estimate`)
    plus the Markov head (``markov_w1 [V, r]``, ``markov_w2 [Vd, r]``) and the confidence head
    (``H (+ r) + 1``); its logits are DFlash's block logits."""
    counts, logits_bytes = dflash_parameter_estimate(recipe, geometry, vocab_size)
    d, r = recipe.draft, recipe.draft.markov_rank
    counts["markov_head"] = (vocab_size + geometry.draft_vocab_size) * r
    if d.confidence_head:
        counts["confidence_head"] = geometry.hidden_size + (r if d.confidence_head_with_markov else 0) + 1
    return counts, logits_bytes


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """DSpark's block activations are DFlash's
    (:func:`~draftsmith.models.dflash.training.activation_estimate`)."""
    return dflash_activation_estimate(recipe, s, trainable)
