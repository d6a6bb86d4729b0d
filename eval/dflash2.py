"""The reference decoder's DFlash2 proposer (vLLM 0.32 ``{"method": "dflash"}`` with a
``DFlash2DraftModel``): DFlash's block forward, then vLLM's candidate walk
(``v1/worker/gpu/spec_decode/dflash2/speculator.py``) over an export loaded by
:mod:`draftsmith.models.dflash2.format`."""

from __future__ import annotations

from functools import partial

import torch

from ..models.dflash2.format import load_dflash2
from .dflash import DFlashProposer, dflash_proposer
from .spec_decode import Proposal


class DFlash2Proposer(DFlashProposer):
    """DFlash2 drafting as vLLM's ``DFlash2Speculator`` runs it: ONE draft forward over
    ``[pending token, M * k]`` (:class:`DFlashProposer`), the ``lm_head``'s top-K candidates of
    each slot, their pairwise scores ``S_l(p, c)`` (the candidate selector), then a walk: slot 1
    scores its candidates after the pending token, slot l after the candidate chosen for slot
    l-1; at T=0 the highest score, at T>0 a sample of ``softmax(S / T)`` over the K candidates
    (vLLM's Gumbel-max draw). The proposal's ``q`` is that distribution, 0 outside the candidates."""

    def draft(self, bonus_token: int, position: int, k: int, temperature: float,
              generator: torch.Generator | None) -> Proposal:
        ids, scores = self.model.propose_scores(self.cache, bonus_token, position, k)  # (k, K), (k, K, K)
        vocab = self.model.config.vocab_size

        def slot_logits(i: int, prev: int | None) -> torch.Tensor:
            row = 0 if prev is None else int((ids[i - 1] == prev).nonzero()[0, 0])  # slot 0: every row alike
            logits = torch.full((vocab,), float("-inf"), device=scores.device)
            return logits.index_copy_(0, ids[i], scores[i, row])

        return self._chain(slot_logits, k, temperature, generator)


dflash2_proposer = partial(dflash_proposer, load=load_dflash2, proposer_class=DFlash2Proposer)
dflash2_proposer.__doc__ = """The proposer of a DFlash2 export, sharing ``target_model``'s input embedding.

Raises:
    DraftLoadError: see :func:`~draftsmith.models.dflash2.format.load_dflash2`; aux layer ids out of
        range for the target."""
