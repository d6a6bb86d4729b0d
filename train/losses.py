"""Every training loss of the draft methods, and the divergences and chunking they share.

- :func:`divergence` (``draft.loss``, :data:`LOSSES`): forward KL (the anchors' default), reverse
  KL, Jensen-Shannon, total variation, or the LK acceptance losses (Samarin et al., "LK Losses:
  Direct Acceptance Rate Optimization for Speculative Decoding", arXiv:2602.23881), between the
  target distribution restricted to the draft vocab and the draft's, per element.
- :func:`chunked_distill`: the weighted divergence of M draft rows, in chunks of rows recomputed
  in backward, called inside the draft's forward; its empty case is the one zero loss
  (``logits_fn(hidden).sum() * 0.0``: the graph reaches every weight the loss would use).
- :func:`ttt_loss`: EAGLE-3 (arXiv:2503.01840), the divergence at each TTT step on assistant tokens
  only, weighted ``gamma**k`` (docs/conventions.md, "Loss and step weights").
- :func:`head_loss`: Medusa heads and MLP-speculator stages, per-head cross-entropy against the
  sequence's next tokens (the target's own regenerated replies), head k weighted ``decay**k``.
- :func:`dflash_loss`: DFlash block slots, weighted ``exp(-(k-1)/gamma)`` (:func:`slot_weights`).
- :func:`dflash2_loss`: DFlash2, the DFlash loss plus ``alpha`` times the candidate selector's
  K-way cross-entropy (:func:`chunked_selector`, :class:`SelectorLoss`).
- :func:`cod_loss`: P-EAGLE's conditional-drop elements, per-depth metrics.
- :func:`dspark_loss`: DSpark block slots (Markov-corrected logits): cross-entropy + divergence +
  the confidence head's BCE, weighted ``exp(-k/gamma)`` (vllm-project/speculators PR #677).

Which positions each loss trains on (the labels) is :mod:`draftsmith.train.labels`. The target
distribution is recomputed from the target's final (normed) hidden state and the ``t2d`` rows of
the target ``lm_head`` (:class:`TargetDraftHead`): the ``[tokens, V]`` logits are never built.
No loss reads a tensor on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.common import DistillTargets
from ..models.dspark.model import DSparkTargets
from ..models.dflash2.model import SelectorTargets
from ..recipe import LossName
from .labels import block_labels

LOSSES: tuple[str, ...] = get_args(LossName)
_ALPHA_FLOOR = 1e-6  # lk_alpha: -log(max(alpha, floor)) stays finite at zero overlap


def acceptance_probability(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)`` over the last dim: the probability that a
    token drafted from q is accepted by speculative sampling against p (Leviathan et al. 2023).

    Args:
        log_p, log_q: ``(..., V)`` log-probabilities (target, draft).

    Returns:
        ``(...)`` in [0, 1].
    """
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a || b) = sum_v a_v (log a_v - log b_v)`` over the last dim, from log-probabilities."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def divergence(kind: str, target_logits: torch.Tensor, draft_logits: torch.Tensor, *,
               lk_kl_scale: float = 1.0, lk_kl_decay: float = 3.0) -> torch.Tensor:
    """Per-position loss ``(M,)`` between the target distribution ``p = softmax(target_logits)``
    and the draft's ``q = softmax(draft_logits)`` (both ``(M, V)``, computed in float32; nats).

    - ``forward_kl``: ``KL(p || q) = sum p (log p - log q)`` (mass-covering; the EAGLE anchors').
    - ``reverse_kl``: ``KL(q || p)`` (mode-seeking).
    - ``jsd``: ``(KL(p || m) + KL(q || m)) / 2`` with ``m = (p + q) / 2`` (bounded by log 2).
    - ``tv``: ``sum |p - q| / 2 = 1 - alpha``: minimising it maximises the acceptance rate
      alpha (:func:`acceptance_probability`), but its gradient vanishes where the overlap is small.
    - ``lk_alpha``: ``-log alpha`` (LK^alpha): acceptance directly, its gradient ``grad TV / alpha``
      amplified where the overlap is low; equals cross-entropy for a one-hot target.
    - ``lk_lambda``: ``w * KL(p || q) + (1 - alpha)`` with ``w = lk_kl_scale * exp(-lk_kl_decay *
      alpha)`` (alpha detached; LK^lambda): KL leads while acceptance is low, acceptance after.

    Raises:
        ValueError: unknown ``kind`` (the message lists :data:`LOSSES`).
    """
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    if kind == "forward_kl":  # the soft cross-entropy minus the target entropy (same gradient)
        return _kl(log_p, log_q)
    if kind == "reverse_kl":
        return _kl(log_q, log_p)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_p, log_q]), dim=0) - math.log(2.0)
        return 0.5 * (_kl(log_p, log_m) + _kl(log_q, log_m))
    alpha = acceptance_probability(log_p, log_q)
    if kind == "tv":
        return 1.0 - alpha
    if kind == "lk_alpha":
        return -torch.log(alpha.clamp_min(_ALPHA_FLOOR))
    if kind == "lk_lambda":
        w = lk_kl_scale * torch.exp(-lk_kl_decay * alpha.detach())
        return w * _kl(log_p, log_q) + (1.0 - alpha)
    raise ValueError(f"unknown loss {kind!r}: one of {', '.join(LOSSES)}")


