"""P-EAGLE's training side: the :class:`PEagleMethod` (the method's ``training_method``,
:mod:`draftsmith.methods`), its conditional-drop (COD) elements, its loss and the dry run's
estimates; its warm start (``draft.init_from``) is :mod:`draftsmith.models.peagle.warm_start`.

P-EAGLE (arXiv:2602.01469; docs/parallel_drafts.md, "P-EAGLE: conditional-drop (COD) elements"):
the EAGLE-3 data (aux states,
draft vocab, loss mask) on the EAGLE-shifted sequence, conditional-drop (COD) sampling of mask
chains re-drawn every micro-batch on the batch's device (:func:`cod_sample`,
a generator seeded from ``(seed, step, micro-batch, rank)``), one forward over all sampled
elements, the divergence ``draft.loss`` (default forward KL) to the target over the draft vocab
at ``anchor + depth`` (no depth decay, depth 0 included), computed inside the model's forward in
chunks of rows; with ``draft.accept_weighting`` / ``draft.opd`` one loss call per depth, depth d's
rows weighted by the detached reach of their chain's depths 0..d-1 (:class:`DepthTargets`). No
TTT: vLLM never feeds draft states back. The step reads nothing on the host:
its metrics are detached device tensors (:func:`cod_loss`).

Packed rows (``train.packing``): chains, attention and labels stay in their document; the COD
budgets (``draft.max_anchors``, the per-depth counts) are per row, shared by its documents.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...recipe import Recipe
from ...train.dry_run import (
    LayerBytes,
    Shapes,
    fused_loss_bytes,
    gqa_expanded_kv,
    input_cast,
    loss_chunk_rows,
    weight_copies,
)
from ...train.losses import AcceptSpec, DistillOut, LossSpec, chunked_distill
from ...train.method_base import DraftVocabMethod
from ...train.opd_loss import opd_distill
from ..common import DistillTargets, LayerGeometry, ttt_prediction_mask
from ..eagle3.config import Eagle3Config
from ..eagle3.training import draft_parameter_count
from ..eagle3.warm_start import WarmStartError, fit_problems
from .config import PEagleConfig
from .model import CODElements, PEagleDraftModel
from .warm_start import load_init_weights, read_init_peagle, warm_config

log = logging.getLogger("draftsmith.train.peagle")


def cod_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """The COD generator seed of one micro-batch: a hash of ``(seed, step, micro_batch, rank)``
    (63 bits), so a resumed run draws the same elements and ranks / micro-batches differ."""
    digest = hashlib.blake2b(f"{seed}/{step}/{micro_batch}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class CODPlan:
    """The P-EAGLE ``batch_plan``: host-side numbers of the collated CPU batch (DataLoader
    workers), so that the step sizes its tensors without reading the device.

    Adds ``cod_seed_bound`` (python int: the most trained positions in a row, which sizes the
    COD depth budgets, :func:`cod_budget`) and ``cod_rows0``
    (``(N0,)`` int64 CPU tensor: ``b * T + i`` of the trained depth-0 positions, so the loss
    projects only those depth-0 elements and every depth >= 1 slot).
    """

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, object]:
        pred = step0_prediction_mask(batch["loss_mask"], batch.get("document_ids"))
        return {"cod_seed_bound": int(pred.sum(1).max()) if pred.numel() else 0,
                "cod_rows0": torch.nonzero(pred.reshape(-1)).flatten()}


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train a P-EAGLE draft (EAGLE-3 + parallel drafting, COD-sampled mask chains).

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume] [--set draft.num_depths=8]
    draftsmith train RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``): target info, draft vocab,
tokenised data (to check the mask token never occurs in it) and hidden-state shards. Writes
checkpoints under ``RUN_DIR/checkpoints`` and metrics to ``RUN_DIR/metrics.jsonl``.
"""


