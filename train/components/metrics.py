"""What a training run logs: the per-step metric window, the one writer of ``metrics.jsonl``,
the trackers of ``train.report_to`` (wandb / tensorboard) and the validation metric followed.

- :class:`MetricWindow`: per-micro-batch metrics summed on the device between logging steps
  (non-finite values left out), read with one all-reduce and one host read; its sums go into
  ``train_state.json`` (:func:`window_state`) and come back per rank (:func:`window_sums_of_rank`).
- :class:`MetricsWriter`: ``RUN_DIR/metrics.jsonl`` (main process) and ``accelerator.log``.
- :func:`init_trackers`: accelerate's trackers under ``RUN_DIR/logs``.
- :func:`best_metric`: the key checkpoints/best and early stopping follow.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from ...layout import RunLayout
from ...recipe import Recipe
from ..checkpoint import truncate_metrics
from ..distributed import full_tensor

log = logging.getLogger("draftsmith.train")


class MetricWindow:
    """Per-micro-batch metrics since the last logged step, summed on the device.

    Each key has a row ``(sum, count)`` of one device tensor (float64; float32 on MPS); a value
    that is not finite is left out of both. :meth:`add` is a few small kernels per micro-batch
    and never reads the device; :meth:`read` (logging steps) all-reduces the sums over ranks
    and reads them once; :meth:`local_state` / :meth:`restore` carry one rank's sums through a
    checkpoint exactly (the same float additions happen in the same order after a resume).
    Python numbers are accepted too (put on the device with a fill, no copy).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.keys: list[str] = []
        self.rows: dict[str, int] = {}
        self.acc = torch.zeros((0, 2), dtype=self.dtype, device=self.device)
        self._index: dict[tuple[str, ...], torch.Tensor] = {}

    def _grow(self, names: Any) -> None:
        new = [k for k in names if k not in self.rows]
        for k in new:
            self.rows[k] = len(self.keys)
            self.keys.append(k)
        if new:
            self.acc = torch.cat([self.acc, self.acc.new_zeros((len(new), 2))])

    def add(self, metrics: dict[str, Any]) -> None:
        if not metrics:
            return
        names = tuple(metrics)
        index = self._index.get(names)
        if index is None:  # the first micro-batch with this set of keys
            self._grow(names)
            index = torch.tensor([self.rows[k] for k in names]).to(self.device, non_blocking=True)
            self._index[names] = index
        vals = torch.stack([
            full_tensor(v).detach().reshape(()).to(self.device, self.dtype, non_blocking=True)
            if isinstance(v, torch.Tensor) else torch.full((), float(v), dtype=self.dtype, device=self.device)
            for v in metrics.values()])
        ok = vals.isfinite()
        self.acc.index_add_(0, index, torch.stack([torch.where(ok, vals, 0.0), ok.to(self.dtype)], dim=1))

    def _layout_tag(self) -> float:
        return float(zlib.crc32("\0".join(self.keys).encode()) % (1 << 20))

    def read(self, accelerator: Any, extra: torch.Tensor | None = None) -> tuple[dict[str, float], list[float]]:
        """``({key: window mean over micro-batches and ranks}, extra's values)`` and a new window.

        One all-reduce (sum) of ``[layout tag, sums and counts]`` and one host read (``extra``,
        e.g. the guard's counters, rides along). Every rank must call it. Ranks whose keys
        differ (a method that emits a key on some batches only) are merged by name instead.
        """
        world = accelerator.num_processes
        flat = torch.cat([torch.full((1,), self._layout_tag(), dtype=self.dtype, device=self.device),
                          self.acc.flatten()])
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        parts = [flat] if extra is None else [flat, extra.to(self.dtype)]
        host = torch.cat(parts).tolist()
        tag, sums, rest = host[0], host[1:1 + 2 * len(self.keys)], host[1 + 2 * len(self.keys):]
        if tag == world * self._layout_tag():
            totals = {k: (sums[2 * i], sums[2 * i + 1]) for i, k in enumerate(self.keys)}
        else:  # different keys on different ranks: gather each rank's sums by name
            from accelerate.utils import gather_object

            totals = {}
            for rank_sums in gather_object([self.local_sums()]):
                for k, (s, c) in rank_sums.items():
                    t = totals.get(k, (0.0, 0.0))
                    totals[k] = (t[0] + s, t[1] + c)
        self.acc.zero_()
        return {k: s / c for k, (s, c) in totals.items() if c > 0}, rest

    def local_sums(self) -> dict[str, tuple[float, float]]:
        """This rank's ``{key: (sum, count)}`` (a host read)."""
        values = self.acc.tolist()
        return {k: (values[i][0], values[i][1]) for i, k in enumerate(self.keys)}

    def restore(self, sums: dict[str, tuple[float, float]]) -> None:
        """Start from ``sums`` (:meth:`local_sums` of the same rank before a checkpoint)."""
        self._grow(sums)
        self.acc = torch.tensor([list(sums.get(k, (0.0, 0.0))) for k in self.keys], dtype=self.dtype).reshape(
            -1, 2).to(self.device)


