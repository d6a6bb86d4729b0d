"""Training datasets and batching: offline shards (hidden states on disk) or token ids only
(online: the target computes hidden states on the fly), and right-padding ``collate``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..data_prep.shards import ShardReader


class HiddenStateDataset(ShardReader, torch.utils.data.Dataset):
    """Map-style dataset over a shard directory (:class:`draftsmith.data_prep.shards.ShardReader`);
    item i is one sequence:

    ``{"input_ids" (T,) long, "loss_mask" (T,) long, "aux_hidden_states" (T, 3H),
    "final_hidden_states" (T, H)}``: plain shards in their storage dtype, fp8 shards decoded
    to ``decode_dtype``.

    Raises:
        ShardError: missing manifest or shard, incomplete shard set, or (``verify=True``)
            a checksum / shape / dtype that disagrees with the manifest.
    """


class TokenizedDataset(torch.utils.data.Dataset):
    """Token ids and loss masks only (``tokenized.jsonl``), for online training where the
    target computes hidden states on the fly. Items: ``{"input_ids" (T,), "loss_mask" (T,)}``,
    in the same order and with the same lengths as the shards built from the same file."""

    def __init__(self, path: Path | str, max_length: int | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} missing: run the tokenize stage first")
        with self.path.open(encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh]
        self.rows = [(r["input_ids"][:max_length], r["loss_mask"][:max_length]) if max_length else
                     (r["input_ids"], r["loss_mask"]) for r in rows]

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.rows]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.rows[i]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences into ``(B, T, ...)`` tensors (padding has loss_mask 0) and
    add ``attention_mask (B, T)``: 1 on real tokens."""
    T = max(x["input_ids"].shape[0] for x in batch)
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