class PEagleMethod(DraftVocabMethod):
    """P-EAGLE: COD chains of mask slots on the EAGLE-3 data, forward-KL loss."""

    name = "peagle"
    help_text = TRAIN_HELP

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        draft = recipe.draft
        base = Eagle3Config.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]), aux_layer_ids=self.target_info.aux_layer_ids,
            norm_before_residual=draft.norm_before_residual)
        self.init = read_init_peagle(draft.init_from) if draft.init_from else None  # checked before any step
        mask_id = self.mask_token_id(self.init.config.mask_token_id if self.init is not None else None)
        log.info("P-EAGLE mask token id %d (never occurs in %s)", mask_id, self.paths.tokenized)
        self.config = PEagleConfig.from_eagle3(base, num_layers=draft.num_layers, num_depths=draft.num_depths,
                                               mask_token_id=mask_id, train_embeddings=draft.train_embeddings)
        if self.init is not None:
            problems = fit_problems(self.init, self.target_info, self.d2t)
            if problems:
                raise WarmStartError(f"draft.init_from={draft.init_from} does not fit this run "
                                     f"(target {self.target_info.name_or_path}): " + "; ".join(problems))
            self.config = warm_config(self.init, self.config)
        self._step, self._micro = 0, 0

    def build_model(self) -> PEagleDraftModel:
        torch.manual_seed(self.recipe.seed)  # mask_hidden's randn init
        return self.init_draft(PEagleDraftModel(self.config))  # init_draft sets train.attention_backend

    def warm_start(self, model: PEagleDraftModel) -> PEagleDraftModel:
        """``draft.init_from``'s weights into ``model``
        (:func:`~draftsmith.models.peagle.warm_start.load_init_weights`)."""
        if self.init is not None:
            load_init_weights(model, self.init)
        return model

    def begin_step(self, step: int) -> None:
        """COD samples are re-drawn every micro-batch from a generator on the batch's device
        seeded with :func:`cod_seed` of ``(seed, step, micro-batch, rank)``: a resumed run draws
        the same elements. The trainer calls this before every micro-batch: the count restarts
        only when the step changes."""
        if step != self._step:
            self._step, self._micro = step, 0

    def cod_generator(self, device: torch.device) -> torch.Generator:
        """The next micro-batch's COD generator (host-side seed, no sync)."""
        rank = getattr(self.accelerator, "process_index", 0) if self.accelerator is not None else 0
        seed = cod_seed(self.recipe.seed, self._step, self._micro, rank)
        self._micro += 1
        return torch.Generator(device=device).manual_seed(seed)

    def batch_plan(self) -> CODPlan:
        return CODPlan()

    def sample(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, CODElements]:
        """``(prediction mask (B, T), COD elements)`` of a batch (the next micro-batch's draw);
        the depth budgets come from the plan's ``cod_seed_bound`` when the batch has one, else T."""
        docs = batch.get("document_ids")
        pred = step0_prediction_mask(batch["loss_mask"], docs)  # (B, T): position i predicts x_{i+2}
        d = self.recipe.draft
        elements = cod_sample(pred, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min,
                              self.cod_generator(pred.device), d.max_anchors, docs, batch.get("cod_seed_bound"))
        return pred, elements

    def depth_budgets(self, T: int, batch: dict[str, torch.Tensor]) -> list[int]:
        """The slots of depths 1, 2, ... in each row of :meth:`sample`'s elements (:func:`cod_budget`
        of the recipe and the plan's ``cod_seed_bound``; host-side numbers)."""
        d = self.recipe.draft
        return cod_budget(T, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min, d.max_anchors,
                          batch.get("cod_seed_bound"))

    def accept_spec(self) -> AcceptSpec | None:
        """``draft.accept_weighting`` or ``draft.opd`` (:class:`~draftsmith.train.losses.AcceptSpec`) when
        the step trains (grad enabled), else None: validation (no grad) reports the plain loss, as DFlash's."""
        d = self.recipe.draft
        if not torch.is_grad_enabled() or (getattr(d, "accept_weighting", "none") == "none"
                                           and getattr(d, "opd", "none") == "none"):
            return None
        return AcceptSpec.from_recipe(self.recipe)

    def denominator(self, count: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of ``count`` trained elements (0-dim device tensor): the local
        count, or the data-parallel :meth:`global_denominators`; at least 1."""
        den = self.global_denominators(count.view(1))
        if den is None:
            return count.float().clamp_min(1.0)
        return torch.as_tensor(den, dtype=torch.float32, device=count.device).reshape(-1)[0]

    def compute_loss(self, model, batch):
        """The COD loss of one micro-batch (:func:`cod_loss`), computed inside the model's forward: one
        chunked loss over the elements, or with ``draft.accept_weighting`` / ``draft.opd`` (while training)
        one per depth, each depth's rows weighted by their chains' reach (:class:`DepthTargets`). No host read."""
        aux, final = self.training_states(model, batch)  # (B, T, 3H)
        pred, elements = self.sample(batch)
        sel = cod_targets(elements, pred)  # (B, S) trained elements
        B, T = pred.shape
        # the teacher of position i is the target's distribution of x_{i+2}: its row at i + 1,
        # computed once at positions 1..T-1 and indexed (position T-1 is never trained)
        shifted = final[:, 1:] if T > 1 else final  # a view
        teacher = self.target_head(shifted).reshape(-1, self.target_head.weight.shape[0])  # (B * (T-1), Vd)
        per_row = shifted.shape[1]
        index = elements.pos.clamp_max(per_row - 1) + per_row * torch.arange(B, device=pred.device).unsqueeze(1)
        weight = (sel.float() / self.denominator(sel.sum())).reshape(-1)
        fused = getattr(self.recipe.train, "fused_loss", None)
        accept = self.accept_spec()
        if accept is not None:  # one loss call per depth, each weighted by its chains' reach (depth_targets)
            targets = depth_targets(elements, T, self.depth_budgets(T, batch), batch.get("cod_rows0"), teacher,
                                    index, weight, sel, accept, self.loss, fused)
            out = model(batch["input_ids"], aux, elements, batch.get("position_ids"), batch.get("document_ids"),
                        targets=targets)
            return cod_loss(out, targets.depth, targets.trained, self.recipe.draft.num_depths)
        index, depth, sel = index.reshape(-1), elements.depth.reshape(-1), sel.reshape(-1)
        train_rows = None
        if "cod_rows0" in batch:  # the plan's trained depth-0 positions, then every deeper slot
            S = elements.anchor.shape[1]
            r0 = batch["cod_rows0"]
            deeper = torch.arange(T, S, device=pred.device) + S * torch.arange(B, device=pred.device).unsqueeze(1)
            train_rows = torch.cat([element_rows0(r0, T, S), deeper.reshape(-1)])
            index, weight, depth, sel = (t.index_select(0, train_rows) for t in (index, weight, depth, sel))
        out = model(batch["input_ids"], aux, elements, batch.get("position_ids"), batch.get("document_ids"),
                    targets=DistillTargets(teacher, index, weight, functools.partial(chunked_distill, fused=fused),
                                           self.loss, rows=train_rows))
        return cod_loss(out, depth, sel, self.recipe.draft.num_depths)


# --------------------------------------------------------------------------------------
# Conditional-drop (COD) elements


def cod_budget(seq_len: int, num_depths: int, ratio: float, ratio_min: float,
               max_anchors: int | None = None, seed_bound: int | None = None) -> list[int]:
    """Slots reserved for depths 1, 2, ... in a row of ``seq_len`` positions (host-side numbers).

    Depth d keeps ``int(max(0, n - d) * max(ratio**d, ratio_min))`` chains for n seeds
    (:func:`cod_sample`); with n at its largest (``seq_len``, ``max_anchors``, or
    ``seed_bound``, a host-side bound on the trained positions per row) this is the number of
    slots depth d may fill. The list stops before the first depth with no slot, so
    ``seq_len + sum(cod_budget(...))`` is the element count S of :func:`cod_sample`.
    """
    n = min([seq_len] + [b for b in (max_anchors, seed_bound) if b is not None])
    out = []
    for d in range(1, num_depths):
        k = int(max(0, n - d) * max(ratio**d, ratio_min))
        if k == 0:
            break
        out.append(k)
    return out


def _random_keys(shape: tuple[int, ...], eligible: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. uniform keys in [0, 1) at eligible entries, -1 elsewhere: the ``k`` largest are a
    uniformly random k-subset of the eligible entries (``topk``: no host sync)."""
    keys = torch.rand(shape, generator=generator, device=eligible.device)
    return keys.masked_fill_(~eligible, -1.0)


def cod_sample(
    prediction_mask: torch.Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    generator: torch.Generator,
    max_anchors: int | None = None,
    document_ids: torch.Tensor | None = None,
    seed_bound: int | None = None,
) -> CODElements:
    """Conditional-drop sampling (speculators ``peagle/data.py``; docs/parallel_drafts.md), vectorised on
    ``prediction_mask``'s device: no tensor is read on the host.

    Per row: depth 0 at every position; depth d (1 <= d < D) keeps
    ``min(int(max(0, n - d) * max(ratio**d, ratio_min)), #eligible)`` chains, a uniformly random
    subset of the eligible positions: those that continue a depth-(d-1) chain one step right
    (depth 1: the seeds), that are trained (``prediction_mask``), at least d from the start, and
    in the anchor's document. n = number of seeds (trained positions, or a random subset of
    ``max_anchors`` of them).

    Layout: ``[T depth-0 slots | K_1 depth-1 slots | ... ]`` with ``K_d`` from
    :func:`cod_budget` (the count for n = T, or ``seed_bound``), so S is known on the host. Each depth's kept
    elements come first in position order; the slots a row does not fill are invalid.

    The subsets are drawn by ``topk`` over i.i.d. uniform keys from ``generator`` (a generator
    of ``prediction_mask``'s device), so the same generator state gives the same sample.

    Args:
        prediction_mask: ``(B, T)`` bool, the EAGLE-3 step-0 loss mask (position i predicts
            x_{i+2}, trained when True).
        num_depths: D (depths 0..D-1).
        ratio, ratio_min: r and r_min.
        generator: RNG on ``prediction_mask``'s device, seeded for this micro-batch.
        max_anchors: optional number of seeds (random subset of the trained positions).
        document_ids: optional ``(B, T)`` document per position (packed rows).
        seed_bound: optional host-side bound on the trained positions of any row (e.g. counted
            on the CPU batch, :class:`CODPlan`): sizes the
            depth budgets to the batch instead of T (fewer empty slots, smaller S). A row with
            more would keep at most the budget.

    Returns:
        :class:`CODElements` on ``prediction_mask``'s device.
    """
    B, T = prediction_mask.shape
    dev = prediction_mask.device
    trained = prediction_mask.bool()
    if max_anchors is None or max_anchors >= T:
        seeds = trained
    else:
        val, pick = _random_keys((B, T), trained, generator).topk(max_anchors, dim=1)
        seeds = torch.zeros_like(trained).scatter_(1, pick, val >= 0)
    n = seeds.sum(1)  # (B,) seeds per row
    anchors = [torch.arange(T, device=dev).expand(B, T)]
    depths = [torch.zeros(B, T, dtype=torch.long, device=dev)]
    valids = [torch.ones(B, T, dtype=torch.bool, device=dev)]
    prev = seeds  # (B, T): positions that may take the next depth
    for d, budget in enumerate(cod_budget(T, num_depths, ratio, ratio_min, max_anchors, seed_bound), start=1):
        eligible = prev.clone()
        eligible[:, :d] = False
        if document_ids is not None:
            eligible[:, d:] &= document_ids[:, d:] == document_ids[:, :-d]
        # float64 as the host-side formula: int(max(0, n - d) * max(r**d, r_min)) exactly
        size = ((n - d).clamp_min(0).double() * max(ratio**d, ratio_min)).floor().long()  # (B,)
        val, pos = _random_keys((B, T), eligible, generator).topk(budget, dim=1)  # (B, K) by key
        slot = torch.arange(budget, device=dev)
        keep = (val >= 0) & (slot < size.unsqueeze(1))
        order = torch.where(keep, pos, T + slot).argsort(dim=1)  # kept first, in position order
        pos, keep = pos.gather(1, order), keep.gather(1, order)
        anchors.append(torch.where(keep, pos - d, torch.zeros_like(pos)))
        depths.append(keep.long() * d)
        valids.append(keep)
        chosen = torch.zeros_like(trained).scatter_(1, pos, keep)  # (B, T) positions of depth d
        prev = torch.zeros_like(trained)
        prev[:, 1:] = chosen[:, :-1] & trained[:, 1:]  # chains continue one step right
    return CODElements(torch.cat(anchors, 1), torch.cat(depths, 1), torch.cat(valids, 1), num_depths)


def step0_prediction_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The EAGLE-3 step-0 loss mask on the shifted sequence (position i predicts x_{i+2})."""
    return ttt_prediction_mask(loss_mask, 0, document_ids)


def cod_targets(elements: CODElements, prediction_mask: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` bool: the elements trained on (valid, and ``prediction_mask`` at ``pos``)."""
    return elements.valid & prediction_mask.bool().gather(1, elements.pos)


# --------------------------------------------------------------------------------------
# draft.accept_weighting / draft.opd: the loss by depth, each depth weighted by its chains' reach


@dataclass
class DepthTargets:
    """The training step's targets with ``draft.accept_weighting`` or ``draft.opd``
    (:func:`depth_targets` builds it; the model's forward calls it on its hidden states as it calls
    :class:`~draftsmith.models.common.DistillTargets`).

    The rows are the elements in depth-major order (depth 0's first, then depth 1's slots, ...),
    ``counts[d]`` of depth d. Every depth is predicted by the same forward, so the loss is split by
    depth: depth d is one :func:`~draftsmith.train.losses.chunked_distill` call, after depth d - 1's,
    whose rows' weights are multiplied by their chain's reach ``prod_{j<d} a_j``, ``a_j`` the detached
    argmax hit (hard) or expected acceptance (soft) of the chain's depth-j element: COD keeps depth d
    of an anchor only where it kept depth d - 1, so the chains partition the elements and each depth
    reads the factors of the one before. The product is carried over a vector of one entry per (row,
    anchor) (``chains``; read with ``index_select``, written with ``index_copy_`` at ``chain``): no host
    read, no loop over rows, each row projected by the ``lm_head`` once. A depth-0 element that is not
    trained (or not projected: the plan's ``cod_rows0``) passes its chain on (factor 1), as EAGLE-3's
    TTT steps without a row do. With ``accept.opd`` depth d >= 1 also trains ``weight * (1 - reach) *
    opd_gamma**d * KL(q || p)`` in the same call (:func:`~draftsmith.train.opd_loss.opd_distill`).

    Attributes:
        teacher: ``(N, Vd)`` the target's logits over the draft vocab.
        rows: ``(M,)`` int64 flat element indices ``b * S + s`` (depth-major).
        counts: the rows of each depth (host-side), summing to M.
        teacher_index, weight, trained, depth: ``(M,)`` the rows' teacher row, loss weight (before the
            reach), trained flag and depth.
        chain: ``(M,)`` int64 the entry of each row's chain, ``b * S + anchor`` (an untrained row: ``b * S +
            T``, a spare entry no trained row reads).
        chains: the entries, ``B * S``.
        accept: the :class:`~draftsmith.train.losses.AcceptSpec` (no group).
        loss: ``draft.loss`` (:class:`~draftsmith.train.losses.LossSpec`); None: forward KL.
        fused: ``train.fused_loss``. chunk_size: rows per loss chunk (None: the default).
    """

    teacher: torch.Tensor
    rows: torch.Tensor
    counts: list[int]
    teacher_index: torch.Tensor
    weight: torch.Tensor
    trained: torch.Tensor
    depth: torch.Tensor
    chain: torch.Tensor
    chains: int
    accept: AcceptSpec
    loss: LossSpec | None = None
    fused: str | bool | None = None
    chunk_size: int | None = None

    def __call__(self, hidden: torch.Tensor, logits_fn: Any) -> DistillOut:
        """``hidden (B, S, H)`` -> :class:`~draftsmith.train.losses.DistillOut` over the M rows (depth-major):
        ``loss_sum`` of every depth, ``row_loss`` / ``row_hit``, ``row_reach`` (1 at depth 0) and with soft
        ``row_alpha``."""
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.rows)
        names, owner = getattr(logits_fn, "fused_as", None), getattr(logits_fn, "__self__", None)
        if names is not None and owner is not None:  # lm_head(norm(h)): the norm once over the M rows, not per depth
            norm, logits_fn = (getattr(owner, name) for name in names)
            flat = norm(flat)
        accept, last = self.accept, len(self.counts) - 1
        outs, reaches, chain = [], [], None
        parts = zip(*(torch.split(t, self.counts) for t in (flat, self.teacher_index, self.weight, self.chain)))
        for d, (h, index, weight, key) in enumerate(parts):  # one split: its backward is one cat
            reach = None if d == 0 else chain.index_select(0, key)  # prod_{j<d} a_j of each row's chain
            if reach is not None and accept.opd:
                out = opd_distill(h, logits_fn, self.teacher, index, weight, reach, accept.opd_gamma**d, self.loss,
                                  self.chunk_size, accept=accept, fused=self.fused)
            else:
                out = chunked_distill(h, logits_fn, self.teacher, index, weight if reach is None else weight * reach,
                                      self.loss, self.chunk_size, fused=self.fused, accept=accept)
            if d < last:  # carry the chains: a_d (detached) times what they had; untrained rows write a spare entry
                factor = accept.factor(out)
                if chain is None:
                    chain = factor.new_ones(self.chains)
                chain.index_copy_(0, key, factor if reach is None else reach * factor)
            outs.append(out)
            if reach is not None:
                reaches.append(reach)
        total = outs[0].loss_sum if len(outs) == 1 else torch.stack([o.loss_sum for o in outs]).sum()
        reach = torch.cat([self.weight.new_ones(self.counts[0]), *reaches])
        alpha = torch.cat([o.row_alpha for o in outs]) if accept.soft else None
        return DistillOut(total, torch.cat([o.row_loss for o in outs]), torch.cat([o.row_hit for o in outs]),
                          row_alpha=alpha, row_reach=reach)


