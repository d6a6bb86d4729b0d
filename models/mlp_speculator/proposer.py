"""The reference decoder's MLP-speculator proposer (``{"method": "mlp_speculator"}`` in vLLM <=
0.32) over an export loaded by :mod:`draftsmith.models.mlp_speculator.format`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.spec_decode import Proposal, Proposer, head_export
from .format import load_mlp_speculator


class MLPSpeculatorProposer(Proposer):
    """IBM MLP speculator: stage 0 reads the final hidden state at t and ``x_{t+1}``; stage
    i > 0 its own state and the token chosen at stage i-1."""

    def __init__(self, model: Any):
        self.model = model
        self.max_k = int(model.config.n_predict)

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        weight = next(self.model.parameters())
        state = states[-1:].to(weight.device, weight.dtype).view(1, 1, -1)  # (1, 1, D)
        first = int(next_tokens[-1])

        def logits_fn(i: int, prev: int | None) -> torch.Tensor:
            nonlocal state
            tok = torch.tensor([[first if i == 0 else prev]], device=weight.device)
            state, logits = self.model.stage(i, state, tok)  # (1, 1, D), (1, 1, V)
            return logits[0, 0].float()

        return self._chain(logits_fn, k, temperature, generator)


def mlp_speculator_proposer(path: Path, target_model: Any | None = None) -> MLPSpeculatorProposer:
    """The proposer of an MLP-speculator export (:func:`draftsmith.models.mlp_speculator.format.load_mlp_speculator`).

    Raises:
        DraftLoadError: the folder does not load.
    """
    return MLPSpeculatorProposer(head_export(load_mlp_speculator, path))
