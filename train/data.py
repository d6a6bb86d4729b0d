"""Training datasets and batching: offline shards (hidden states on disk) or token ids only
(online: the target computes hidden states on the fly), right-padding ``collate``, the
DataLoader's :class:`BatchCollator` (token count and the method's batch plan, on the CPU) and
:func:`to_device`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..data_prep.shards import ShardReader
from ..data_prep.state_codec import decode_states
from ..fileio import ShardError
from ..layout import DataPaths, read_tokenized

SEQUENCE_KEY = "sequence_index"  # SourceTagged: which sequence of the shards each token came from


class HiddenStateDataset(ShardReader, torch.utils.data.Dataset):
    """Map-style dataset over a shard directory (:class:`draftsmith.data_prep.shards.ShardReader`);
    item i is one sequence:

    ``{"input_ids" (T,) long, "loss_mask" (T,) long, "aux_hidden_states" (T, 3H),
    "final_hidden_states" (T, H)}``: plain shards in their storage dtype, fp8 shards decoded
    to ``decode_dtype``, or (``decode_dtype=None``, what training uses) handed out as the fp8
    payload plus ``*_hidden_states_scale`` and decoded on the device by :func:`to_device`.

    Raises:
        ShardError: missing manifest or shard, incomplete shard set, or (``verify=True``)
            a checksum / shape / dtype that disagrees with the manifest; a damaged shard's message
            ends with the command that recomputes it (:func:`recompute_hint`).
    """

    def __init__(self, directory: Path | str, *args: Any, **kwargs: Any):
        try:
            super().__init__(directory, *args, **kwargs)
        except ShardError as exc:
            if "rerun" in str(exc) or "run the hidden-states stage" in str(exc):
                raise
            raise ShardError(f"{exc}; {recompute_hint(directory)}") from None


def recompute_hint(directory: Path | str, verify: bool = False) -> str:
    """How to recompute a damaged shard of ``directory`` (a run's ``data/hidden_states``):
    ``draftsmith prepare`` checks the shards it keeps and recomputes a damaged one (with
    ``verify``: ``--verify-shards``, which also hashes them, for damage that keeps the size)."""
    directory = Path(directory)
    run_dir = directory.parent.parent if directory.name == "hidden_states" and directory.parent.name == "data" \
        else "RUN_DIR"
    return (f"recompute it with: draftsmith prepare RECIPE --run-dir {run_dir}" + (" --verify-shards" if verify else "")
            + " (prepare checks the shards it keeps and recomputes a damaged one)")


class SourceTagged(torch.utils.data.Dataset):
    """``dataset`` (the shards, or a subset of them) whose items carry ``sequence_index (T,)``
    long: the index, among the sequences of the whole shard set, of the sequence every token
    came from (``indices[i]`` for item i; without ``indices``: i). It collates and packs like the
    other keys; the trainer takes it out of the batch on the device and counts non-finite hidden
    states per shard with it (``components.nonfinite.NonFiniteShards``), without a host read."""

    def __init__(self, dataset: Any, indices: list[int] | None = None):
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return self.dataset.lengths()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = dict(self.dataset[i])
        index = i if self.indices is None else self.indices[i]
        item[SEQUENCE_KEY] = torch.full((item["input_ids"].shape[0],), int(index), dtype=torch.long)
        return item


class TokenizedDataset(torch.utils.data.Dataset):
    """Token ids and loss masks only (the tokenised Arrow dataset, ``RUN_DIR/data/tokenized/``),
    for online training where the target computes hidden states on the fly. Items:
    ``{"input_ids" (T,), "loss_mask" (T,)}``, in the same order and with the same lengths as the
    shards built from the same data.

    The dataset is memory-mapped (:func:`draftsmith.layout.read_tokenized`): rows are read by
    index when asked for and lengths come from the ``length`` column, so no process holds the
    corpus in memory.

    Args:
        source: the ``tokenized/`` directory, a :class:`~draftsmith.layout.DataPaths`, or an
            opened ``datasets.Dataset``.
    """

    def __init__(self, source: Any, max_length: int | None = None):
        if isinstance(source, DataPaths):
            ds = read_tokenized(source)
        elif isinstance(source, (str, Path)):
            path = Path(source)
            paths = DataPaths(path.parent)
            if path == paths.tokenized:
                ds = read_tokenized(paths)
            elif (path / "state.json").is_file():
                import datasets

                ds = datasets.load_from_disk(str(path))
            else:
                raise FileNotFoundError(f"{path} missing: run the tokenize stage first")
        else:
            ds = source
        self.path = Path(source) if isinstance(source, (str, Path)) else None
        self._source = ds
        self.data = ds.with_format("numpy", columns=["input_ids", "loss_mask"])
        self.max_length = max_length
        self._lengths = ds.select_columns(["length"]).with_format("numpy")[:]["length"]

    def __len__(self) -> int:
        return len(self.data)

    def record_ids(self) -> list[str]:
        """The ``id`` of every row (the conversation it came from; see train/validation.py)."""
        return [str(i) for i in self._source.select_columns(["id"])["id"]]

    def lengths(self) -> list[int]:
        lengths = self._lengths if not self.max_length else np.minimum(self._lengths, self.max_length)
        return lengths.tolist()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.data[int(i)]
        ids, mask = row["input_ids"], row["loss_mask"]
        if self.max_length:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        return {"input_ids": torch.from_numpy(ids.astype(np.int64)), "loss_mask": torch.from_numpy(mask.astype(np.int64))}


def collate(batch: list[dict[str, torch.Tensor]],
            pad_to: Callable[[int], int] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences into ``(B, T, ...)`` tensors (padding has loss_mask 0) and
    add ``attention_mask (B, T)``: 1 on real tokens. T is the longest sequence, or with ``pad_to``
    ``pad_to(longest)`` (the flex backend's length buckets,
    :func:`~draftsmith.train.packing.length_bucket`)."""
    T = max(x["input_ids"].shape[0] for x in batch)
    if pad_to is not None:
        T = pad_to(T)
    out = {}
    for key in batch[0]:
        ref = batch[0][key]
        t = ref.new_zeros((len(batch), T, *ref.shape[1:]))
        for b, x in enumerate(batch):
            t[b, : x[key].shape[0]] = x[key]
        out[key] = t
    lengths = torch.tensor([x["input_ids"].shape[0] for x in batch])
    out["attention_mask"] = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (B, T)
    return out


class BatchCollator:
    """The DataLoader's ``collate_fn``: ``base`` (:func:`collate` or
    :func:`~draftsmith.train.packing.collate_packed`), then ``num_tokens`` (a python int, the
    sum of ``attention_mask``) and what the method's batch plan adds.

    It runs on the CPU batch, in the DataLoader workers when ``train.num_workers > 0``, so
    whatever the plan computes (index tensors, sizes, python values) costs the training step
    no host sync. Picklable when ``base`` and ``plan`` are (module-level functions, or
    instances of module-level classes).

    Args:
        base: list of items -> batch of ``(B, T, ...)`` tensors with ``attention_mask``.
        plan: ``method.batch_plan()``: ``plan(batch) -> dict`` of CPU tensors and python values
            merged into the batch; None: nothing added.
        loss_on_all: ``train.loss_on: all``: ``loss_mask`` becomes ``attention_mask`` (every real
            token is trained, not only the assistant's) before the plan reads it.
    """

    def __init__(self, base: Callable[[list], dict[str, torch.Tensor]],
                 plan: Callable[[dict[str, Any]], dict[str, Any]] | None = None, loss_on_all: bool = False):
        self.base, self.plan, self.loss_on_all = base, plan, loss_on_all

    def __call__(self, items: list) -> dict[str, Any]:
        batch: dict[str, Any] = self.base(items)
        if self.loss_on_all:
            batch["loss_mask"] = batch["attention_mask"].to(batch["loss_mask"].dtype)
        batch["num_tokens"] = int(batch["attention_mask"].sum())
        if self.plan is not None:
            batch.update(self.plan(batch))
        return batch


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on ``device`` (``non_blocking``: asynchronous from the pinned memory of
    a CUDA DataLoader); python values (``num_tokens``, a plan's sizes) stay as they are. fp8 hidden
    states (handed out undecoded, with their scales) are decoded there, after the copy
    (:func:`~draftsmith.data_prep.state_codec.decode_states`): the copy moves 1 byte per value, not 4."""
    moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return decode_states(moved, torch.float32)
