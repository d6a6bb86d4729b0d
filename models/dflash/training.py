"""DFlash's training side: the :class:`DFlashMethod` (the method's ``training_method``,
:mod:`draftsmith.methods`), its anchors and block labels, its loss and the dry run's estimates.

DFlash (z-lab, arXiv:2602.06036): block drafting from the same data EAGLE-3 trains on (aux
hidden states at vLLM aux ids, draft vocab d2t/t2d, assistant loss masks), used *unshifted*.
Each step samples up to ``draft.num_anchors`` anchors per row (fresh every step, from a
generator on the batch's device seeded by ``seed``, the step, the micro-batch and the rank; a
packed row's documents share its anchors, each anchor's block staying in its document);
block slot k of anchor a is trained towards the target's distribution ``p_{a+k-1}`` over the
draft vocab (``draft.loss``, forward KL by default), weighted ``exp(-(k-1)/gamma)``
(docs/parallel_drafts.md, "DFlash: anchor blocks").

The step reads nothing from the device: anchors come from ``topk`` over random keys, every
slot of every block is a loss row weighted 0 where it is not trained, the divergence is
computed in chunks inside the draft's forward (:func:`dflash_loss`) and the metrics are
detached device scalars. Anchors and block labels: :func:`sample_anchors`, :func:`block_labels`
(what runs in the data loader, :func:`anchor_count`, reads CPU tensors; what runs in a step
reads nothing on the host). The dry run's estimates: :func:`parameter_estimate`,
:func:`activation_estimate`. DSpark and DFlash2 build on all of it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ...draft_section import sliding_window_problem
from ...recipe import Recipe
from ...train.dry_run import (
    LayerBytes,
    Shapes,
    fused_loss_bytes,
    gqa_expanded_kv,
    input_cast,
    loss_chunk_rows,
    runs_loss_of,
    weight_copies,
)
from ...train.losses import AcceptSpec, chunk_rows, chunked_distill
from ...train.opd_loss import opd_group_distill
from ...train.method_base import DraftVocabMethod
from ..common import DistillTargets, LayerGeometry
from .config import DFlashConfig
from .model import DFlashDraftModel
from .warm_start import load_init, read_init_from

log = logging.getLogger("draftsmith.train.dflash")

NUM_ANCHORS_KEY = "dflash_num_anchors"  # the batch plan's python int: the batch's anchor width A


def loss_decay_gamma(block_size: int, gamma: float | None) -> float:
    """``draft.loss_decay_gamma``, or the anchors' default: 7 for blocks >= 12, else 4."""
    if gamma is not None:
        return float(gamma)
    return 7.0 if block_size >= 12 else 4.0


class AnchorCountPlan:
    """The DFlash batch plan (run on each collated CPU batch in the data loader): the batch plus
    its anchor width ``A = max(1, min(num_anchors, most valid anchors of any row))`` as a python
    int under :data:`NUM_ANCHORS_KEY`, so the step needs no device read to size its anchors
    (without it the step uses ``min(num_anchors, T - 1)``: more padding anchors, same loss).
    Picklable."""

    def __init__(self, num_anchors: int):
        self.num_anchors = int(num_anchors)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {**batch, NUM_ANCHORS_KEY: anchor_count(batch["loss_mask"], self.num_anchors,
                                                       batch.get("document_ids"))}


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train a DFlash block-drafting draft (z-lab, arXiv:2602.06036).

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume] [--set draft.block_size=8]
    draftsmith train RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``, the same data as EAGLE-3): target
