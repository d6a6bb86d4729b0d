"""Sequence packing: several training sequences in one row, never attending to each other.

Short conversations padded to the longest in a batch waste most of a micro-batch; packing
concatenates them into rows of up to ``train.pack_tokens`` tokens. The row carries
``position_ids`` that restart at 0 for every document (RoPE sees each document as if it
were alone) and ``document_ids`` (0, 1, ... within the row, -1 on padding); the draft
restricts attention and predictions to a document with them (see
:func:`draftsmith.models.eagle3.model.ttt_attention_mask` and ``ttt_prediction_mask``), so a
packed row trains exactly what its documents train unpacked.

Packing is greedy first-fit over the sequences in decreasing length (ties in a seeded
order), done once per run: packs are then the units the usual
:class:`~draftsmith.train.sampler.LengthGroupedBatches` sampler shuffles and splits across
processes, so every rank sees whole packs and the data-parallel equivalence holds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .data import collate


def first_fit_packs(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Greedy first-fit decreasing: each sequence, longest first, goes into the first pack
    (in creation order) with room left.

    Args:
        lengths: tokens per sequence.
        capacity: tokens per pack (``train.pack_tokens``).
        seed: orders sequences of equal length, so the packing is deterministic given it.

    Returns:
        Packs as lists of sequence indices (each index exactly once), in creation order;
        within a pack, indices in insertion order.

    Raises:
        ValueError: a sequence longer than ``capacity`` (it would need a pack of its own
            that does not fit) or a non-positive capacity.
    """
    if capacity < 1:
        raise ValueError(f"pack capacity must be >= 1 token, got {capacity}")
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than train.pack_tokens={capacity}")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    order.sort(key=lambda i: -lengths[i])  # stable: equal lengths keep the seeded order
    # Max segment tree over the remaining room of packs 0..n-1 (unopened packs have full
    # room), so "first pack with room >= n" is one O(log n) descent instead of a scan.
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = [capacity] * (2 * size)
    packs: list[list[int]] = []
    for i in order:
        need, node = lengths[i], 1
        while node < size:
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        p = node - size
        if p == len(packs):
            packs.append([])
        packs[p].append(i)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return packs


class PackedDataset(torch.utils.data.Dataset):
    """Rows of packed sequences over a map-style dataset with ``lengths()``.

    Item i is the list of the dataset items of pack i (collate with :func:`collate_packed`);
    ``lengths()`` gives tokens per row.
    """

    def __init__(self, dataset: Any, pack_tokens: int, seed: int):
        self.dataset = dataset
        self.sequence_lengths = dataset.lengths()
        self.packs = first_fit_packs(self.sequence_lengths, pack_tokens, seed)

    def __len__(self) -> int:
        return len(self.packs)

    def lengths(self) -> list[int]:
        return [sum(self.sequence_lengths[i] for i in pack) for pack in self.packs]

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        return [self.dataset[j] for j in self.packs[i]]


def collate_packed(rows: list[list[dict[str, torch.Tensor]]],
                   pad_to: Callable[[int], int] | None = None) -> dict[str, torch.Tensor]:
    """Concatenate each row's documents and right-pad the rows (:func:`collate`, ``pad_to`` as there).

    Returns:
        The keys of the items as ``(B, T, ...)`` tensors, ``attention_mask (B, T)``, and
        ``position_ids (B, T)`` long (0.. per document, 0 on padding) and ``document_ids
        (B, T)`` long (index of the document in its row, -1 on padding).
    """
    joined = []
    for docs in rows:
        row = {key: torch.cat([d[key] for d in docs]) for key in docs[0]}
        row["position_ids"] = torch.cat([torch.arange(d["input_ids"].shape[0]) for d in docs])
        row["document_ids"] = torch.cat([torch.full((d["input_ids"].shape[0],), j, dtype=torch.long)
                                         for j, d in enumerate(docs)])
        joined.append(row)
    out = collate(joined, pad_to)
    out["document_ids"] = out["document_ids"].masked_fill(out["attention_mask"] == 0, -1)
    return out


LENGTH_BUCKETS = 4  # row lengths an unpacked run pads to under flex: max_length * i / 4, i = 1..4
BUCKET_MULTIPLE = 128  # flex_attention's default tile: a bucket is a whole number of tiles


def length_bucket(n: int, max_length: int, packing: bool) -> int:
    """The row length a batch whose longest row has ``n`` tokens is padded to under the flex
    backend, so the compiled ``flex_attention`` sees a few static shapes instead of one per batch
    (each new shape is a compilation): packed rows are padded to ``max_length`` (``train.pack_tokens``;
    first-fit fills them to within a few tokens of it), unpacked ones to the smallest of
    ``LENGTH_BUCKETS`` lengths ``ceil(max_length * i / LENGTH_BUCKETS)`` (rounded up to a multiple of
    :data:`BUCKET_MULTIPLE`) that holds them (:func:`~draftsmith.train.data.collate`'s ``pad_to``).
    The padding is masked everywhere (``attention_mask`` 0, ``loss_mask`` 0, ``document_ids`` -1), so
    the loss and gradients are those of the unpadded batch.

    Raises:
        ValueError: ``n`` above ``max_length``.
    """
    if n > max_length:
        raise ValueError(f"a row of {n} tokens exceeds the longest row length {max_length}")
    round_up = lambda x: -(-x // BUCKET_MULTIPLE) * BUCKET_MULTIPLE  # noqa: E731
    if packing:
        return round_up(max_length)
    for i in range(1, LENGTH_BUCKETS + 1):
        bucket = round_up(-(-max_length * i // LENGTH_BUCKETS))
        if bucket >= n:
            return bucket
    return round_up(max_length)

