"""Simulated acceptance length of an EAGLE-3 draft on prepared data, without vLLM.

    draftsmith simulate --draft DRAFT --data RUN_DIR/data [--k 3] [--temperatures 0,0.7 | --recipe RECIPE] [--out sim.json]

``DRAFT`` is an export folder (speculators format, ours or a published draft) or a draftsmith
checkpoint (``checkpoints/step-N``, ``checkpoints/best``); ``RUN_DIR/data`` a prepared data
folder (hidden-state shards, ``draftsmith prepare``) of the same target at the draft's aux layer
ids. Every sequence of the data is evaluated exactly as training validates
(:mod:`draftsmith.train.validation`): the TTT forward over the target's hidden states, and the
chain rule of vLLM's rejection sampler against the target's full-vocab distribution (T=0: argmax
agreement; T>0: expected acceptance, greedy drafts as vLLM's EAGLE proposer makes them).

Prepared from the prompts an acceptance run uses, with the target's greedy replies of the same
length (``data.regenerate.max_new_tokens``), the data holds the very tokens vLLM generates at
T=0, so the simulation and vLLM's measured acceptance length see the same text: issue 17's
check of the simulation (docs/results.md).
"""

from __future__ import annotations

from typing import Any, Callable


def simulator() -> Callable[..., dict[str, Any]]:
    """The ``simulator`` part (:mod:`draftsmith.methods`) of the recipe's default draft method
    (:data:`draftsmith.recipe.DEFAULT_METHOD`), the drafts ``draftsmith simulate`` reads:
    ``simulate(draft, data_dir, k=3, temperatures=(0.0,), batch_size=8, draft_sampling="greedy")
    -> metrics``; it raises the warm start's ``WarmStartError`` for the draft and
    FileNotFoundError / ShardError for the data."""
    from ..methods import get_method
    from ..recipe import DEFAULT_METHOD

    return get_method(DEFAULT_METHOD).simulator
