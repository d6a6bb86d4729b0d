"""The reference decoder's MTP proposer (``{"method": "mtp"}``) over an export (or a target that
ships its MTP layer) loaded by :mod:`draftsmith.models.mtp.format`, and the export's target check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.spec_decode import Proposal, Proposer
from ...layout import DraftLoadError, ExportError
from .format import load_mtp


class MTPProposer(Proposer):
    """vLLM's MTP drafting: step 0 runs the layer over every committed position t (token
    ``x_{t+1}``, the target's final hidden state ``h_t``), then step i > 0 runs it again at position
    ``t + i`` on the drafted token and the previous step's output; each step's logits come from the
    target's ``lm_head``. The layer's KV cache is rebuilt per round from the committed history
    (quadratic in the length: a reference, not a server)."""

    max_k = 16

    def __init__(self, model: Any):
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.states: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        from transformers import DynamicCache

        m = self.model
        device = m.embed_tokens.device
        self.states.append(states.to(device, torch.float32))
        self.tokens.append(next_tokens.to(device))
        hidden, tokens = torch.cat(self.states)[None], torch.cat(self.tokens)[None]  # (1, n, H), (1, n)
        n = tokens.shape[1]
        cache = DynamicCache()
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
        o = m.step(tokens, hidden, torch.arange(n, device=device)[None], causal, cache)[:, -1:]  # (1, 1, H)

        def logits_fn(i: int, prev: int | None) -> torch.Tensor:
            nonlocal o
            if i > 0:  # the drafted token at position n - 1 + i, attending to every cached key
                o = m.step(torch.tensor([[prev]], device=device), o, torch.tensor([[n - 1 + i]], device=device),
                           torch.ones(1, 1, 1, n + i, dtype=torch.bool, device=device), cache)
            return m.compute_logits(o[0, -1]).float()  # (V,)

        return self._chain(logits_fn, k, temperature, generator)


def mtp_proposer(path: Path, target_model: Any | None = None) -> MTPProposer:
    """The proposer of an MTP export with ``target_model``'s embedding and ``lm_head`` (vLLM shares both).

    Raises:
        DraftLoadError: no target model given, or the folder does not load.
    """
    if target_model is None:
        raise DraftLoadError(f"{path}: an MTP draft computes with the target's embedding and lm_head; give the target")
    embed = target_model.get_input_embeddings().weight.detach()
    lm_head = target_model.get_output_embeddings().weight.detach()
    try:
        return MTPProposer(load_mtp(path, embed, lm_head).requires_grad_(False).to(embed.device))
    except (ExportError, KeyError) as exc:
        raise DraftLoadError(f"{path}: {exc}") from exc


def check_target(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of an MTP export (its
    :func:`~draftsmith.models.mtp.format.mtp_fit`); returns its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
    """
    from ...eval.acceptance import check_draft_matches_target

    return check_draft_matches_target(export_dir, target_dir, method="mtp")