def window_state(accelerator: Any, window: MetricWindow) -> dict[str, list[float]]:
    """Every rank's window sums for ``train_state.json``: ``{key: [sum_0, count_0, sum_1, count_1, ...]}``
    (rank order). Collective (every rank must call it)."""
    mine = window.local_sums()
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        ranks = gather_object([mine])
    else:
        ranks = [mine]
    keys = list(dict.fromkeys(k for r in ranks for k in r))
    return {k: [float(x) for r in ranks for x in r.get(k, (0.0, 0.0))] for k in keys}


def window_sums_of_rank(saved: dict[str, list[float]], window_format: int, rank: int, num_processes: int,
                        saved_processes: int) -> dict[str, tuple[float, float]]:
    """This rank's ``{key: (sum, count)}`` from a checkpoint's ``window``. Format 1 (older
    checkpoints): one list of per-micro-batch values per key, restored on rank 0. A checkpoint of
    another process count restores all ranks' sums on rank 0 (the logged means stay right; the data
    order differs anyway, see :func:`~draftsmith.train.checkpoint.check_launcher_layout`)."""
    if window_format < 2:
        return {k: (float(sum(v)), float(len(v))) for k, v in saved.items()} if rank == 0 else {}
    if saved_processes == num_processes:
        return {k: (v[2 * rank], v[2 * rank + 1]) for k, v in saved.items() if len(v) > 2 * rank + 1}
    if rank != 0:
        return {}
    return {k: (float(sum(v[0::2])), float(sum(v[1::2]))) for k, v in saved.items()}


def init_trackers(accelerator: Any, recipe: Recipe, run_dir: Path) -> None:
    """Start the trackers of ``train.report_to`` (accelerate's), logging under ``RUN_DIR/logs``."""
    cfg = recipe.train
    if not cfg.report_to:
        return
    logs = RunLayout(run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
    name = cfg.run_name or recipe.name
    accelerator.init_trackers(cfg.tracker_project, config=flat_config(recipe.model_dump(mode="json")),
                              init_kwargs={"wandb": {"name": name, "dir": str(logs)}})


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 1e-3, ...}``: nested recipe keys joined by dots, lists and None as strings
    (tensorboard's hparams take scalars only)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out


def best_metric(recipe: Recipe, method: Any) -> tuple[str, bool]:
    """``(metric key, higher is better)`` that checkpoints/best and early stopping follow:
    ``train.best_metric``, or the simulated acceptance length at the first of
    ``Recipe.validation_temperatures`` when the method simulates one, else ``val_loss``."""
    choice = recipe.train.best_metric
    simulates = bool(getattr(method, "validation_spec", None) and method.validation_spec().num_draft_tokens)
    if choice == "val_loss" or (choice is None and not simulates):
        return "val_loss", False
    t = recipe.validation_temperatures[0]
    return ("val_sim_al" if t == 0 else f"val_sim_al_t{t:g}"), True


class MetricsWriter:
    """The one writer of ``RUN_DIR/metrics.jsonl`` (a JSON line per logging step and per validation,
    main process only) and of the trackers of ``train.report_to`` (``accelerator.log``, every rank)."""

    def __init__(self, accelerator: Any, path: Path):
        self.accelerator, self.path = accelerator, path

    def truncate_after(self, step: int) -> None:
        """Drop the lines logged after ``step`` (a resumed run logs them again)."""
        if self.accelerator.is_main_process:
            dropped = truncate_metrics(self.path, step)
            if dropped:
                log.info("%s: dropped %d lines after step %d (logged again by this run)", self.path, dropped, step)

    def write(self, values: dict[str, Any], step: int) -> None:
        if self.accelerator.is_main_process:
            with self.path.open("a") as fh:
                fh.write(json.dumps(values) + "\n")
        self.accelerator.log(values, step=step)
