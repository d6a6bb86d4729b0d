"""The reference decoder's DSpark proposer (``{"method": "dspark"}`` in vLLM 0.32): block
drafting plus the sequential Markov correction, as vLLM's DSpark speculator
(``v1/worker/gpu/spec_decode/dspark/speculator.py``) runs it, over an export loaded by
:mod:`draftsmith.models.dspark.format`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..models.dspark.format import load_dspark
from ..models.dspark.model import DSparkDraftModel
from .dflash import DFlashProposer
from .spec_decode import Proposal, check_aux_layers, to_target_vocab


class DSparkProposer(DFlashProposer):
    """DSpark drafting: the context is appended as DFlash's, ONE draft forward over the block
    ``[pending token, M * (k-1)]`` at positions ``P..P+k-1`` gives k base logit rows (row i
    drafting the token at ``P+i+1``), then left to right ``logits_i = base_i + markov_w2 @
    markov_w1[y_{i-1}]`` with ``y_{-1}`` the pending token and ``y_{i-1}`` the token chosen at
    row i-1 (mapped to its target id): the argmax at T=0, a sample at T>0 (vLLM's
    ``_sample_sequential``)."""

    def __init__(self, model: DSparkDraftModel):
        super().__init__(model)
        self.max_k = model.config.block_size

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """See :meth:`Proposer.propose`.

        Raises:
            ValueError: ``k`` > ``block_size`` (names the trained block size).
        """
        m = self.model
        if k > self.max_k:
            raise ValueError(f"k={k}: this DSpark draft was trained with block_size={m.config.block_size} and "
                             f"proposes at most {self.max_k} tokens per block")
        device, dtype = m.fc.weight.device, m.fc.weight.dtype
        start, n = len(self.cache), states.shape[0]
        m.append_context(self.cache, states.to(device, dtype), torch.arange(start, start + n, device=device))
        pending = int(next_tokens[-1])
        hidden = m.propose_hidden(self.cache, pending, start + n, k)  # (k, H)

        def logits_fn(i: int, prev: int | None) -> torch.Tensor:
            prev_target = pending if prev is None else prev + int(m.d2t[prev])  # draft id -> target id
            e = m.markov_embed(torch.tensor(prev_target, device=device))
            return m.markov_logits(hidden[i], e).float()

        return to_target_vocab(self._chain(logits_fn, k, temperature, generator), m.d2t, m.config.vocab_size)


def dspark_proposer(path: Path, target_model: Any | None = None) -> DSparkProposer:
    """The proposer of a DSpark export, sharing ``target_model``'s input embedding.

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.dspark.format.load_dspark`; aux layer ids out of range.
    """
    embed = target_model.get_input_embeddings().weight.detach() if target_model is not None else None
    model = load_dspark(path, embed)
    if target_model is not None:
        check_aux_layers(path, model.config.aux_layer_ids, target_model, lowest=1)
    return DSparkProposer(model)