def element_rows0(rows0: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """The plan's ``cod_rows0`` (flat ``b * T + i`` trained depth-0 positions) as flat element indices
    ``b * S + i`` of ``(B, S)`` elements whose first T slots are depth 0 at positions 0..T-1."""
    return rows0 // T * S + rows0 % T


def depth_targets(elements: CODElements, T: int, budgets: list[int], rows0: torch.Tensor | None, teacher: torch.Tensor,
                  index: torch.Tensor, weight: torch.Tensor, trained: torch.Tensor, accept: AcceptSpec,
                  loss: LossSpec | None = None, fused: str | bool | None = None,
                  chunk_size: int | None = None) -> DepthTargets:
    """The :class:`DepthTargets` of a batch's COD elements (no host read).

    Args:
        elements: ``(B, S)`` :func:`cod_sample`'s elements, laid out ``[T depth-0 slots | K_1 depth-1
            slots | ...]`` per row.
        T: the positions per row.
        budgets: ``[K_1, K_2, ...]`` (:func:`cod_budget`, as the sample drew them).
        rows0: the plan's ``cod_rows0`` (``(N0,)`` flat ``b * T + i`` of the trained depth-0 positions: the
            only depth-0 rows projected), or None: every depth-0 slot.
        teacher: ``(N, Vd)``; index, weight, trained: ``(B, S)`` (or flat) per element, its teacher row,
            loss weight and trained flag.
        accept, loss, fused, chunk_size: as :class:`DepthTargets`.

    Raises:
        ValueError: T and the budgets do not add up to the elements' S.
    """
    B, S = elements.anchor.shape
    if T + sum(budgets) != S or any(k <= 0 for k in budgets):
        raise ValueError(f"depth_targets: {T} positions and depth budgets {budgets} do not lay out {S} elements per row")
    dev = elements.anchor.device
    row_start = S * torch.arange(B, device=dev).unsqueeze(1)  # (B, 1)
    first = (torch.arange(T, device=dev) + row_start).reshape(-1) if rows0 is None else element_rows0(rows0, T, S)
    # the deeper slots slot-major ((S - T, B)): slot j of every row, then j + 1, so each depth's K_d * B rows are
    # contiguous (the slots are in depth order)
    deeper = (torch.arange(T, S, device=dev).unsqueeze(1) + row_start.view(1, B)).reshape(-1)
    rows = torch.cat([first, deeper])
    # (B, S) each element's chain entry b * S + anchor; an untrained one (an empty slot, an untrained depth-0
    # position) b * S + T, a spare entry never read by a trained row: its chain passes on with factor 1
    chain = torch.where(trained.view(B, S), elements.anchor, T) + row_start

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).index_select(0, rows)

    return DepthTargets(teacher, rows, [int(first.shape[0])] + [B * k for k in budgets], pick(index), pick(weight),
                        pick(trained), pick(elements.depth), pick(chain), B * S, accept, loss, fused, chunk_size)


