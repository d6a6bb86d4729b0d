"""The training clock of ``train.max_time_minutes``: loop wall time summed over resumes, the same
on every rank at the steps that read it."""

from __future__ import annotations

import time
from typing import Any

import torch


def time_budget_s(cfg: Any) -> float | None:
    """``train.max_time_minutes`` in seconds; None when the run has no time budget."""
    return cfg.max_time_minutes * 60.0 if cfg.max_time_minutes else None


class TrainClock:
    """Seconds of training-loop wall time, summed over resumes (``train.max_time_minutes``).

    :meth:`sync` (once per optimizer step) fixes the value every process uses until the next
    sync to the main process's reading, so the learning rate and the stop decision are the same
    on every rank."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.before = 0.0
        self.synced: float | None = None

    def start(self, t0: float, seconds_before: float) -> None:
        self.t0, self.before = t0, seconds_before

    def now(self) -> float:
        return self.before + (time.perf_counter() - self.t0 if self.t0 is not None else 0.0)

    def sync(self, accelerator: Any) -> None:
        value = self.now()
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            value = float(broadcast(torch.tensor([value], dtype=torch.float64, device=accelerator.device))[0])
        self.synced = value

    def seconds(self) -> float:
        return self.synced if self.synced is not None else self.now()
