"""The losses the draft methods share: the divergences, the chunked distillation and the heads'
cross-entropy.

- :func:`divergence` (``draft.loss``, :data:`LOSSES`): forward KL (the anchors' default), reverse
  KL, Jensen-Shannon, total variation, or the LK acceptance losses (Samarin et al., "LK Losses:
  Direct Acceptance Rate Optimization for Speculative Decoding", arXiv:2602.23881), between the
  target distribution restricted to the draft vocab and the draft's, per element.
- :func:`chunked_distill`: the weighted divergence of M draft rows, in chunks of rows recomputed
  in backward, called inside the draft's forward; its empty case is the one zero loss
  (``logits_fn(hidden).sum() * 0.0``: the graph reaches every weight the loss would use). On CUDA
  it runs the fused Triton loss instead where ``train.fused_loss`` (its ``fused`` argument, passed
  by each method from its recipe) and :func:`uses_fused_loss` allow it.
- :func:`head_loss`: Medusa heads and MLP-speculator stages, per-head cross-entropy against the
  sequence's next tokens (the target's own regenerated replies), head k weighted ``decay**k``.
- :class:`AcceptSpec`: ``draft.accept_weighting`` (acceptance-aware weights of the later draft
  positions, docs/training.md "Acceptance-aware loss"): what :func:`chunked_distill` computes
  beyond the loss for it (the per-row expected acceptance at the served temperature; the
  within-group masking of a block drafter's slots).

Each method's own loss (EAGLE-3's TTT loss, DFlash's block slots, P-EAGLE's conditional-drop
elements, ...) is in its package's ``training.py`` (``models/<name>/training.py``), built on
these. Which positions the shared losses train on (the labels) is :mod:`draftsmith.train.labels`.
The target distribution is recomputed from the target's final (normed) hidden state and the
``t2d`` rows of the target ``lm_head`` (:class:`TargetDraftHead`): the ``[tokens, V]`` logits are
never built. No loss reads a tensor on the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..draft_section import LossName

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

    ``softcap``: the target's ``final_logit_softcapping`` ``c`` (Gemma 2-4), applied as the target
    applies it before sampling, ``c * tanh(z / c)``: element-wise, so exact on the draft-vocab rows.
    """

    def __init__(self, lm_head_draft_rows: torch.Tensor, softcap: float | None = None):
        super().__init__()
        self.register_buffer("weight", lm_head_draft_rows.detach().clone(), persistent=False)
        self.softcap = float(softcap) if softcap else None

    @classmethod
    def from_full(cls, lm_head: torch.Tensor, t2d: torch.Tensor, softcap: float | None = None) -> TargetDraftHead:
        """Gather the draft rows of a full target ``lm_head [V, H]`` with ``t2d bool [V]``."""
        if lm_head.shape[0] != t2d.shape[0]:
            raise ValueError(
                f"target lm_head has {lm_head.shape[0]} rows but t2d covers {t2d.shape[0]} target ids"
            )
        return cls(lm_head[t2d], softcap)

    @torch.no_grad()
    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != torch.float32 and teacher_in_target_dtype(w.device):
            logits = F.linear(final_hidden.to(w.dtype), w)
        else:
            logits = F.linear(final_hidden.float(), w.float())
        if self.softcap is not None:  # in place: no second (N, Vd) tensor
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


DEFAULT_CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk: 128 MiB per fp32 (C, V) copy


def chunk_rows(vocab_size: int, chunk_size: int | None = None) -> int:
    """Rows per loss chunk: ``chunk_size`` or as many as keep one fp32 ``(C, V)`` tensor at
    :data:`DEFAULT_CHUNK_ELEMENTS` (1048 rows at V = 32000, 261 at V = 128256)."""
    return max(1, chunk_size or DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size))


ACCEPT_WEIGHTINGS = ("none", "hard", "soft")


