"""``data.select``: train on the top fraction of the training sequences by a score of the target's
distributions (SFDD, Fan et al., arXiv:2601.18902; the scores: :mod:`draftsmith.data_prep.scores`).

The validation conversations (``data.validation_fraction``) are split off first, by conversation
as always, so the validation set is the same with and without selection; the selection then keeps
``round(keep_fraction * N)`` of the N training sequences with the highest score (ties: the
earlier sequence), in their shard order. It depends on the scores and the split alone, so it is
the same on every rank and every resume. Off (``data.select: null``, the default) nothing here
runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..data_prep.scores import read_scores, select_top, vocab_key
from ..layout import DataPaths, read_vocab

log = logging.getLogger("draftsmith.train")


class DataSelectionError(ValueError):
    """``data.select`` cannot be applied: no shards, or no score for every sequence."""


def score_command(paths: DataPaths) -> str:
    """The command that computes the scores of an already prepared run's shards."""
    return f"python -m draftsmith.cli.hidden_states score {paths.root.parent}"


def sequence_scores(paths: DataPaths, score: str, num_sequences: int) -> list[float | None]:
    """``score`` of every sequence of the run's shards, in shard order.

    Raises:
        DataSelectionError: one line naming the key and the directory: the shards hold no such
            score for the run's draft vocab (prepared before scores were captured: the message
            gives :func:`score_command`), or another number of sequences than ``num_sequences``.
    """
    try:
        d2t, _ = read_vocab(paths)
    except FileNotFoundError as exc:
        raise DataSelectionError(f"data.select: {exc}") from None
    scores = read_scores(paths.hidden_states, vocab_key(d2t))
    if scores is None:
        raise DataSelectionError(
            f"data.select.score={score}: {paths.hidden_states} has no scores for every shard under the run's draft "
            f"vocab (prepared before capture wrote them, or the vocab changed since); compute them with: "
            f"{score_command(paths)}")
    if len(scores[score]) != num_sequences:
        raise DataSelectionError(f"data.select.score={score}: {paths.hidden_states} scores "
                                 f"{len(scores[score])} sequences, the training data has {num_sequences}")
    return scores[score]


def select_training(dataset: Any, train_idx: list[int] | None, select: Any, paths: DataPaths) -> list[int]:
    """The training sequences ``data.select`` keeps of ``train_idx`` (None: every sequence of
    ``dataset``), ascending, with one log line of what it keeps.

    Args:
        dataset: the method's training dataset; it must be the hidden-state shards (it has a
            ``manifest``): the scores are the shards'.
        select: the recipe's ``data.select`` (``score``, ``keep_fraction``).

    Raises:
        DataSelectionError: online data (no shards), or no scores (:func:`sequence_scores`).
    """
    if not hasattr(dataset, "manifest"):
        raise DataSelectionError("data.select needs the hidden-state shards (data.hidden_states_mode: offline): "
                                 "its scores are written at capture")
    indices = list(range(len(dataset))) if train_idx is None else list(train_idx)
    kept = select_top(indices, sequence_scores(paths, select.score, len(dataset)), select.keep_fraction)
    log.info(selection_line(select, dataset.lengths(), indices, kept))
    return kept


def selection_line(select: Any, lengths: list[int], indices: list[int], kept: list[int]) -> str:
    """``data.select: keeps K of N training sequences (k of n tokens) by <score>``."""
    tok_all, tok_kept = sum(lengths[i] for i in indices), sum(lengths[i] for i in kept)
    return (f"data.select: keeps {len(kept)} of {len(indices)} training sequences ({tok_kept} of {tok_all} tokens, "
            f"{tok_kept / max(1, tok_all):.1%}) by {select.score}, keep_fraction={select.keep_fraction:g}")


def dry_run_line(recipe: Any, run_dir: Path | None) -> str | None:
    """What ``train --dry-run`` prints of ``data.select``: None when off; without a run directory
    what it would keep; with one, the counts of its shards (the validation split applied as
    the trainer applies it), or the one-line reason it cannot."""
    from ..data_prep.shards import ShardReader
    from ..fileio import ShardError
    from ..layout import RunLayout
    from .validation import ValidationSplitError, dataset_ids, split_by_conversation

    select = recipe.data.select
    if select is None:
        return None
    if run_dir is None:
        return (f"data.select: keeps {select.keep_fraction:g} of the training sequences by {select.score} "
                f"(pass --run-dir to count them)")
    paths = RunLayout(Path(run_dir)).data
    try:
        reader = ShardReader(paths.hidden_states, max_length=recipe.data.max_length)
        train_idx = list(range(len(reader)))
        if recipe.data.validation_fraction:
            train_idx, _ = split_by_conversation(dataset_ids(reader), recipe.data.validation_fraction, recipe.seed,
                                                 where=str(paths.root))
        kept = select_top(train_idx, sequence_scores(paths, select.score, len(reader)), select.keep_fraction)
    except (ShardError, DataSelectionError, ValidationSplitError) as exc:
        return f"data.select: {exc}" if not str(exc).startswith("data.select") else str(exc)
    return selection_line(select, reader.lengths(), train_idx, kept)