# --------------------------------------------------------------------------------------
# The loss: per-depth metrics of the COD elements


def cod_loss(out: DistillOut, depth: torch.Tensor, trained: torch.Tensor,
             num_depths: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss and per-depth metrics from the model's divergence over the elements.

    ``out`` is :meth:`PEagleDraftModel.forward` with
    :class:`~draftsmith.models.common.DistillTargets` whose weight is ``trained / N`` (N the
    trained count, or the data-parallel denominator), so
    ``out.loss_sum = sum_s D(p_{pos_s + 1} || q_s) / N`` over the trained elements, D the
    divergence ``train.loss``. Nothing is read on the host: the metrics are masked sums
    (``index_add`` over depth).

    Args:
        out: the ``DistillOut`` over M rows: the ``B*S`` elements (row-major), or the plan's
            rows (``DistillTargets.rows``, ``DepthTargets.rows``).
        depth: ``(M,)`` depth of each row.
        trained: ``(M,)`` bool, the rows trained on.
        num_depths: D, the number of per-depth metric slots.

    Returns:
        ``(loss, metrics)``: ``loss = out.loss_sum``; metrics, detached 0-dim tensors: ``loss``,
        per depth d ``loss_{d}`` (mean divergence), ``acc_{d}`` (draft argmax == target argmax over
        the draft vocab), both 0 at a depth with no element, and ``expected_al``
        (:func:`expected_acceptance_length`; 0 without a depth-0 element); with ``out.row_reach``
        (:class:`DepthTargets`) also ``reach_{d}`` for d >= 1, the mean reach of depth d's trained
        elements (the share of its loss still trained).
    """
    zero = torch.zeros_like(out.row_loss)
    w = trained.to(out.row_loss.dtype)
    D = num_depths
    count = w.new_zeros(D).index_add_(0, depth, w)
    loss_d = w.new_zeros(D).index_add_(0, depth, torch.where(trained, out.row_loss, zero)) / count.clamp_min(1.0)
    acc_d = w.new_zeros(D).index_add_(0, depth, torch.where(trained, out.row_hit, zero)) / count.clamp_min(1.0)
    metrics: dict[str, torch.Tensor] = {"loss": out.loss_sum.detach()}
    for d in range(D):
        metrics[f"loss_{d}"] = loss_d[d]
        metrics[f"acc_{d}"] = acc_d[d]
    metrics["expected_al"] = expected_acceptance_length(acc_d) * (count[0] > 0)
    if out.row_reach is not None:  # draft.accept_weighting / draft.opd (DepthTargets): the mean reach of depth d
        reach = w.new_zeros(D).index_add_(0, depth, torch.where(trained, out.row_reach, zero)) / count.clamp_min(1.0)
        for d in range(1, D):
            metrics[f"reach_{d}"] = reach[d]
    return out.loss_sum, metrics


def expected_acceptance_length(acc: torch.Tensor | list[float]) -> torch.Tensor:
    """``1 + sum_d prod_{j<=d} acc_j``: the acceptance length the per-depth accuracies imply
    (a 0-dim tensor on ``acc``'s device)."""
    acc = torch.as_tensor(acc, dtype=torch.float32)
    return 1.0 + torch.cumprod(acc, 0).sum()


# --------------------------------------------------------------------------------------
# The dry run's estimates


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """P-EAGLE counterpart of :func:`~draftsmith.models.eagle3.training.parameter_estimate`:
    ``draft.num_layers`` layers (layer 0 with 2H q/k/v inputs, the rest H), ``mask_hidden``, and
    the embedding counted as trainable under ``draft.train_embeddings``. Peak logits: COD keeps up
    to ``sum_d max(r**d, r_min)`` elements per position over ``draft.num_depths`` depths, each
    (Vd,) fp32 logits + softmax grads."""
    d = recipe.draft
    counts = draft_parameter_count(Eagle3Config(**geometry.fields(), num_layers=d.num_layers))
    counts["mask_hidden"] = 3 * geometry.target_hidden_size
    if d.train_embeddings:
        counts["embed_tokens"] = counts.pop("frozen_embedding")
        counts["frozen_embedding"] = 0
    per_position = 1 + sum(max(d.down_sample_ratio**k, d.down_sample_ratio_min) for k in range(1, d.num_depths))
    logits_bytes = int(per_position * recipe.train.batch_size * recipe.data.max_length * geometry.draft_vocab_size
                       * 4 * 3)
    return counts, logits_bytes


# P-EAGLE, per layer over the B*S COD elements (S = T + the depths' budgets): layer 0 reads the
# (S, 2H) concatenation of embedding and hidden state (cast once per projection under autocast).
PEAGLE_LAYER = {"amp-bf16": LayerBytes(H=26.5, I=8, Q=4, KV=4), "bf16": LayerBytes(H=22.5, I=6.5, Q=4.5, KV=4),
                "fp32": LayerBytes(H=53, I=16, Q=8, KV=8)}
PEAGLE_LAYER0_INPUT = {"amp-bf16": 12, "bf16": 4, "fp32": 8}


def cod_elements(recipe: Recipe, T: int) -> int:
    """S, the COD elements of a row of T positions (every position trained: the upper bound)."""
    d = recipe.draft
    return T + sum(cod_budget(T, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min, d.max_anchors))


def loss_calls(recipe: Recipe, T: int) -> int:
    """The loss calls of a step over rows of T positions: one chunked_distill over the elements, or with
    ``draft.accept_weighting`` / ``draft.opd`` one per depth (:class:`DepthTargets`)."""
    d = recipe.draft
    if getattr(d, "accept_weighting", "none") == "none" and getattr(d, "opd", "none") == "none":
        return 1
    return 1 + len(cod_budget(T, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min, d.max_anchors))


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """P-EAGLE: ``draft.num_layers`` layers over the ``B x S`` COD elements of one forward
    (:func:`cod_elements`), attention with a ``(B, S, S)`` mask (its bf16 bias kept for backward),
    the teacher's fp32 distribution at the ``B x T`` positions, the chunked loss over the
    trained elements (on the fused loss its logits buffer and the gradients it holds from forward,
    :func:`~draftsmith.train.dry_run.fused_loss_bytes`; an ``lm_head`` gradient per call,
    :func:`loss_calls`) and their gathered rows."""
    d = recipe.draft
    S = cod_elements(recipe, s.T)
    Es = s.B * S
    L = d.num_layers
    embed = s.V * s.H if d.train_embeddings else 0  # a lookup, never cast by autocast
    layers = L * PEAGLE_LAYER[s.precision](s, Es) + PEAGLE_LAYER0_INPUT[s.precision] * Es * s.H
    if s.checkpointing:  # each layer keeps its input; one layer recomputed in backward
        layers = L * Es * s.H * (4 if s.precision != "bf16" else 2) + PEAGLE_LAYER[s.precision](s, Es)
    kept = 1 if s.checkpointing else L
    expanded = 0 if getattr(recipe.train, "attention_backend", "sdpa") == "flex" else kept * gqa_expanded_kv(s, Es)
    fused = fused_loss_bytes(recipe, s, Es, 1) or {}  # one chunked_distill over the elements
    if fused:  # ... or one per depth (accept weighting, OPD): each holds its own lm_head gradient, the rows theirs
        fused["fused_loss_gradients"] += (loss_calls(recipe, s.T) - 1) * s.Vd * s.H * s.act_bytes
    return {"layers": layers, "attention_masks": s.act_bytes * s.B * S * S, "gqa_expanded_kv": expanded,
            "teacher": s.E * s.Vd * s.target_bytes,
            "loss_chunk": 7 * loss_chunk_rows(recipe, Es, s.Vd) * s.Vd * 4, "loss_rows": 4 * Es * s.H,
            "input_cast": input_cast(s, s.n_aux), "weight_copies": weight_copies(s, trainable - embed), **fused}