@dataclass(frozen=True)
class AcceptSpec:
    """``draft.accept_weighting`` at the served temperature (``Recipe.validation_temperatures[0]``): the
    loss of a later draft position (EAGLE-3's TTT step k, a block drafter's slot k) is weighted by
    the detached probability that the chain reaches it, the product over the earlier positions j < k
    of the same chain of

    - ``hard``: ``[draft argmax == target argmax]`` (``row_hit``);
    - ``soft``: the expected acceptance ``sum_v min(p_T(v), q_T(v))`` of speculative sampling at
      temperature T (``row_alpha``, both distributions ``softmax(logits / T)`` over the draft
      vocab, the target's before ``draft.distill_temperature``). At T = 0 it is ``hard`` (greedy
      verification accepts exactly the argmax).

    Attributes:
        mode: ``none`` (off), ``hard`` or ``soft``.
        temperature: the served temperature T (>= 0).
        group: 0: the caller weights the rows (EAGLE-3 carries the product from step to step);
            G > 0: the rows come in contiguous groups of G (one block's slots, in order) and
            :func:`chunked_distill` multiplies each row's weight by the product over the earlier
            rows of its group (:func:`group_reach`).
        opd_gamma: ``draft.opd`` (on-policy distillation, :mod:`draftsmith.train.opd_loss`): the
            same product splits the rows into accepted (weight ``reach``, ``draft.loss``) and
            rejected (weight ``1 - reach``, reverse KL, times ``opd_gamma**k`` at draft position
            k); None: not on-policy distillation (``draft.accept_weighting``).
    """

    mode: str = "none"
    temperature: float = 0.0
    group: int = 0
    opd_gamma: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ACCEPT_WEIGHTINGS:
            raise ValueError(f"accept_weighting {self.mode!r}: one of {', '.join(ACCEPT_WEIGHTINGS)}")

    @classmethod
    def from_recipe(cls, recipe: Any, group: int = 0) -> AcceptSpec | None:
        """The recipe's ``draft.accept_weighting``, or its ``draft.opd`` split (with ``opd_gamma``), at
        the served temperature ``Recipe.validation_temperatures[0]``; None when both are off."""
        opd = getattr(recipe.draft, "opd", "none")
        if opd != "none":
            return cls(opd, float(recipe.validation_temperatures[0]), group, float(recipe.draft.opd_gamma))
        mode = getattr(recipe.draft, "accept_weighting", "none")
        return None if mode == "none" else cls(mode, float(recipe.validation_temperatures[0]), group)

    @property
    def opd(self) -> bool:
        """Whether this is on-policy distillation's split (``draft.opd``), not ``draft.accept_weighting``."""
        return self.opd_gamma is not None

    @property
    def soft(self) -> bool:
        """Whether rows need the expected acceptance (``soft`` at T > 0); else the argmax hit serves."""
        return self.mode == "soft" and self.temperature > 0

    def slot_decay(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(group,)`` float32 ``opd_gamma**j`` at slot j of a group: ``draft.opd``'s decay of the
        rejected term over a block drafter's slots."""
        return self.opd_gamma ** torch.arange(self.group, device=device, dtype=torch.float32)

    def factor(self, out: DistillOut) -> torch.Tensor:
        """``(M,)`` float32 per-row acceptance of ``out``: its ``row_alpha`` (soft, T > 0) or ``row_hit``."""
        return out.row_alpha if self.soft else out.row_hit


def group_reach(factor: torch.Tensor, untrained: torch.Tensor, group: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``(M,)`` the exclusive product over the earlier rows of each contiguous group of ``group``
    rows (a block's slots 1..Bk-1) of ``factor`` (float32 per-row hit or expected acceptance, no
    grad); the first row of a group gets 1, and an ``untrained`` row (no label there) passes the
    chain on (factor 1). M must be a multiple of ``group``; ``out``: a contiguous ``(M,)`` float32
    tensor to write it into (three ops in all)."""
    f = factor.masked_fill(untrained, 1.0).view(-1, group)
    shifted = F.pad(f[:, :-1], (1, 0), value=1.0)  # (M / group, group): 1, f_0, ..., f_{G-2}
    if out is None:
        return shifted.cumprod(1).flatten()
    torch.cumprod(shifted, 1, out=out.view(-1, group))
    return out


def expected_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(C,)`` float32 ``sum_v min(p_T(v), q_T(v))`` with ``p_T = softmax(target_logits / T)`` and
    ``q_T = softmax(draft_logits / T)`` (T > 0), detached."""
    with torch.no_grad():
        return acceptance_probability(torch.log_softmax(target_logits.float() / temperature, dim=-1),
                                      torch.log_softmax(draft_logits.detach().float() / temperature, dim=-1))


@dataclass
class DistillOut:
    """What :func:`chunked_distill` returns.

    Attributes:
        loss_sum: scalar ``sum_m weight_m * D_m`` (with grad; with an :class:`AcceptSpec` of a
            group, ``weight_m * row_reach_m``).
        row_loss: ``(M,)`` float32 ``D_m`` per row (detached; nats).
        row_hit: ``(M,)`` float32, 1 where the draft argmax equals the target argmax (detached).
        row_alpha: with a soft :class:`AcceptSpec` at T > 0, ``(M,)`` float32 expected acceptance
            ``sum_v min(p_T, q_T)`` of each row (detached); else None.
        row_reach: with an :class:`AcceptSpec` of a group, ``(M,)`` float32 the factor each row's
            weight was multiplied by (:func:`group_reach`, rows of weight 0 passing the chain on); else None.
        row_rejected: with ``draft.opd``'s rejected term (a ``rejected_weight``, or its
            :class:`AcceptSpec` over groups), ``(M,)`` float32 ``KL(q_m || p_m)`` per row (detached;
            nats), whose weighted sum ``loss_sum`` includes beside ``D``'s; else None.
    """

    loss_sum: torch.Tensor
    row_loss: torch.Tensor
    row_hit: torch.Tensor
    row_alpha: torch.Tensor | None = field(default=None, kw_only=True)  # keyword-only: subclasses add fields
    row_reach: torch.Tensor | None = field(default=None, kw_only=True)
    row_rejected: torch.Tensor | None = field(default=None, kw_only=True)


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


def _distill_chunk_accept(hidden: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor,
                          weight: torch.Tensor, rejected: torch.Tensor | None,
                          logits_fn: Callable[[torch.Tensor], torch.Tensor], loss: LossSpec,
                          accept: AcceptSpec) -> tuple[torch.Tensor, ...]:
    """:func:`_distill_chunk` (soft labels) with ``accept``: also the rows' expected acceptance (soft,
    from the chunk's own logits), for a group the weights times :func:`group_reach` (the chunk
    holds whole groups) and, with ``rejected`` ``(C,)``, ``sum rejected * KL(q || p)`` added
    (``draft.opd``; over a group ``rejected`` is ``weight * opd_gamma**j``, times ``1 - reach`` here)."""
    logits = logits_fn(hidden).float()  # (C, V)
    target = teacher.index_select(0, teacher_index).float()  # (C, V)
    d = loss(target, logits)
    hit = (logits.argmax(-1) == target.argmax(-1)).float()
    alpha = expected_acceptance(target, logits, accept.temperature) if accept.soft else hit.new_zeros(0)
    reach = hit.new_zeros(0)
    if accept.group:
        reach = group_reach(alpha if accept.soft else hit, weight <= 0, accept.group)
        weight = weight * reach
        rejected = None if rejected is None else rejected * (1.0 - reach)
    total = (weight * d).sum()
    if rejected is None:
        return total, d.detach(), hit, alpha, reach, hit.new_zeros(0)
    r = LossSpec("reverse_kl", target_temperature=loss.target_temperature)(target, logits)
    return total + (rejected * r).sum(), d.detach(), hit, alpha, reach, r.detach()


# the setting of the calls that pass none (fused=None): train.fused_loss reaches the loss as an
# argument from the method (its recipe's setting); this process-wide default is kept only for
# set_fused_loss, the deprecated way to set it
FUSED_LOSS: str | bool = "auto"
_fused_warned: set[str] = set()


def set_fused_loss(setting: str | bool) -> None:
    """Deprecated: pass ``train.fused_loss`` to the loss (``chunked_distill(..., fused=setting)``,
    ``head_loss(..., fused=setting)``; the methods pass their recipe's). Sets the setting of the
    calls that pass none."""
    import warnings

    global FUSED_LOSS
    warnings.warn("set_fused_loss is deprecated: pass train.fused_loss to the loss (chunked_distill(..., "
                  "fused=setting))", DeprecationWarning, stacklevel=2)
    FUSED_LOSS = setting


def fused_device_ok(device: torch.device) -> bool:
    """Whether the fused loss's kernel runs on ``device`` (CUDA; the benchmarks' fake GPU steps
    on a CPU say yes, :func:`benchmarks.memory.cuda_attention_policy`)."""
    return device.type == "cuda"


def uses_fused_loss(setting: str | bool, device: torch.device | str, dtype: torch.dtype,
                    spec: LossSpec | None = None, labels: bool = False,
                    runtime: bool = True) -> tuple[bool, str]:
    """Whether :func:`chunked_distill` takes the fused loss (train/fused_loss.py) for rows of ``dtype``
    on ``device`` under ``train.fused_loss = setting``, given a head it can fuse (``lm_head(norm(h))``
    or a bias-free ``nn.Linear``): the one predicate of the training step and of the dry run's estimate.

    ``runtime=False``: the kernel's coverage (row dtype, loss kind) without this process's Triton (the
    dry run estimates a GPU step from any machine).

    Returns:
        ``(True, "")``; ``(False, "")`` when not asked for (``false``, or ``auto`` off CUDA); or
        ``(False, why)`` when asked for and it cannot run (one line).
    """
    device = torch.device(device)
    if setting is False or (setting == "auto" and not fused_device_ok(device)):
        return False, ""
    from .fused_loss import fused_kernel_covers, fused_loss_available

    if runtime:
        return fused_loss_available(device, dtype, spec, labels)
    return fused_kernel_covers(dtype, spec, labels)


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


def _use_fused(hidden: torch.Tensor, logits_fn: Any, spec: LossSpec, labels: bool,
               setting: str | bool) -> tuple[Any, torch.Tensor] | None:
    """The fused loss's ``(norm, weight)`` when ``train.fused_loss`` (``setting``) and the call allow
    it (:func:`uses_fused_loss`); warns once per reason when it was asked for (``true``, or ``auto``
    on CUDA) and cannot run."""
    if setting is False or (setting == "auto" and not fused_device_ok(hidden.device)):
        return None
    head = _fused_head(logits_fn)
    ok, why = (False, "the draft's logits are not lm_head(norm(h)) with a bias-free lm_head") if head is None else \
        uses_fused_loss(setting, hidden.device, hidden.dtype, spec, labels)
    if ok:
        return head
    if why not in _fused_warned:
        _fused_warned.add(why)
        import warnings

        warnings.warn(f"train.fused_loss: {why}; using the chunked loss", stacklevel=3)
    return None


def resolve_accept(accept: AcceptSpec | None, rejected_weight: torch.Tensor | None, M: int, labels: bool,
                   caller: str) -> AcceptSpec | None:
    """The :class:`AcceptSpec` a call of M rows computes with (None: nothing beyond the plain loss:
    ``none``, or ``hard`` without a group and without a rejected term, whose weights the caller
    carries), after checking it and ``rejected_weight`` (``draft.opd``'s reverse-KL weights).

    Raises:
        ValueError: ``rejected_weight`` without ``draft.opd``'s spec, with a group (its weights then
            come from the group's reach), or not ``(M,)``; ``accept`` with ``labels``; M not whole groups.
    """
    if rejected_weight is not None:
        if accept is None or not accept.opd or accept.group:
            raise ValueError(f"{caller}: rejected_weight is draft.opd's rejected term without groups (pass its "
                             "AcceptSpec; over groups the weights come from the group's reach)")
        if tuple(rejected_weight.shape) != (M,):
            raise ValueError(f"{caller}: rejected_weight ({M},) expected, got {tuple(rejected_weight.shape)}")
    elif accept is not None and (accept.mode == "none" or not (accept.soft or accept.group)):
        return None
    if accept is not None and labels:
        raise ValueError(f"{caller}: accept weighting needs the target's distribution, not labels")
    if accept is not None and accept.group and M % accept.group:
        raise ValueError(f"{caller}: {M} rows are not whole groups of {accept.group}")
    return accept


def chunked_distill(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                    teacher: torch.Tensor, teacher_index: torch.Tensor, weight: torch.Tensor,
                    loss: LossSpec | None = None, chunk_size: int | None = None,
                    labels: bool = False, vocab_size: int | None = None,
                    fused: str | bool | None = None, accept: AcceptSpec | None = None,
                    rejected_weight: torch.Tensor | None = None) -> DistillOut:
    """The weighted divergence of M draft rows against their target rows, computed in chunks of
    rows so that no ``(M, V)`` tensor exists: each chunk's logits and fp32 log-softmaxes live only
    inside the chunk and are recomputed in backward (non-reentrant activation checkpointing), so
    the memory of the loss is ``O(C * V)`` for ``C`` rows per chunk, not ``O(M * V)`` per step.

    On CUDA (``fused``: ``train.fused_loss``, :func:`uses_fused_loss`) with a ``logits_fn`` that is
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
        fused: ``train.fused_loss`` (``"auto"``: the fused loss on CUDA; True: asked for everywhere,
            a warning where it cannot run; False: never); None: the deprecated process-wide
            setting (:func:`set_fused_loss`, default ``"auto"``).
        accept: ``draft.accept_weighting`` (:class:`AcceptSpec`); None or ``none``: the plain loss.
            Soft at T > 0: ``row_alpha`` too (from each chunk's logits, or the fused kernel's).
            With a group: each row's weight times :func:`group_reach` of its group (chunks hold
            whole groups), ``row_reach`` too. Not with ``labels``. ``draft.opd`` (``accept.opd``)
            over a group: also ``weight * (1 - reach) * opd_gamma**j * KL(q || p)`` at slot j
            of each group (``row_rejected``), from the same logits.
        rejected_weight: ``draft.opd`` without groups (EAGLE-3's TTT step, ``accept.opd``): ``(M,)``
            float, detached, each row's weight of ``KL(q || p)``, added to ``loss_sum`` beside
            ``weight * D`` from the same logits (``row_rejected``); None: no such term.

    Raises:
        ValueError: ``labels`` without ``chunk_size`` or ``vocab_size``; ``accept`` or
            ``rejected_weight`` as :func:`resolve_accept` refuses them.

    Returns:
        :class:`DistillOut`; its values and gradients equal the unchunked
        ``sum(weight * divergence(teacher[teacher_index], logits_fn(hidden)))`` (plus the rejected
        term's ``sum(rejected_weight * KL(q || p))``).
    """
    spec = loss or LossSpec()
    M = hidden.shape[0]
    if labels and not (chunk_size or vocab_size):
        raise ValueError("chunked_distill(labels=True) needs chunk_size or vocab_size")
    accept = resolve_accept(accept, rejected_weight, M, labels, "chunked_distill")
    fused = _use_fused(hidden, logits_fn, spec, labels, FUSED_LOSS if fused is None else fused)
    if fused is not None:  # train/fused_loss.py: one matmul, one kernel, two matmuls per chunk; grads in forward
        from .fused_loss import fused_linear_distill

        norm, lm_weight = fused
        return fused_linear_distill(hidden if norm is None else norm(hidden), lm_weight, teacher, teacher_index,
                                    weight, spec, labels, chunk_size, accept=accept, rejected_weight=rejected_weight)
    rows = chunk_rows(vocab_size if labels else teacher.shape[-1], chunk_size)
    if accept is not None:
        return _chunked_accept(hidden, logits_fn, teacher, teacher_index, weight, rejected_weight, spec, rows, accept)
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


def _chunked_accept(hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], teacher: torch.Tensor,
                    teacher_index: torch.Tensor, weight: torch.Tensor, rejected_weight: torch.Tensor | None,
                    spec: LossSpec, rows: int, accept: AcceptSpec) -> DistillOut:
    """The torch path of :func:`chunked_distill` with an :class:`AcceptSpec` (chunks of whole groups)
    and ``draft.opd``'s rejected term (``rejected_weight``, or over groups ``weight * opd_gamma**j``
    times each row's ``1 - reach``)."""
    M, group = hidden.shape[0], accept.group
    if group:
        rows = max(group, rows // group * group)
    if group and accept.opd:
        rejected_weight = (weight.view(-1, group) * accept.slot_decay(weight.device)).flatten()
    rejected = rejected_weight is not None
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, M, rows):
        args = (hidden[s:s + rows], teacher, teacher_index[s:s + rows], weight[s:s + rows],
                rejected_weight[s:s + rows].detach() if rejected else None, logits_fn, spec, accept)
        parts.append(checkpoint(_distill_chunk_accept, *args, use_reentrant=False) if grad
                     else _distill_chunk_accept(*args))
    if not parts:
        zero = logits_fn(hidden).sum() * 0.0
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return DistillOut(zero, empty, empty, row_alpha=empty if accept.soft else None,
                          row_reach=empty if group else None, row_rejected=empty if rejected else None)
    sums, row_loss, row_hit, alpha, reach, reverse = zip(*parts)
    total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return DistillOut(total, torch.cat(row_loss), torch.cat(row_hit), row_alpha=torch.cat(alpha) if accept.soft else None,
                      row_reach=torch.cat(reach) if group else None,
                      row_rejected=torch.cat(reverse) if rejected else None)


@dataclass
class StepMetrics:
    """Per-TTT-step figures: ``loss[k]`` (the step's divergence, nats/token), ``acc[k]`` (fraction of
    masked positions where the draft argmax equals the target argmax over the draft vocab),
    ``tokens[k]`` (positions counted)."""

    loss: list[float]
    acc: list[float]
    tokens: list[int]


# --------------------------------------------------------------------------------------
# Medusa heads / MLP-speculator stages


def head_loss(run_heads: Callable[[Callable[..., Any]], list[Any]], labels: torch.Tensor, label_mask: torch.Tensor,
              decay: float, global_denominators: Callable[[torch.Tensor], Any] | None = None,
              chunk_size: int | None = None, vocab_size: int | None = None,
              counts_host: list[int] | None = None,
              fused: str | bool | None = None) -> tuple[torch.Tensor, StepMetrics]:
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
        fused: ``train.fused_loss`` (:func:`chunked_distill`'s ``fused``).

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
                              vocab_size=vocab_size, fused=fused)
        return out.loss_sum, out.row_loss, out.row_hit

    outs = run_heads(head_fn)
    head_losses = [loss_sum / denominators[k] for k, (loss_sum, _, _) in enumerate(outs)]
    loss = head_losses[0]
    for k in range(1, len(head_losses)):
        loss = loss + decay**k * head_losses[k]
    accs = [(hit * mask[k]).sum() / counts[k].clamp_min(1.0) for k, (_, _, hit) in enumerate(outs)]
    return loss, StepMetrics(loss=[lk.detach() for lk in head_losses], acc=accs, tokens=counts_host or [])
