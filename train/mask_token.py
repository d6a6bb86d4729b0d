"""The mask token of parallel drafters (DFlash's block slots, P-EAGLE's depths > 0).

vLLM embeds the mask slots with the (shared) target embedding row of ``mask_token_id``, so the
id must never occur as a real token: a draft that learned "mask" from a row that is also a
real token in the data confuses the two. Targets without a spare embedding row (SmolLM2:
``len(tokenizer) == vocab_size``) need an id the data never uses; the anchors' fallback to
pad / eos would pick ``<|im_end|>`` there, which ends every assistant turn.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("draftsmith.train.mask_token")


class MaskTokenError(ValueError):
    """The mask token id occurs in the data, is out of range, or none is free."""


def token_counts(dataset: Any, vocab_size: int, batch_rows: int = 4096) -> np.ndarray:
    """How often each token id occurs in the ``input_ids`` of ``dataset`` (the tokenised Arrow
    dataset, read in batches of ``batch_rows`` rows; every token, not only the assistant's).

    Returns:
        ``(vocab_size,)`` int64 counts.

    Raises:
        MaskTokenError: a token id outside ``[0, vocab_size)``.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    ids = dataset.select_columns(["input_ids"]).with_format("numpy")
    for start in range(0, len(ids), batch_rows):
        rows = ids[start : start + batch_rows]["input_ids"]
        flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if len(rows) else np.zeros(0, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
            bad = int(flat[(flat < 0) | (flat >= vocab_size)][0])
            raise MaskTokenError(f"token id {bad} in the tokenised data is outside the target vocab of {vocab_size}")
        counts += np.bincount(flat, minlength=vocab_size)
    return counts


def template_token_ids(tokenizer: Any) -> set[int]:
    """Ids the chat template itself writes (rendering a two-turn conversation), plus the
    tokenizer's bos / eos / pad / unk ids."""
    ids = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                       tokenizer.unk_token_id) if i is not None}
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        ids.update(int(i) for i in tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
                   if isinstance(i, int))
    return ids


def resolve_mask_token_id(requested: int | None, counts: np.ndarray, tokenizer: Any = None, where: str = "data") -> int:
    """The mask token id to train with, checked against the data.

    Args:
        requested: ``draft.mask_token_id``; None picks one: the tokenizer's ``mask_token_id``
            when it never occurs, else the lowest id >= 1 that never occurs in the data and is
            not an id the chat template writes (id 0 is avoided: vLLM pads rejected P-EAGLE
            slots with it). For SmolLM2 that is 3 (``<repo_name>``).
        counts: :func:`token_counts` of the tokenised data.
        tokenizer: the target's tokenizer (for the automatic choice).
        where: what ``counts`` were taken from, for messages (e.g. the dataset path).

    Raises:
        MaskTokenError: ``requested`` out of range or occurring in the data (the message gives
            the count and a free id); no free id at all.
    """
    V = int(counts.shape[0])
    if requested is not None:
        if not 0 <= requested < V:
            raise MaskTokenError(f"draft.mask_token_id={requested} is outside the target vocab of {V}")
        if counts[requested]:
            free = np.flatnonzero(counts[1:] == 0)
            hint = f"; an id the data never uses: {int(free[0]) + 1}" if free.size else ""
            raise MaskTokenError(f"draft.mask_token_id={requested} occurs {int(counts[requested])} times in {where}: "
                                 f"the mask slots would be embedded as a real token{hint}")
        return int(requested)
    mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mask is not None and 0 <= mask < V and counts[mask] == 0:
        log.info("mask token: the tokenizer's mask token %d", mask)
        return int(mask)
    taken = template_token_ids(tokenizer) if tokenizer is not None else set()
    for i in range(1, V):
        if counts[i] == 0 and i not in taken:
            log.info("mask token: id %d (never in %s, not written by the chat template)", i, where)
            return i
    raise MaskTokenError(f"every token id of the target vocab ({V}) occurs in {where}: no free mask token id; "
                         "set draft.mask_token_id to a rarely used id and drop the rows that use it")
