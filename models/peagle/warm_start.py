"""P-EAGLE's warm start (``draft.init_from``): fine-tune an existing P-EAGLE draft (a draftsmith
export or training checkpoint, or a speculators library ``peagle`` checkpoint) instead of
starting from scratch.

It is EAGLE-3's (:mod:`draftsmith.models.eagle3.warm_start`): the same reading and refusals, the
same fit rules against this run, the same copy of every tensor under its own name with the
``lm_head`` rows carried over by target token id. What P-EAGLE adds:

- ``mask_hidden``: ``[1, 1, 3 * Ht]`` in an export, ``[3 * Ht]`` in the model (reshaped on read);
- the embedding: a draft that trained its own (``train_embeddings``, the speculators library's
  ``embed_requires_grad``; its ``embed_tokens.weight``) starts the run's trained embedding, and
  the run trains it too; any other draft's embedding is the target's, which the run installs;
- the draft keeps its layer count, ``norm_before_residual`` and attention window; the run sets
  ``num_depths`` and the draft vocab, and its mask token is the draft's unless
  ``draft.mask_token_id`` says otherwise (the training method resolves it against the data).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..eagle3.warm_start import InitDraft, read_init_draft
from ..eagle3.warm_start import load_init_weights as load_eagle3_weights
from .config import PEagleConfig
from .format import peagle_config

log = logging.getLogger("draftsmith.train")


def read_init_peagle(path: str | Path) -> InitDraft:
    """Read ``draft.init_from`` as a P-EAGLE draft: tensors under the model's names
    (``mask_hidden`` flat, a trained embedding as ``embed_tokens``; an untrained one dropped).

    Raises:
        WarmStartError: as :func:`~draftsmith.models.eagle3.warm_start.read_init_draft`.
    """
    init = read_init_draft(path, "peagle", peagle_config)
    tensors = init.tensors
    if "mask_hidden" in tensors:
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(-1)
    embed = tensors.pop("embed_tokens.weight", None)  # the export's name (a checkpoint's: embed_tokens)
    if embed is not None:
        tensors["embed_tokens"] = embed
    if not init.config.train_embeddings:
        tensors.pop("embed_tokens", None)  # the target's embedding (speculators ships a copy of it)
    return init


def warm_config(init: InitDraft, run_config: PEagleConfig) -> PEagleConfig:
    """The config to train: the init draft's geometry, layer count, residual norm, attention
    window and trained embedding; this run's draft vocab size, ``num_depths`` and mask token. A
    recipe that says otherwise about what the draft keeps is warned about, naming the key."""
    for key in ("norm_before_residual", "num_layers", "sliding_window"):
        if getattr(init.config, key) != getattr(run_config, key):
            log.warning("draft.init_from: %s=%s as the draft was trained (the recipe says %s)",
                        key, getattr(init.config, key), getattr(run_config, key))
    if init.config.mask_token_id != run_config.mask_token_id:
        log.warning("draft.init_from: mask_token_id=%d (draft.mask_token_id), but the draft's mask slots were "
                    "trained as token %d", run_config.mask_token_id, init.config.mask_token_id)
    if init.config.train_embeddings and not run_config.train_embeddings:
        log.warning("draft.init_from: train_embeddings=True as the draft was trained (the recipe says False)")
    return dataclasses.replace(init.config, draft_vocab_size=run_config.draft_vocab_size,
                               num_depths=run_config.num_depths, mask_token_id=run_config.mask_token_id,
                               train_embeddings=init.config.train_embeddings or run_config.train_embeddings,
                               extra=dict(run_config.extra))


@torch.no_grad()
def load_init_weights(model: torch.nn.Module, init: InitDraft) -> dict[str, int]:
    """Copy ``init``'s weights into ``model`` (built with :func:`warm_config`, target embedding and
    vocab mapping installed): EAGLE-3's copy, the trained embedding kept as the target's when the
    draft had none.

    Returns / Raises:
        as :func:`~draftsmith.models.eagle3.warm_start.load_init_weights`.
    """
    return load_eagle3_weights(model, init, keep=("embed_tokens",))