info, draft vocab, tokenised data (to check the mask token never occurs) and hidden-state
shards. Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to ``RUN_DIR/metrics.jsonl``.
"""


class DFlashMethod(DraftVocabMethod):
    """DFlash: anchor blocks over the fused aux context, ``draft.loss`` per block slot with
    exponential position decay, against the target distribution over the draft vocab.

    Raises (at construction, i.e. at train start):
        MaskTokenError: ``draft.mask_token_id`` occurs in ``RUN_DIR/data/tokenized`` (or none is free).
        ValueError: aux layer ids invalid for the target; a vocab built for another target;
            ``draft.sliding_window`` beyond the target's ``max_position_embeddings``.
    """

    name = "dflash"
    help_text = TRAIN_HELP
    config_class: type[DFlashConfig] = DFlashConfig
    model_class: type[DFlashDraftModel] = DFlashDraftModel

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        self.init = read_init_from(self)  # draft.init_from, checked against this run (its mask token too), or None
        mask_id = self.mask_token_id() if self.init is None else self.init.config.mask_token_id
        draft = recipe.draft
        self.config = self.config_class.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]), aux_layer_ids=self.target_info.aux_layer_ids,
            num_layers=draft.num_layers, block_size=draft.block_size, mask_token_id=mask_id,
            sliding_window=getattr(draft, "sliding_window", None), **self.config_extra())
        self.gamma = loss_decay_gamma(draft.block_size, draft.loss_decay_gamma)
        self.weights = slot_weights(draft.block_size, self.gamma)
        self.step, self.micro = -1, 0
        log.info("dflash: %d layers, block %d, mask token %d, gamma %g", draft.num_layers, draft.block_size,
                 mask_id, self.gamma)

    def config_extra(self) -> dict[str, Any]:
        """Further config fields from the recipe (a DFlash-family subclass's; none here)."""
        return {}

    def build_model(self) -> DFlashDraftModel:
        return self.init_draft(self.model_class(self.config))

    def warm_start(self, model: DFlashDraftModel) -> DFlashDraftModel:
        """``draft.init_from``'s weights into ``model`` (:func:`~draftsmith.models.dflash.warm_start.load_init`)."""
        return model if self.init is None else load_init(self, model)

    def batch_plan(self) -> AnchorCountPlan:
        return AnchorCountPlan(self.recipe.draft.num_anchors)

    def begin_step(self, step: int) -> None:
        """Called before every micro-batch: counts the micro-batches of one optimizer step."""
        self.micro = self.micro + 1 if step == self.step else 0
        self.step = step

    def anchor_seed(self) -> int:
        """The seed of this micro-batch's anchors: ``seed``, the step, the micro-batch within it
        and the process index, so a resumed run samples the same anchors and micro-batches /
        ranks sample independently."""
        rank = self.accelerator.process_index if self.accelerator is not None else 0
        return ((self.recipe.seed * 1_000_003 + max(self.step, 0)) * 1009 + self.micro) * 4099 + rank

    def anchor_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on ``device`` seeded with :meth:`anchor_seed` (host-side seeding)."""
        return torch.Generator(device=device).manual_seed(self.anchor_seed())

    def compute_loss(self, model, batch):
        aux, final = self.training_states(model, batch)  # (B, T, n*Ht)
        mask, docs = batch["loss_mask"], batch.get("document_ids")
        T = mask.shape[1]
        width = batch.get(NUM_ANCHORS_KEY)  # the plan's tight A; else the cap (padding anchors cost compute only)
        num_anchors = width if width is not None else min(self.recipe.draft.num_anchors, max(T - 1, 1))
        anchors, valid = sample_anchors(mask, num_anchors, self.anchor_generator(mask.device), docs)
        accept = self.accept_spec()
        return dflash_loss(model, batch["input_ids"], aux, final, mask, anchors, valid, self.target_head, self.weights,
                           self.loss, batch.get("position_ids"), docs, self.global_denominators,
                           self.recipe.train.loss_chunk_rows, selector=self.selector_loss(),
                           fused=getattr(self.recipe.train, "fused_loss", None), accept=accept)

    def accept_spec(self, anchor_slot_drafted: bool = False) -> AcceptSpec | None:
        """``draft.accept_weighting`` / ``draft.opd`` over the trained slots of each block
        (``block_size - 1``: DFlash, DFlash2, XPress; ``anchor_slot_drafted``, DSpark: all
        ``block_size``), or None: both off, or no grad. They shape the gradient; validation (no
        grad) reports the plain loss, which a draft missing its early slots cannot lower."""
        weighted = torch.is_grad_enabled() and (getattr(self.recipe.draft, "accept_weighting", "none") != "none"
                                                or getattr(self.recipe.draft, "opd", "none") != "none")
        if not weighted:
            return None
        return AcceptSpec.from_recipe(self.recipe, group=self.recipe.draft.block_size - (0 if anchor_slot_drafted else 1))

    def selector_loss(self) -> Any:
        """The candidate-selector term of the loss (DFlash2's
        :class:`~draftsmith.models.dflash2.training.SelectorLoss`),
        or None: DFlash has none."""
        return None


# --------------------------------------------------------------------------------------
# Anchors and block labels


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, T)`` bool: positions a with ``m[a] == 1`` and ``m[a+1] == 1`` (so a <= T-2; SpecForge's
    rule), a and a+1 in the same document for packed rows."""
    m = loss_mask.bool()
    nxt = torch.zeros_like(m)
    nxt[:, :-1] = m[:, 1:]
    ok = m & nxt
    if document_ids is not None:
        same = torch.zeros_like(m)
        same[:, :-1] = document_ids[:, 1:] == document_ids[:, :-1]
        ok = ok & same
    return ok


def anchor_count(loss_mask: torch.Tensor, num_anchors: int, document_ids: torch.Tensor | None = None) -> int:
    """``max(1, min(num_anchors, most valid anchors of any row))``: the tightest anchor width A
    for a batch. Reads the tensor: call it on the CPU batch (the method's batch plan, in the data
    loader), never on device tensors inside a step."""
    return max(1, min(int(num_anchors), int(valid_anchor_mask(loss_mask, document_ids).sum(1).max())))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None,
                   document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``num_anchors`` distinct valid anchors per row (:func:`valid_anchor_mask`),
    uniformly without replacement, sorted ascending, without reading the device: random keys on
    the valid positions, ``topk``.

    Args:
        loss_mask: ``(B, T)``.
        num_anchors: A, the anchor width (capped at T); :func:`anchor_count` gives the tightest.
        generator: RNG (seeded per step by the caller for reproducible runs), on ``loss_mask``'s
            device preferably (a CPU generator's draws are copied over).

    Returns:
        ``(anchors (B, A) long, anchor_valid (B, A) bool)`` with ``A = max(1, min(num_anchors, T))``;
        padding anchors (rows with fewer than A valid positions) are position 0 with valid False,
        after the valid ones.
    """
    valid = valid_anchor_mask(loss_mask, document_ids)  # (B, T)
    B, T = valid.shape
    A = max(1, min(int(num_anchors), T))
    where = generator.device if generator is not None else valid.device
    noise = torch.rand(B, T, generator=generator, device=where).to(valid.device, non_blocking=True)
    score = torch.where(valid, noise, torch.full_like(noise, -1.0))
    top = score.topk(A, dim=1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    # sort kept anchors ascending, padding last
    order = torch.where(keep, anchors, torch.full_like(anchors, T)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_labels(anchors: torch.Tensor, anchor_valid: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                 document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels of each block slot (no EAGLE shift).

    Returns:
        ``(label_pos (B, A, Bk) long, label_mask (B, A, Bk) bool)``: slot k of block j predicts
        the token at ``t = a_j + k`` (clamped to T-1 where invalid); it is trained when k >= 1,
        t < T, ``m[t] == 1``, t is in a_j's document and the anchor is valid. Its teacher
        distribution is the target's at t-1.
    """
    B, T = loss_mask.shape
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[..., None] + k  # (B, A, Bk)
    inside = pos < T
    pos = pos.clamp(max=T - 1)
    flat = pos.flatten(1)
    ok = inside & loss_mask.bool().gather(1, flat).view_as(pos) & anchor_valid[..., None] & (k >= 1)
    if document_ids is not None:
        ok = ok & (document_ids.gather(1, flat).view_as(pos) == document_ids.gather(1, anchors)[..., None])
    return pos, ok


# --------------------------------------------------------------------------------------
# The loss: anchor blocks


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``(Bk,)`` loss weight of each block slot: 0 for the anchor, ``exp(-(k-1)/gamma)`` for k >= 1
    (the z-lab paper's fixed exponential decay)."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def teacher_rows(final: torch.Tensor, label_pos: torch.Tensor, head: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target logits the block slots are distilled towards, computed once per batch.

    Slot k of anchor a predicts x_{a+k}, so its teacher is ``p_{a+k-1}`` = ``head(final[a+k-1])``
    (same-position labels: no EAGLE shift). The head runs on whichever row set is smaller (both
    sizes are known on the host): every position (``B*T`` rows) or the ``B*A*(Bk-1)`` slot rows.

    Args:
        final: ``(B, T, Ht)`` the target's final (normed) hidden states.
        label_pos: ``(B, A, Bk)`` label positions (:func:`block_labels`).
        head: ``(..., Ht) -> (..., Vd)`` the target head over the draft vocab.

    Returns:
        ``(teacher (N, Vd), teacher_index (B, A, Bk) long)``; slot 0's index is a valid row
        (the anchor is never trained).
    """
    B, T, _ = final.shape
    _, A, Bk = label_pos.shape
    prev = (label_pos - 1).clamp_min(0)  # (B, A, Bk): p_{t-1} for the label at t
    if A * (Bk - 1) < T:
        rows = final.gather(1, prev[:, :, 1:].reshape(B, -1, 1).expand(-1, -1, final.shape[-1]))  # (B, A*(Bk-1), Ht)
        teacher = head(rows.reshape(B * A * (Bk - 1), -1))
        index = torch.arange(B * A * (Bk - 1), device=label_pos.device).view(B, A, Bk - 1)
        index = torch.cat([index[:, :, :1], index], dim=2)  # slot 0: any valid row
    else:
        teacher = head(final.reshape(B * T, -1))
        index = torch.arange(B, device=label_pos.device)[:, None, None] * T + prev
    return teacher, index


def slot_metrics(row_loss: torch.Tensor, row_hit: torch.Tensor, trained: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot means over the trained rows, as detached 0-dim tensors (no host read).

    Args:
        row_loss / row_hit: ``(B, A, Bk-1)`` per-row divergence and argmax match of slots 1..Bk-1.
        trained: ``(B, A, Bk-1)`` bool.

    Returns:
        ``loss_{k-1}`` / ``acc_{k-1}`` for slot k = 1..Bk-1 (0 where a slot has no trained row)
        and ``acceptance_length = 1 + sum_k prod_{i<=k} acc_i`` (a slot without rows stops the chain).
    """
    w = trained.float().flatten(0, 1)  # (B*A, Bk-1)
    count = w.sum(0)  # (Bk-1,)
    denom = count.clamp_min(1.0)
    loss = (row_loss.flatten(0, 1) * w).sum(0) / denom
    acc = (row_hit.flatten(0, 1) * w).sum(0) / denom
    out: dict[str, torch.Tensor] = {}
    for k in range(loss.shape[0]):  # over the host-known slot count: views, no reads
        out[f"loss_{k}"], out[f"acc_{k}"] = loss[k].detach(), acc[k].detach()
    out["acceptance_length"] = (1.0 + acc.cumprod(0).sum()).detach()
    return out


def reach_metrics(row_reach: torch.Tensor, trained: torch.Tensor) -> dict[str, torch.Tensor]:
    """``reach_{j}``: the mean reach (``draft.accept_weighting`` / ``draft.opd``'s weight factor) of
    the j-th trained slot of the blocks over its trained rows, detached 0-dim tensors (no host read).

    Args:
        row_reach: ``(B, A, G)`` float32 per-row reach; trained: ``(B, A, G)`` bool.
    """
    w = trained.float().flatten(0, 1)  # (B*A, G)
    reach = (row_reach.detach().flatten(0, 1) * w).sum(0) / w.sum(0).clamp_min(1.0)
    return {f"reach_{k}": reach[k] for k in range(reach.shape[0])}  # over the host-known slot count: views


def dflash_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, head: Any,
                weights: torch.Tensor, loss: Any = None, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                global_denominators: Callable[[torch.Tensor], Any] | None = None,
                chunk_size: int | None = None, selector: Any = None, fused: str | bool | None = None,
                accept: AcceptSpec | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One DFlash loss over given anchors, without host reads.

    Args:
        model: the :class:`~draftsmith.models.dflash.DFlashDraftModel` (possibly wrapped).
        input_ids / loss_mask / position_ids / document_ids: ``(B, T)`` the batch.
        aux: ``(B, T, n*Ht)`` aux states in the draft's dtype; final: ``(B, T, Ht)`` the
            target's final hidden states.
        anchors / anchor_valid: ``(B, A)`` (:func:`sample_anchors`).
        head: the target head over the draft vocab (``TargetDraftHead``).
        weights: ``(Bk,)`` slot weights (:func:`slot_weights`).
        loss: ``train.loss`` (``LossSpec``); None: forward KL.
        global_denominators: data parallel: ``(1,)`` local weight sum -> the global sum over the
            world size (a device tensor), or None on one process.
        chunk_size: rows per loss chunk (default: ``chunk_rows`` of Vd).
        selector: DFlash2 (:func:`~draftsmith.models.dflash2.training.dflash2_loss`, a
            :class:`~draftsmith.models.dflash2.training.SelectorLoss`): also the candidate selector's loss, added
            ``selector.alpha``-weighted with the same slot weights and denominator.
        fused: ``train.fused_loss`` (:func:`~draftsmith.train.losses.chunked_distill`'s ``fused``).
        accept: ``draft.accept_weighting`` (:class:`~draftsmith.train.losses.AcceptSpec`, its group
            ``Bk - 1``); None or ``none``: today's loss. Else slot k's weight is also multiplied by
            the detached product over the slots 1..k-1 of its block of the argmax hit (hard) or the
            expected acceptance (soft), computed from the same pass over the block's logits
            (:func:`~draftsmith.train.losses.group_reach`; an untrained slot passes the chain on).
            The denominator stays ``sum(w)`` (unreached slots count with weight 0). The selector's
            term (DFlash2) keeps the plain slot weights. With ``accept.opd`` (``draft.opd``) the
            unreached share of slot k's weight trains reverse KL, times ``opd_gamma**(k-1)``
            (:func:`~draftsmith.train.opd_loss.opd_group_distill`).

    Returns:
        ``(loss, metrics)``: ``loss = sum(w * D) / sum(w)`` over the trained slots (with
        ``selector``: ``+ alpha * sum(w * CE) / sum(w)``); metrics ``loss``, ``loss_{k-1}`` /
        ``acc_{k-1}`` per slot k, ``acceptance_length`` (:func:`slot_metrics`; with ``selector``
        also the selector's ``metrics``; with ``accept`` also ``reach_{k-1}``, the mean reach of
        slot k over its trained rows), all detached 0-dim tensors.
    """
    Bk = weights.shape[0]
    B, A = anchors.shape
    label_pos, label_mask = block_labels(anchors, anchor_valid, loss_mask, Bk, document_ids)  # (B, A, Bk)
    teacher, teacher_index = teacher_rows(final, label_pos, head)  # p_{a+k-1}
    weight = weights.to(loss_mask.device) * label_mask  # (B, A, Bk), 0 where not trained
    if accept is not None and accept.mode == "none":
        accept = None
    if accept is not None and accept.group != Bk - 1:
        raise ValueError(f"dflash_loss: accept weighting over groups of {accept.group} rows, blocks have {Bk - 1} slots")
    distill = functools.partial(chunked_distill, fused=fused) if accept is None else \
        functools.partial(opd_group_distill if accept.opd else chunked_distill, fused=fused, accept=accept)
    targets: Any = DistillTargets(teacher_index=teacher_index[:, :, 1:], weight=weight[:, :, 1:], teacher=teacher,
                                  distill=distill, loss=loss, chunk_size=chunk_size)
    if selector is not None:
        targets = selector.targets(targets, input_ids, label_pos, chunk_rows(teacher.shape[-1], selector.chunk_size
                                                                             or chunk_size))
    out = model(input_ids, aux, anchors, anchor_valid, position_ids=position_ids, document_ids=document_ids,
                targets=targets)
    out, selected = out if isinstance(out, tuple) else (out, None)
    local = weight.sum()
    denominator = global_denominators(local.reshape(1)) if global_denominators is not None else None
    scale = denominator[0] if denominator is not None else local.clamp_min(1e-6)
    total = out.loss_sum / scale
    rows = (B, A, Bk - 1)
    metrics = {"loss": total.detach()}
    metrics.update(slot_metrics(out.row_loss.view(rows), out.row_hit.view(rows), label_mask[:, :, 1:]))
    if accept is not None and out.row_reach is not None:
        metrics.update(reach_metrics(out.row_reach.view(rows), label_mask[:, :, 1:]))
    if selected is not None:
        selector_total = selected.loss_sum / scale
        metrics.update(selector.metrics(selected, selector_total, label_mask[:, :, 1:]), dflash_loss=total.detach())
        total = total + selector.alpha * selector_total
        metrics["loss"] = total.detach()
    return total, metrics


# --------------------------------------------------------------------------------------
# The dry run's estimates


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """DFlash's parameter counts by part (``geometry`` gives the target's shapes and aux ids):
    ``draft.num_layers`` Qwen3-style layers (q_norm / k_norm per head), ``fc`` over
    every aux state, and the peak bytes of block logits per micro-batch: up to
    ``min(num_anchors, max_length)`` blocks of ``block_size`` fp32 rows per sequence, plus their
    softmax grads.

    Raises:
        ValueError: ``draft.sliding_window`` beyond the target's ``max_position_embeddings``
            (:func:`~draftsmith.draft_section.sliding_window_problem`; the dry run's one target check
            of the window).
    """
    d = recipe.draft
    problem = sliding_window_problem(getattr(d, "sliding_window", None), geometry.max_position_embeddings)
    if problem:
        raise ValueError(problem)
    H, Ht, I, hd = geometry.hidden_size, geometry.target_hidden_size, geometry.intermediate_size, geometry.head_dim
    q, kv = geometry.num_attention_heads * hd, geometry.num_key_value_heads * hd
    counts = {
        "fc": len(geometry.aux_layer_ids) * Ht * H,
        "attention": d.num_layers * (H * (q + 2 * kv) + q * H + 2 * hd),
        "mlp": d.num_layers * 3 * H * I,
        "norms": (2 * d.num_layers + 2) * H,
        "lm_head": geometry.draft_vocab_size * H,
        "frozen_embedding": vocab_size * H,
    }
    blocks = min(d.num_anchors, recipe.data.max_length)
    logits_bytes = recipe.train.batch_size * blocks * d.block_size * geometry.draft_vocab_size * 4 * 3
    return counts, logits_bytes


# DFlash, per layer over the B*A*Bk block tokens (A anchors of Bk slots): the layer recomputed in
# backward (draft.gradient_checkpointing; without it every layer keeps these). Under bf16 autocast
# the block's residual stream is fp32.
DFLASH_LAYER = {"amp-bf16": LayerBytes(H=30, I=8, Q=8), "bf16": LayerBytes(H=27, I=10, Q=8),
                "fp32": LayerBytes(H=40, I=16, Q=16)}
DFLASH_CONTEXT = {"amp-bf16": 10, "bf16": 10, "fp32": 20}  # B / token / unit of H: the fused aux context


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """DFlash: ``draft.num_layers`` layers over the fused context (``B x T``) and ``A =
    min(draft.num_anchors, T - 1)`` anchor blocks of ``Bk = draft.block_size`` tokens that attend
    to the context before their anchor and to their own block (SDPA over ``[context | blocks]``
    with a bool mask; its float bias and the bool mask, 3 B per ``(A*Bk) x (T + A*Bk)`` element,
    are kept for backward). The peak is the larger of the loss at the end of forward (the
    teacher's fp32 distribution at the ``B x T`` positions, the chunked loss, and under bf16
    autocast every weight's bf16 copy; on the fused loss its logits buffer and the gradients it holds
    from forward, :func:`~draftsmith.train.dry_run.fused_loss_bytes`, for the methods that run
    DFlash's loss) and a layer's backward (recomputed under ``draft.gradient_checkpointing``, with
    its weights' bf16 copies)."""
    d = recipe.draft
    L, Bk = d.num_layers, d.block_size
    A = max(1, min(d.num_anchors, s.T - 1))
    Eb = s.B * A * Bk
    layer = DFLASH_LAYER[s.precision](s, Eb)
    kept_bytes = s.act_bytes if s.precision == "bf16" else 4
    copies = weight_copies(s, trainable)
    kv_rows = s.B * (s.T + A * Bk)  # [context | blocks] keys of one layer
    saved = {"attention_masks": 3 * s.B * A * Bk * (s.T + A * Bk),
             "gqa_expanded_kv": (1 if s.checkpointing else L) * gqa_expanded_kv(s, kv_rows),
             "context": DFLASH_CONTEXT[s.precision] * s.E * s.H,
             "input_cast": input_cast(s, s.n_aux)}
    if s.checkpointing:
        saved["layer_inputs"] = L * Eb * s.H * kept_bytes
        backward = {"layer_backward": layer, "weight_copies": copies // L}
    else:
        backward = {"layers": L * layer, "weight_copies": copies}
    loss = {"teacher": s.E * s.Vd * s.target_bytes, "loss_chunk": 7 * loss_chunk_rows(recipe, Eb, s.Vd) * s.Vd * 4, "weight_copies": copies}
    if runs_loss_of(recipe, DFlashMethod):  # one chunked_distill over the B*A*(Bk-1) trained slots
        loss.update(fused_loss_bytes(recipe, s, s.B * A * (Bk - 1), 1) or {})
    if sum(backward.values()) >= sum(loss.values()):
        # the fused loss's gradients are released by its backward, before the layers': none at this peak
        return {**saved, **backward, **({"fused_loss_gradients": 0} if "fused_loss_gradients" in loss else {})}
    return {**saved, **loss}
