"""Draft vocabulary: the Vd most frequent target tokens among assistant tokens.

Mapping tensors follow the EAGLE-3 / speculators / vLLM convention:

- ``d2t`` int64 ``[Vd]``: an *offset*, ``target_id = draft_id + d2t[draft_id]``.
- ``t2d`` bool ``[V]``: True for target ids present in the draft vocab.

Draft ids are assigned in ascending target-id order, so ``d2t`` is non-decreasing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import torch


def count_assistant_tokens(records: Iterable[dict] | Any, batch_size: int = 4096) -> Counter:
    """Token counts over positions with ``loss_mask == 1``.

    ``records``: a tokenised ``datasets.Dataset`` (:func:`draftsmith.layout.read_tokenized`),
    counted in Arrow batches of ``batch_size`` rows with ``numpy.bincount`` (memory: one batch
    and a ``[max id + 1]`` count array), or any iterable of ``{"input_ids", "loss_mask"}`` dicts.
    """
    if hasattr(records, "column_names") and hasattr(records, "with_format"):
        import numpy as np

        totals = np.zeros(0, dtype=np.int64)
        for batch in records.with_format("arrow").iter(batch_size=batch_size):
            ids = batch.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
            mask = batch.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
            picked = ids[mask.astype(bool)].astype(np.int64)
            if picked.size == 0:
                continue
            if picked.min() < 0:
                bad = int(picked[picked < 0][0])
                return Counter({bad: 1})  # reported as out of vocab by build_draft_vocab
            binc = np.bincount(picked)
            if binc.size > totals.size:
                totals = np.pad(totals, (0, binc.size - totals.size))
            totals[: binc.size] += binc
        nz = np.flatnonzero(totals)
        return Counter(dict(zip(nz.tolist(), totals[nz].tolist())))
    counts: Counter = Counter()
    for r in records:
        counts.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return counts


def build_draft_vocab(counts: Counter, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``draft_vocab_size`` most frequent ids (ties: lower id first); when fewer
    distinct ids were seen, fill with the lowest unseen ids so the draft head has exactly Vd
    rows.

    Returns:
        ``(d2t int64 [Vd], t2d bool [V])``.

    Raises:
        ValueError: ``draft_vocab_size`` outside ``[1, vocab_size]`` or a counted id outside
            ``[0, vocab_size)`` (a tokenizer / target vocab mismatch).
    """
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, target vocab_size={vocab_size}]")
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"token ids {sorted(bad)[:5]} are outside the target vocab of {vocab_size}: "
            "the data was tokenised with a different tokenizer"
        )
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:draft_vocab_size]]
    if len(chosen) < draft_vocab_size:
        taken = set(chosen)
        filler = (t for t in range(vocab_size) if t not in taken)
        chosen += [next(filler) for _ in range(draft_vocab_size - len(chosen))]
    target_ids = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """``[Vd]`` target ids of the draft vocab."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def target_to_draft_ids(t2d: torch.Tensor) -> torch.Tensor:
    """``[V]`` draft id of each target id, -1 where absent."""
    out = torch.full(t2d.shape, -1, dtype=torch.long, device=t2d.device)
    out[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return out


def coverage(counts: Counter, t2d: torch.Tensor) -> float:
    """Fraction of counted assistant tokens that fall inside the draft vocab."""
    total = sum(counts.values())
    inside = sum(c for t, c in counts.items() if bool(t2d[t]))
    return inside / total if total else 0.0