@dataclass(frozen=True)
class LossSpec:
    """``draft.loss``, its LK hyperparameters and ``draft.distill_temperature``: the divergence
    (:func:`divergence`) between ``p = softmax(target_logits / target_temperature)`` and the draft's
    ``q = softmax(draft_logits)``. A temperature below 1 sharpens the target toward its argmax
    (the token greedy verification accepts; near 0 the loss becomes cross-entropy on that token),
    above 1 flattens it; the argmax, and so the accuracy metrics, are unchanged."""

    kind: str = "forward_kl"
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 3.0
    target_temperature: float = 1.0  # p = softmax(target_logits / target_temperature)

    @classmethod
    def from_recipe(cls, draft_cfg) -> LossSpec:
        return cls(draft_cfg.loss, draft_cfg.lk_kl_scale, draft_cfg.lk_kl_decay, draft_cfg.distill_temperature)

    def __call__(self, target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        if self.target_temperature != 1.0:  # a python float: no device work at the default
            target_logits = target_logits.float() / self.target_temperature
        return divergence(self.kind, target_logits, draft_logits, lk_kl_scale=self.lk_kl_scale,
                          lk_kl_decay=self.lk_kl_decay)


def teacher_in_target_dtype(device: torch.device) -> bool:
    """Whether :class:`TargetDraftHead` computes the teacher logits in the target's dtype on
    ``device``: on an accelerator (bf16 tensor cores), not on the CPU."""
    return device.type != "cpu"


class TargetDraftHead(nn.Module):
    """The target ``lm_head`` restricted to the draft vocab: ``weight [Vd, H]`` (frozen, kept in the
    target's dtype: bf16 for a bf16 target).

    ``forward(final_hidden (..., H)) -> logits (..., Vd)``. On an accelerator a bf16 weight
    multiplies in bf16 with fp32 accumulation and the logits stay bf16 (the logits the served
    target computes: vLLM runs the target's ``lm_head`` in its dtype and samples from those
    logits; every loss reads its chunk of rows in float32, so an fp32 copy of all ``N x Vd`` would
    hold the same values at twice the memory); on the CPU the product is taken and returned in float32.
    """

    def __init__(self, lm_head_draft_rows: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", lm_head_draft_rows.detach().clone(), persistent=False)

    @classmethod
    def from_full(cls, lm_head: torch.Tensor, t2d: torch.Tensor) -> TargetDraftHead:
        """Gather the draft rows of a full target ``lm_head [V, H]`` with ``t2d bool [V]``."""
        if lm_head.shape[0] != t2d.shape[0]:
            raise ValueError(
                f"target lm_head has {lm_head.shape[0]} rows but t2d covers {t2d.shape[0]} target ids"
            )
        return cls(lm_head[t2d])

    @torch.no_grad()
    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != torch.float32 and teacher_in_target_dtype(w.device):
            return F.linear(final_hidden.to(w.dtype), w)
        return F.linear(final_hidden.float(), w.float())


DEFAULT_CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk: 128 MiB per fp32 (C, V) copy


def chunk_rows(vocab_size: int, chunk_size: int | None = None) -> int:
    """Rows per loss chunk: ``chunk_size`` or as many as keep one fp32 ``(C, V)`` tensor at
    :data:`DEFAULT_CHUNK_ELEMENTS` (1048 rows at V = 32000, 261 at V = 128256)."""
    return max(1, chunk_size or DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size))


@dataclass
class DistillOut:
    """What :func:`chunked_distill` returns.

    Attributes:
        loss_sum: scalar ``sum_m weight_m * D_m`` (with grad).
        row_loss: ``(M,)`` float32 ``D_m`` per row (detached; nats).
        row_hit: ``(M,)`` float32, 1 where the draft argmax equals the target argmax (detached).
    """

    loss_sum: torch.Tensor
    row_loss: torch.Tensor
    row_hit: torch.Tensor


def _distill_chunk(hidden: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor,
                   weight: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], loss: LossSpec,
                   labels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits_fn(hidden).float()  # (C, V)
    if labels:  # hard labels: teacher (N,) token ids
        target = teacher.index_select(0, teacher_index)  # (C,)
        d = F.cross_entropy(logits, target, reduction="none")
        hit = logits.argmax(-1) == target
    else:
        target = teacher.index_select(0, teacher_index).float()  # (C, V)
        d = loss(target, logits)
        hit = logits.argmax(-1) == target.argmax(-1)
    return (weight * d).sum(), d.detach(), hit.float()


# train.fused_loss (set by the trainer, set_fused_loss): "auto" runs the fused Triton loss
# (train/fused_loss.py) on CUDA, True asks for it everywhere (a warning where it cannot run), False never
FUSED_LOSS: str | bool = "auto"
_fused_warned: set[str] = set()


def set_fused_loss(setting: str | bool) -> None:
    """``train.fused_loss`` for every :func:`chunked_distill` of this process."""
    global FUSED_LOSS
    FUSED_LOSS = setting


def fused_device_ok(device: torch.device) -> bool:
    """Whether the fused loss's kernel runs on ``device`` (CUDA; the benchmarks' fake GPU steps
    on a CPU say yes, :func:`benchmarks.memory.cuda_attention_policy`)."""
    return device.type == "cuda"


def _fused_head(logits_fn: Any) -> tuple[Any, torch.Tensor] | None:
    """``(norm or None, weight)`` when ``logits_fn`` is a bias-free ``nn.Linear`` or a draft's
    ``compute_logits`` marked ``fused_as = ("norm", "lm_head")`` (``lm_head(norm(h))``); else None."""
    if isinstance(logits_fn, nn.Linear):
        return None if logits_fn.bias is not None else (None, logits_fn.weight)
    names, owner = getattr(logits_fn, "fused_as", None), getattr(logits_fn, "__self__", None)
    if names is None or owner is None:
        return None
    norm, lm_head = (getattr(owner, n) for n in names)
    return None if getattr(lm_head, "bias", None) is not None else (norm, lm_head.weight)


def _use_fused(hidden: torch.Tensor, logits_fn: Any, spec: LossSpec, labels: bool) -> tuple[Any, torch.Tensor] | None:
    """The fused loss's ``(norm, weight)`` when ``train.fused_loss`` and the call allow it; warns
    once per reason when it was asked for (``true``, or ``auto`` on CUDA) and cannot run."""
    if FUSED_LOSS is False or (FUSED_LOSS == "auto" and not fused_device_ok(hidden.device)):
        return None
    from .fused_loss import fused_loss_available

    head = _fused_head(logits_fn)
    ok, why = (False, "the draft's logits are not lm_head(norm(h)) with a bias-free lm_head") if head is None else \
        fused_loss_available(hidden.device, hidden.dtype, spec, labels)
    if ok:
        return head
    if why not in _fused_warned:
        _fused_warned.add(why)
        import warnings

        warnings.warn(f"train.fused_loss: {why}; using the chunked loss", stacklevel=3)
    return None


def chunked_distill(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                    teacher: torch.Tensor, teacher_index: torch.Tensor, weight: torch.Tensor,
                    loss: LossSpec | None = None, chunk_size: int | None = None,
                    labels: bool = False, vocab_size: int | None = None) -> DistillOut:
    """The weighted divergence of M draft rows against their target rows, computed in chunks of
    rows so that no ``(M, V)`` tensor exists: each chunk's logits and fp32 log-softmaxes live only
    inside the chunk and are recomputed in backward (non-reentrant activation checkpointing), so
    the memory of the loss is ``O(C * V)`` for ``C`` rows per chunk, not ``O(M * V)`` per step.

    On CUDA (``train.fused_loss``, :func:`set_fused_loss`) with a ``logits_fn`` that is
    ``lm_head(norm(h))`` (a draft's ``compute_logits`` marked ``fused_as``) or a bias-free
    ``nn.Linear``, the same values come from the fused Triton loss instead
    (:func:`~draftsmith.train.fused_loss.fused_linear_distill`: per chunk one logits matmul, one
    kernel for the divergence, accuracy and ``dD/dlogits``, two gradient matmuls; no fp32 logits,
    no separate argmax; the gradients are computed in forward and held to backward).

    Call it inside the draft's ``forward`` (``logits_fn`` uses the draft's ``norm`` / ``lm_head``),
    so DDP / FSDP see those weights used in forward and accelerate's fp32 output conversion
    copies scalars, not logits. Reads no tensor on the host (no sync).

    Args:
        hidden: ``(M, H)`` draft rows (pre-norm hidden states), with grad.
        logits_fn: ``(C, H) -> (C, V)`` draft logits.
        teacher: ``(N, V)`` target logits over the draft vocab (no grad; fp32 or bf16), or with
            ``labels`` ``(N,)`` target token ids (cross-entropy against hard labels).
        teacher_index: ``(M,)`` int64, the ``teacher`` row of each hidden row.
        weight: ``(M,)`` float, the loss weight of each row (0: not trained).
        loss: the divergence (``draft.loss``, :class:`LossSpec`); None: forward KL. Ignored with ``labels``.
        chunk_size: rows per chunk; default :func:`chunk_rows` of V.
        labels: ``teacher`` holds token ids (Medusa heads / MLP-speculator stages).
        vocab_size: V of ``logits_fn`` (sizes the default chunk when ``labels``).

    Raises:
        ValueError: ``labels`` without ``chunk_size`` or ``vocab_size``.

    Returns:
        :class:`DistillOut`; its values and gradients equal the unchunked
        ``sum(weight * divergence(teacher[teacher_index], logits_fn(hidden)))``.
    """
    spec = loss or LossSpec()
    M = hidden.shape[0]
    if labels and not (chunk_size or vocab_size):
        raise ValueError("chunked_distill(labels=True) needs chunk_size or vocab_size")
    fused = _use_fused(hidden, logits_fn, spec, labels)
    if fused is not None:  # train/fused_loss.py: one matmul, one kernel, two matmuls per chunk; grads in forward
        from .fused_loss import fused_linear_distill

        norm, lm_weight = fused
        return fused_linear_distill(hidden if norm is None else norm(hidden), lm_weight, teacher, teacher_index,
                                    weight, spec, labels, chunk_size)
    rows = chunk_rows(vocab_size if labels else teacher.shape[-1], chunk_size)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    sums, row_loss, row_hit = [], [], []
    for s in range(0, M, rows):
        args = (hidden[s:s + rows], teacher, teacher_index[s:s + rows], weight[s:s + rows], logits_fn, spec, labels)
        out = checkpoint(_distill_chunk, *args, use_reentrant=False) if grad else _distill_chunk(*args)
        sums.append(out[0]), row_loss.append(out[1]), row_hit.append(out[2])
    if not sums:  # no row: the zero loss, whose graph reaches hidden and logits_fn's weights (DDP / FSDP)
        zero = logits_fn(hidden).sum() * 0.0
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return DistillOut(zero, empty, empty)
    total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return DistillOut(total, torch.cat(row_loss), torch.cat(row_hit))


@dataclass
class StepMetrics:
    """Per-TTT-step figures: ``loss[k]`` (the step's divergence, nats/token), ``acc[k]`` (fraction of
    masked positions where the draft argmax equals the target argmax over the draft vocab),
    ``tokens[k]`` (positions counted)."""

    loss: list[float]
    acc: list[float]
    tokens: list[int]


# --------------------------------------------------------------------------------------
# EAGLE-3: training-time test (TTT)


def ttt_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, plan: dict[str, Any],
             steps: int, head: Callable[[torch.Tensor], torch.Tensor], gamma: float, loss: LossSpec | None = None,
             chunk_size: int | None = None, global_denominators: Callable[[torch.Tensor], Any] | None = None,
             position_ids: torch.Tensor | None = None,
             document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The TTT loss ``sum_k gamma**k D_k``: the draft unrolled ``steps`` times with the chunked
    divergence (:func:`chunked_distill`) as its step head, without host reads.

    Args:
        model: the :class:`~draftsmith.models.eagle3.Eagle3DraftModel` (possibly wrapped).
        input_ids / position_ids / document_ids: ``(B, T)`` the batch.
        aux: ``(B, T, 3*Ht)`` aux states in the draft's dtype; final: ``(B, T, Ht)`` the target's
            final hidden states.
        plan: :func:`~draftsmith.train.labels.ttt_plan` of the batch (its rows per step).
        steps: K. head: the target head over the draft vocab (``TargetDraftHead``), run once per
            batch at the rows some step needs. gamma: the step decay.
        loss: ``train.loss``; None: forward KL. chunk_size: rows per loss chunk.
        global_denominators: data parallel: ``(K,)`` local counts -> the global counts over the
            world size, or None on one process.

    Returns:
        ``(loss, metrics)``: ``D_k`` is step k's summed divergence over its M_k rows divided by
        M_k (or the data-parallel denominator); metrics ``loss``, ``loss_{k}``, ``acc_{k}`` (argmax
        agreement over the step's rows), detached 0-dim tensors.
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

    def step_head(k: int, hidden: torch.Tensor, logits_fn):
        h = hidden.flatten(0, 1).index_select(0, index[k])  # (M_k, H)
        weight = (gamma**k / denominators[k]).expand(counts[k])
        return chunked_distill(h, logits_fn, teacher, teacher_index[k], weight, loss, chunk_size)

    outs = model(input_ids, aux, steps, None, position_ids, document_ids, step_head=step_head)
    total = torch.stack([o.loss_sum for o in outs]).sum()
    loss_sum = torch.stack([o.row_loss.sum() for o in outs])
    acc = torch.stack([o.row_hit.sum() for o in outs]) / counts_t.clamp_min(1)
    metrics = {"loss": total.detach()}
    for k in range(steps):
        metrics[f"loss_{k}"], metrics[f"acc_{k}"] = loss_sum[k] / denominators[k], acc[k]
    return total, metrics


# --------------------------------------------------------------------------------------
# Medusa heads / MLP-speculator stages


def head_loss(run_heads: Callable[[Callable[..., Any]], list[Any]], labels: torch.Tensor, label_mask: torch.Tensor,
              decay: float, global_denominators: Callable[[torch.Tensor], Any] | None = None,
              chunk_size: int | None = None, vocab_size: int | None = None,
              counts_host: list[int] | None = None) -> tuple[torch.Tensor, StepMetrics]:
    """``sum_k decay**k * CE_k``, ``CE_k`` head k's summed cross-entropy over its labelled positions
    divided by the (global, data parallel) count, computed per head in chunks of rows
    (:func:`chunked_distill` with ``labels``): the value and gradients of the per-head
    cross-entropy over ``(K, M, V)`` logits, without building them. Every head runs on the union
    of positions, weight 0 where it has no label. No host read.

    Args:
        run_heads: ``run_heads(head_fn)`` runs the K heads inside the model's forward with
            ``head_fn(k, hidden (M, H), lm_head) -> (loss_sum, row_loss, row_hit)`` and returns
            its K results.
        labels: ``(K, M)`` token ids; label_mask: ``(K, M)`` bool (:func:`~draftsmith.train.labels.head_targets`).
        decay: ``train.head_decay``.
        global_denominators: data parallel: ``(K,)`` local counts -> global counts over the world
            size, or None on one process.
        chunk_size / vocab_size: the chunking of :func:`chunked_distill`.
        counts_host: M_k per head as python ints, when known on the host (the batch plan's).

    Returns:
        ``(loss, StepMetrics)`` with per-head losses and accuracies as detached device tensors.
    """
    mask = label_mask.float()  # (K, M)
    counts = mask.sum(1)  # (K,) local label counts
    denominators = global_denominators(counts) if global_denominators is not None else None
    if denominators is None:
        denominators = counts.clamp_min(1.0)
    rows = torch.arange(labels.shape[1], device=labels.device)

    def head_fn(k: int, hidden: torch.Tensor, lm_head: nn.Module) -> tuple[torch.Tensor, ...]:
        out = chunked_distill(hidden, lm_head, labels[k], rows, mask[k], chunk_size=chunk_size, labels=True,
                              vocab_size=vocab_size)
        return out.loss_sum, out.row_loss, out.row_hit

    outs = run_heads(head_fn)
    head_losses = [loss_sum / denominators[k] for k, (loss_sum, _, _) in enumerate(outs)]
    loss = head_losses[0]
    for k in range(1, len(head_losses)):
        loss = loss + decay**k * head_losses[k]
    accs = [(hit * mask[k]).sum() / counts[k].clamp_min(1.0) for k, (_, _, hit) in enumerate(outs)]
    return loss, StepMetrics(loss=[lk.detach() for lk in head_losses], acc=accs, tokens=counts_host or [])


# --------------------------------------------------------------------------------------
# DFlash: anchor blocks


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
        label_pos: ``(B, A, Bk)`` label positions (:func:`~draftsmith.train.labels.block_labels`).
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


def dflash_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, head: Any,
                weights: torch.Tensor, loss: Any = None, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                global_denominators: Callable[[torch.Tensor], Any] | None = None,
                chunk_size: int | None = None,
                selector: "SelectorLoss | None" = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One DFlash loss over given anchors, without host reads.

    Args:
        model: the :class:`~draftsmith.models.dflash.DFlashDraftModel` (possibly wrapped).
        input_ids / loss_mask / position_ids / document_ids: ``(B, T)`` the batch.
        aux: ``(B, T, n*Ht)`` aux states in the draft's dtype; final: ``(B, T, Ht)`` the
            target's final hidden states.
        anchors / anchor_valid: ``(B, A)`` (:func:`~draftsmith.train.labels.sample_anchors`).
        head: the target head over the draft vocab (``TargetDraftHead``).
        weights: ``(Bk,)`` slot weights (:func:`slot_weights`).
        loss: ``train.loss`` (``LossSpec``); None: forward KL.
        global_denominators: data parallel: ``(1,)`` local weight sum -> the global sum over the
            world size (a device tensor), or None on one process.
        chunk_size: rows per loss chunk (default: ``chunk_rows`` of Vd).
        selector: DFlash2 (:func:`dflash2_loss`): also the candidate selector's loss, added
            ``selector.alpha``-weighted with the same slot weights and denominator.

    Returns:
        ``(loss, metrics)``: ``loss = sum(w * D) / sum(w)`` over the trained slots (with
        ``selector``: ``+ alpha * sum(w * CE) / sum(w)``); metrics ``loss``, ``loss_{k-1}`` /
        ``acc_{k-1}`` per slot k, ``acceptance_length`` (:func:`slot_metrics`; with ``selector``
        also :meth:`SelectorLoss.metrics`), all detached 0-dim tensors.
    """
    Bk = weights.shape[0]
    B, A = anchors.shape
    label_pos, label_mask = block_labels(anchors, anchor_valid, loss_mask, Bk, document_ids)  # (B, A, Bk)
    teacher, teacher_index = teacher_rows(final, label_pos, head)  # p_{a+k-1}
    weight = weights.to(loss_mask.device) * label_mask  # (B, A, Bk), 0 where not trained
    targets: Any = DistillTargets(teacher_index=teacher_index[:, :, 1:], weight=weight[:, :, 1:], teacher=teacher,
                                  distill=chunked_distill, loss=loss, chunk_size=chunk_size)
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
    if selected is not None:
        selector_total = selected.loss_sum / scale
        metrics.update(selector.metrics(selected, selector_total, label_mask[:, :, 1:]), dflash_loss=total.detach())
        total = total + selector.alpha * selector_total
        metrics["loss"] = total.detach()
    return total, metrics


# --------------------------------------------------------------------------------------
# DSpark: anchor blocks with a Markov head and a confidence head


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
    included, is a prediction): DFlash's :func:`slot_weights` of a block one longer, its anchor dropped."""
    return slot_weights(block_size + 1, gamma)[1:]


@dataclass
class DSparkOut(DistillOut):
    """:class:`DistillOut` of the DSpark rows (``row_loss``: the weighted sum of the terms per row)
    plus ``row_alpha (M,)``: the acceptance probability ``1 - TV`` of each row (detached), the
    confidence head's target."""

    row_alpha: torch.Tensor | None = None


def _dspark_chunk(model: Any, hidden: torch.Tensor, embed: torch.Tensor, teacher: torch.Tensor,
                  teacher_index: torch.Tensor, labels: torch.Tensor, label_ok: torch.Tensor, weight: torch.Tensor,
                  spec: DSparkLossSpec) -> tuple[torch.Tensor, ...]:
    logits = model.markov_logits(hidden, embed).float()  # (C, Vd)
    target = teacher.index_select(0, teacher_index).float()  # (C, Vd)
    alpha = acceptance_probability(torch.log_softmax(target, -1), torch.log_softmax(logits, -1)).detach()
    ce = F.cross_entropy(logits, labels, reduction="none") * label_ok
    row = spec.ce_weight * ce + spec.distill_weight * spec.distill(target, logits)
    if model.confidence_head is not None:  # always in the graph (weight 0 or not): DDP / FSDP see it used
        conf = model.confidence_logit(hidden, embed)
        row = row + spec.confidence_weight * F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
    hit = logits.argmax(-1) == target.argmax(-1)
    return (weight * row).sum(), row.detach(), hit.float(), alpha


def dspark_rows(model: Any, hidden: torch.Tensor, embed: torch.Tensor, targets: Any) -> DSparkOut:
    """The DSpark loss of M slot rows, in chunks of rows recomputed in backward (as
    :func:`chunked_distill`): per row ``ce_weight * CE(z, y) + distill_weight * D(p, softmax(z))
    + confidence_weight * BCE(sigmoid(c), 1 - TV(p, softmax(z)))`` with ``z`` the Markov-corrected
    logits, ``y`` the true next token (CE only where it is in the draft vocab), ``p`` the target's
    distribution and ``c`` the confidence logit (the BCE target is detached).

    Args:
        model: the :class:`~draftsmith.models.dspark.model.DSparkDraftModel` (unwrapped module).
        hidden: ``(M, H)`` pre-norm slot rows; embed: ``(M, r)`` Markov embeddings of each row's
            previous token.
        targets: the :class:`~draftsmith.models.dspark.model.DSparkTargets` (rows flattened alike).

    Returns:
        :class:`DSparkOut` (``loss_sum`` with grad).
    """
    spec = targets.options or DSparkLossSpec()
    rows = chunk_rows(targets.teacher.shape[-1], targets.chunk_size)
    flat = [t.reshape(-1) for t in (targets.teacher_index, targets.labels, targets.label_ok.float(), targets.weight)]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    outs = []
    for s in range(0, hidden.shape[0], rows):
        args = (model, hidden[s:s + rows], embed[s:s + rows], targets.teacher, *(t[s:s + rows] for t in flat), spec)
        outs.append(checkpoint(_dspark_chunk, *args, use_reentrant=False) if grad else _dspark_chunk(*args))
    total = torch.stack([o[0] for o in outs]).sum()
    row_loss, row_hit, row_alpha = (torch.cat([o[i] for o in outs]) for i in (1, 2, 3))
    return DSparkOut(total, row_loss, row_hit, row_alpha)


def dspark_loss(model: Any, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, head: Any,
                t2d: torch.Tensor, weights: torch.Tensor, spec: DSparkLossSpec | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                global_denominators: Callable[[torch.Tensor], Any] | None = None,
                chunk_size: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One DSpark loss over given anchors, without host reads. Follows the DSpark loss of
    vllm-project/speculators PR #677 ("Add DSpark speculator (DFlash + Markov + confidence
    head)"): ``0.1 * CE + 0.9 * TV`` on every block slot, slot k weighted ``exp(-k/4)``, plus
    ``1.0 * BCE(confidence, 1 - TV)`` (the weights, the divergence and the decay are the recipe's).

    Labels (``sample_from_anchor``): slot k of anchor a predicts ``x_{a+k+1}``, its teacher is
    ``p_{a+k}`` and its Markov bias uses the true previous token ``x_{a+k}`` (teacher forcing);
    they are DFlash's :func:`~draftsmith.train.labels.block_labels` / :func:`teacher_rows` of a
    block one slot longer, its slot 0 dropped.

    Args:
        model: the DSpark draft (possibly wrapped); input_ids / loss_mask / position_ids /
            document_ids ``(B, T)``; aux ``(B, T, n*Ht)``; final ``(B, T, Ht)``; anchors /
            anchor_valid ``(B, A)``; head: the target head over the draft vocab.
        t2d: ``(V,)`` bool, the target ids in the draft vocab.
        weights: ``(Bk,)`` slot weights (:func:`dspark_slot_weights`).
        spec: :class:`DSparkLossSpec` (None: speculators' defaults).
        global_denominators / chunk_size: as :func:`dflash_loss`.

    Returns:
        ``(loss, metrics)``: ``loss = sum(w * row) / sum(w)``; metrics ``loss``, ``loss_{k}`` /
        ``acc_{k}`` per slot k (argmax agreement with the target), ``acceptance_length``,
        ``alpha`` (mean ``1 - TV`` over trained rows), all detached 0-dim tensors.
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
    targets = DSparkTargets(teacher=teacher, teacher_index=teacher_index, labels=draft_id[tokens], label_ok=t2d[tokens],
                            weight=weight, compute=dspark_rows, options=spec, chunk_size=chunk_size)
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
    return total, metrics


# --------------------------------------------------------------------------------------
# DFlash2: the candidate selector's K-way cross-entropy


@dataclass
class SelectorOut(DistillOut):
    """What :func:`chunked_selector` returns: :class:`DistillOut` (``row_loss`` the K-way
    cross-entropy, ``row_hit`` 1 where the selector's top score is the gold token) plus
    ``row_covered (M,)`` float32, 1 where the gold token was among the unary top-K."""

    row_covered: torch.Tensor


def _selector_chunk(hidden: torch.Tensor, predecessor: torch.Tensor, gold: torch.Tensor, weight: torch.Tensor,
                    score_fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    scores, target, covered = score_fn(hidden, predecessor, gold)  # (C, K), (C,), (C,)
    ce = F.cross_entropy(scores, target, reduction="none")
    return (weight * ce).sum(), ce.detach(), (scores.argmax(-1) == target).float(), covered.float()


def chunked_selector(hidden: torch.Tensor, score_fn: Callable[..., Any], predecessor: torch.Tensor,
                     gold: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> SelectorOut:
    """The weighted K-way cross-entropy of the DFlash2 selector over M slots, in chunks of
    ``chunk_size`` rows recomputed in backward (as :func:`chunked_distill`: no ``(M, V)`` tensor).

    Args:
        hidden: ``(M, H)`` pre-norm slot hidden states, with grad.
        score_fn: ``score_fn(hidden (C, H), predecessor (C,), gold (C,)) -> (scores (C, K), target
            (C,), covered (C,))`` (:meth:`~draftsmith.models.dflash2.model.DFlash2DraftModel.teacher_forced_scores`).
        predecessor / gold: ``(M,)`` token ids; weight: ``(M,)`` float (0: not trained).
        chunk_size: rows per chunk.

    Returns:
        :class:`SelectorOut`; ``loss_sum = sum(weight * CE)`` with grad.
    """
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for s in range(0, max(hidden.shape[0], 1), chunk_size):  # one (possibly empty) chunk at M = 0
        args = (hidden[s:s + chunk_size], predecessor[s:s + chunk_size], gold[s:s + chunk_size],
                weight[s:s + chunk_size], score_fn)
        parts.append(checkpoint(_selector_chunk, *args, use_reentrant=False) if grad else _selector_chunk(*args))
    total = torch.stack([p[0] for p in parts]).sum()
    return SelectorOut(total, *(torch.cat([p[i] for p in parts]) for i in (1, 2, 3)))


@dataclass
class SelectorLoss:
    """The DFlash2 selector term of :func:`dflash_loss` (speculators PR #1006 / SpecForge PR #772):
    ``alpha * sum_slots w * CE(S(pred, .), gold) / sum w``, S the teacher-forced scores of the unary
    top-K candidates (the gold token injected as the K-th when missing), ``pred`` the true previous
    token (the anchor for slot 1), ``gold`` the sequence's token at the slot, w DFlash's slot weights.

    Attributes:
        alpha: the term's weight (``draft.selector_loss_alpha``; 1.0 in both references).
        chunk_size: rows per chunk (None: :func:`dflash_loss`'s ``chunk_size``, else ``chunk_rows`` of V).
    """

    alpha: float = 1.0
    chunk_size: int | None = None

    def targets(self, distill: DistillTargets, input_ids: torch.Tensor, label_pos: torch.Tensor,
                rows: int) -> SelectorTargets:
        """The :class:`SelectorTargets` of blocks at ``label_pos (B, A, Bk)`` (slot 0 = the anchor),
        ``rows`` per chunk."""
        tokens = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)  # (B, A, Bk)
        return SelectorTargets(distill, predecessor=tokens[:, :, :-1], gold=tokens[:, :, 1:], weight=distill.weight,
                               select=chunked_selector, chunk_size=rows)

    @staticmethod
    def metrics(out: SelectorOut, total: torch.Tensor, trained: torch.Tensor) -> dict[str, torch.Tensor]:
        """``selector_loss`` (the weighted term before alpha), ``selector_acc`` (teacher-forced top
        score is the gold token) and ``selector_coverage`` (gold among the unary top-K), means
        over the trained slots ``trained (B, A, Bk-1)``; detached."""
        w = trained.reshape(-1).float()
        n = w.sum().clamp_min(1.0)
        return {"selector_loss": total.detach(), "selector_acc": ((out.row_hit * w).sum() / n).detach(),
                "selector_coverage": ((out.row_covered * w).sum() / n).detach()}


def dflash2_loss(model: Any, *args: Any, alpha: float = 1.0,
                 **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash2 loss: :func:`dflash_loss` (same arguments, ``model`` a
    :class:`~draftsmith.models.dflash2.model.DFlash2DraftModel`) with the selector term
    ``SelectorLoss(alpha)``."""
    return dflash_loss(model, *args, selector=SelectorLoss(alpha), **kwargs)


# --------------------------------------------------------------------------------------
# P-EAGLE: conditional-drop (COD) elements


def cod_loss(out: DistillOut, depth: torch.Tensor, trained: torch.Tensor,
             num_depths: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss and per-depth metrics from the model's divergence over the elements.

    ``out`` is :meth:`PEagleDraftModel.forward` with :class:`~draftsmith.models.eagle3.DistillTargets` whose weight is
    ``trained / N`` (N the trained count, or the data-parallel denominator), so
    ``out.loss_sum = sum_s D(p_{pos_s + 1} || q_s) / N`` over the trained elements, D the
    divergence ``train.loss``. Nothing is read on the host: the metrics are masked sums
    (``index_add`` over depth).

    Args:
        out: the ``DistillOut`` over M rows: the ``B*S`` elements (row-major), or the plan's
            rows (``DistillTargets.rows``).
        depth: ``(M,)`` depth of each row.
        trained: ``(M,)`` bool, the rows trained on.
        num_depths: D, the number of per-depth metric slots.

    Returns:
        ``(loss, metrics)``: ``loss = out.loss_sum``; metrics, detached 0-dim tensors: ``loss``,
        per depth d ``loss_{d}`` (mean divergence), ``acc_{d}`` (draft argmax == target argmax over
        the draft vocab), both 0 at a depth with no element, and ``expected_al``
        (:func:`expected_acceptance_length`; 0 without a depth-0 element).
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
    return out.loss_sum, metrics


def expected_acceptance_length(acc: torch.Tensor | list[float]) -> torch.Tensor:
    """``1 + sum_d prod_{j<=d} acc_j``: the acceptance length the per-depth accuracies imply
    (a 0-dim tensor on ``acc``'s device)."""
    acc = torch.as_tensor(acc, dtype=torch.float32)
    return 1.0 + torch.cumprod(acc, 0).sum()
