"""The reference decoder's Medusa proposer (``{"method": "medusa"}`` in vLLM <= 0.32) over an
export loaded by :mod:`draftsmith.models.medusa.format`. That vLLM 0.33 no longer serves Medusa
drafts is the release table's (:mod:`draftsmith.vllm_bridge.releases`), checked for every method
before an engine starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.spec_decode import Proposal, Proposer, head_export
from .format import load_medusa


class MedusaProposer(Proposer):
    """Medusa-1 chain drafting: head k reads the final hidden state at the last committed
    position t and proposes ``x_{t+k+2}`` (its top-1 at T=0, a sample at T>0)."""

    def __init__(self, model: Any):
        self.model = model
        self.max_k = int(model.config.num_heads)

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        weight = next(self.model.parameters())
        h = states[-1:].to(weight.device, weight.dtype).view(1, 1, -1)  # (B=1, T=1, H)
        logits = self.model(h)[:k, 0, 0]  # (k, V)
        return self._chain(lambda i, prev: logits[i].float(), k, temperature, generator)


def medusa_proposer(path: Path, target_model: Any | None = None) -> MedusaProposer:
    """The proposer of a Medusa export (:func:`draftsmith.models.medusa.format.load_medusa`).

    Raises:
        DraftLoadError: the folder does not load.
    """
    return MedusaProposer(head_export(load_medusa, path))

