"""The optimizers of a training run and their learning-rate schedule.

:func:`build_optimizers` builds what ``train.optimizer`` names: fused AdamW (:func:`build_optimizer`)
over every trainable parameter, or AdamW and Muon over the split of :func:`split_muon_params`.
:func:`build_scheduler` gives each one warmup + cosine decay over the run's optimizer steps, or
over steps and seconds under ``train.max_time_minutes`` (:func:`budget_lr_factor`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

log = logging.getLogger("draftsmith.train")


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether torch has a fused AdamW kernel for ``device``'s type (CUDA, CPU, ...)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # private helper moved: the types fused AdamW has had since torch 2.4
        return device.type in ("cuda", "cpu")


def build_optimizer(params: list[torch.nn.Parameter], cfg: Any, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``params``, fused where torch has the kernel for ``device``: one kernel per
    step instead of a loop, and the ``found_inf`` skip of
    :class:`~draftsmith.train.components.nonfinite.NonFiniteGuard` on the device.
    Under DeepSpeed ZeRO this is still the optimizer that steps (on the fp32 partitions; the
    launcher configs declare no DeepSpeed ``optimizer``)."""
    fused = True if fused_adamw_supported(device) else None
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)


# parameters Muon never takes even when 2-D: the token embedding and the output head (Keller
# Jordan's Muon convention, which the speculators trainer follows, its PR #746)
MUON_EXCLUDED_NAMES = ("embed_tokens", "lm_head")


def split_muon_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(muon, adamw)``: the trainable parameters of ``model`` that Muon orthogonalises (2-D
    hidden weight matrices with both sides > 1: the fc, attention and MLP projections) and the
    rest, which AdamW keeps (norms, biases, any 1-D tensor, and every parameter whose name
    contains ``embed_tokens`` or ``lm_head``). The split of the speculators trainer (its
    ``--optimizer muon``, PR #746). Frozen parameters are in neither list."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(n in name for n in MUON_EXCLUDED_NAMES)
        (muon if hidden_matrix else adamw).append(p)
    return muon, adamw


def build_optimizers(model: torch.nn.Module, cfg: Any, device: torch.device,
                     ns_dtype: torch.dtype | None = None) -> list[torch.optim.Optimizer]:
    """The optimizers of ``train.optimizer``, stepped in this order every optimizer step:
    ``adamw``: ``[AdamW]`` over every trainable parameter (:func:`build_optimizer`); ``muon``:
    ``[AdamW, Muon]``: torch's ``torch.optim.Muon`` (Keller Jordan's Muon; 5 Newton-Schulz
    steps, momentum 0.95 with Nesterov, ``adjust_lr_fn="match_rms_adamw"`` so its update RMS
    matches AdamW's, Moonshot's "Muon is Scalable for LLM Training") over the 2-D hidden weight
    matrices at ``train.muon_lr`` (null: ``train.lr``) and ``train.muon_weight_decay``, AdamW
    over the rest (:func:`split_muon_params`). Muon is :class:`draftsmith.train.optim.Muon`
    (torch's, its ``state_dict`` too) with the Newton-Schulz iterations in ``ns_dtype`` (None:
    :func:`~draftsmith.train.optim.newton_schulz_dtype` of ``device``: bf16 where it has fast
    bf16, fp32 elsewhere, e.g. a CPU without AVX-512 bf16 / AMX, where torch's bf16 is 22x slower).

    Raises:
        RuntimeError: ``train.optimizer: muon`` on a torch without ``torch.optim.Muon`` (< 2.9).
    """
    if getattr(cfg, "optimizer", "adamw") == "adamw":
        return [build_optimizer([p for p in model.parameters() if p.requires_grad], cfg, device)]
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"train.optimizer: muon needs torch.optim.Muon (torch >= 2.9); this torch is {torch.__version__}")
    muon, adamw = split_muon_params(model)
    optimizers = [build_optimizer(adamw, cfg, device)] if adamw else []
    if muon:
        from ..optim import Muon, newton_schulz_dtype

        if ns_dtype is None:
            ns_dtype, why = newton_schulz_dtype(device)
            log.info("Muon: Newton-Schulz iterations in %s (%s)", str(ns_dtype).removeprefix("torch."), why)
        optimizers.append(Muon(muon, lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.muon_weight_decay, momentum=0.95,
                               nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype))
    return optimizers


def budget_lr_factor(progress: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Learning-rate factor at ``progress`` in [0, 1] of a budgeted run: linear warmup over the
    first ``warmup_ratio``, then cosine decay to ``min_lr_ratio`` (transformers'
    ``get_cosine_with_min_lr_schedule_with_warmup`` with progress in place of steps)."""
    p = min(max(progress, 0.0), 1.0)
    if p < warmup_ratio:
        return p / warmup_ratio
    t = (p - warmup_ratio) / max(1e-12, 1.0 - warmup_ratio)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any, total_steps: Callable[[], int],
                    seconds: Callable[[], float], budget_s: float | None) -> Any:
    """The learning-rate schedule of ``optimizer`` (one per optimizer, the same factor of each
    one's peak lr): warmup over ``train.warmup_ratio`` then cosine decay to ``train.min_lr_ratio``
    of ``total_steps()`` optimizer steps (transformers' ``get_cosine_with_min_lr_schedule_with_warmup``);
    under a time budget (``budget_s`` seconds, ``train.max_time_minutes``) the same shape over
    ``max(step / total_steps(), seconds() / budget_s)`` (:func:`budget_lr_factor`), with
    ``total_steps()`` as it is when the schedule steps (an early stop or a spent budget lowers it)
    and ``seconds()`` the synced run clock (:class:`~draftsmith.train.components.clock.TrainClock`)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    if budget_s is None:
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, int(cfg.warmup_ratio * total_steps()), total_steps(), min_lr_rate=cfg.min_lr_ratio
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: budget_lr_factor(
        max(step / total_steps(), seconds() / budget_s), cfg.warmup_ratio, cfg.min_lr_ratio))
