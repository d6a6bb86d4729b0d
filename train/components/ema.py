"""An exponential moving average (EMA) of the draft's trained weights, ``train.ema_decay``.

Polyak averaging as ``torch.optim.swa_utils.get_ema_multi_avg_fn`` defines it, over the trainable
parameters only (a draft's frozen target embedding would double the memory for nothing). After the
optimizer step that makes ``t`` steps taken::

    shadow <- shadow + (1 - d_t) * (param - shadow),   d_t = min(decay, (1 + t) / (10 + t))

The ramp of ``d_t`` (TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``) keeps the
first steps' random weights from dominating a short run. The shadow is fp32 on the parameters'
device, held by the main process only, updated with one ``torch._foreach_lerp_`` per step (no
host sync). Checkpoints write it as ``ema.safetensors`` beside ``model.safetensors`` (same keys,
trainable tensors only); resume loads it, :func:`~draftsmith.train.checkpoint.read_draft` lays it
over the trained weights for export and warm starts. Validation during training measures the
trained weights, not the average.

Sharded parameters (FSDP, DeepSpeed ZeRO-3) are refused: each rank would hold a shard of the
average, and the checkpoint writes a consolidated file from the main process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

EMA_WEIGHTS_NAME = "ema.safetensors"


class WeightEMA:
    """The fp32 shadow of ``model``'s trainable parameters.

    Args:
        model: the unwrapped draft (names as in its ``model.safetensors``).
        decay: the average's decay in (0, 1): the weight of the past per optimizer step (0.99:
            a half-life of about 69 steps).
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def restart(self) -> None:
        """Set the shadow to the parameters' current values (a resume from a checkpoint without an average)."""
        for shadow, p in zip(self.shadow, self.params):
            shadow.copy_(p.detach())

    def decay_at(self, step: int) -> float:
        """``d_t`` after ``step`` optimizer steps taken (1 after the first)."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the shadow towards the parameters after optimizer step ``step`` (1-based). fp32
        parameters are read in place; others (DeepSpeed's bf16 module copy) are cast first, a
        transient of 4 bytes per parameter."""
        params = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.shadow, params, 1.0 - self.decay_at(step))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: fp32 tensor on the CPU}`` of the shadow."""
        return {n: s.detach().cpu().contiguous() for n, s in zip(self.names, self.shadow)}

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.state_dict(), str(path), metadata={"format": "pt", "ema_decay": str(self.decay)})

    @torch.no_grad()
    def load(self, path: Path) -> None:
        """Restore the shadow from a checkpoint's ``ema.safetensors``.

        Raises:
            ValueError: its tensors are not the trainable parameters' names and shapes (one line, the file).
        """
        from safetensors.torch import load_file

        saved = load_file(str(path))
        if set(saved) != set(self.names):
            missing, extra = sorted(set(self.names) - set(saved)), sorted(set(saved) - set(self.names))
            raise ValueError(f"{path}: not this draft's average (missing {missing[:3]}, unexpected {extra[:3]})")
        for name, shadow in zip(self.names, self.shadow):
            if saved[name].shape != shadow.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(saved[name].shape)}, the draft's is "
                                 f"{tuple(shadow.shape)}")
            shadow.copy_(saved[name])


def build_ema(accelerator: Any, model: torch.nn.Module, decay: float) -> WeightEMA | None:
    """The run's :class:`WeightEMA` on the main process when ``decay`` > 0, else None.

    Raises:
        ValueError: ``train.ema_decay`` under FSDP or DeepSpeed ZeRO-3 (sharded parameters).
    """
    if decay <= 0:
        return None
    kind = accelerator.distributed_type.value
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if kind == "FSDP" or (kind == "DEEPSPEED" and plugin is not None and plugin.zero_stage == 3):
        raise ValueError(f"train.ema_decay: not supported under {kind}{' ZeRO-3' if kind == 'DEEPSPEED' else ''} "
                         "(sharded parameters); use DDP or DeepSpeed ZeRO-1/2, or set train.ema_decay: 0")
    if not accelerator.is_main_process:
        return None
    return WeightEMA(accelerator.unwrap_model(model), decay)


def resume_ema(ema: WeightEMA | None, checkpoint: Path) -> None:
    """Load ``checkpoint``'s average into ``ema``; a checkpoint written without one starts the
    average from the resumed weights (one note)."""
    if ema is None:
        return
    path = Path(checkpoint) / EMA_WEIGHTS_NAME
    if path.is_file():
        ema.load(path)
    else:  # built before the checkpoint was loaded: it holds the fresh initialisation until restarted
        ema.restart()
        log.warning("%s has no %s: the weight average starts from the resumed weights", checkpoint, EMA_WEIGHTS_NAME)
