"""The training sampler: deterministic length-grouped batches, sharded across data-parallel ranks."""

from __future__ import annotations

import math

import torch


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Deterministic batches for one epoch: shuffle with ``seed + epoch``, sort by length
    inside windows of ``50 * global batch`` sequences (less padding), shuffle the batches.

    With ``num_replicas`` processes each global batch of ``batch_size * num_replicas``
    sequences is cut into contiguous per-rank slices, so P processes with batch b see exactly
    the global batches one process with batch P*b sees (the data-parallel equivalence).
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, num_replicas: int = 1, rank: int = 0):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        size = self.batch_size * self.num_replicas
        # every rank needs a non-empty slice: drop the ragged tail under data parallelism
        usable = len(order) if self.num_replicas == 1 else len(order) - len(order) % size
        order = order[:usable]
        window = 50 * size
        out = []
        for s in range(0, len(order), window):
            chunk = sorted(order[s : s + window], key=lambda i: self.lengths[i])
            out += [chunk[j : j + size] for j in range(0, len(chunk), size)]
        perm = torch.randperm(len(out), generator=g).tolist()
        return [out[i][self.rank * self.batch_size : (self.rank + 1) * self.batch_size] for i in perm]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        size = self.batch_size * self.num_replicas
        return math.ceil(len(self.lengths) / size) if self.num_replicas == 1 else len(self.lengths) // size
