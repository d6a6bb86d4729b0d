"""The reference decoder's P-EAGLE proposer (docs/parallel_drafts.md, "P-EAGLE at inference"):
parallel drafting as vLLM runs it (``{"method": "eagle3", "parallel_drafting": true}``), over an
export loaded by :mod:`draftsmith.models.peagle.format`, and the check that an export fits the
target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.acceptance import check_draft_matches_target
from ...eval.spec_decode import Proposal, Proposer, check_aux_layers, to_target_vocab
from ..eagle3.model import Eagle3KVCache
from .format import load_peagle
from .model import PEagleDraftModel


class PEagleProposer(Proposer):
    """Parallel drafting as vLLM runs it (docs/parallel_drafts.md, "P-EAGLE at inference").

    Per-layer KV caches hold the depth-0 entries ``(x_{t+1}, fc(g_t))`` of committed positions
    at RoPE position t. A proposal after pending token ``x_{p+1}`` writes the new committed
    positions (the last is the bonus slot, position p) plus K-1 mask slots
    (``mask_token_id``, ``fc(mask_hidden)``, positions p+1..p+K-1) in ONE causal forward, reads
    the K draft logits of the bonus and mask slots, and crops the mask slots from the caches.
    """

    def __init__(self, model: PEagleDraftModel):
        self.model = model
        self.aux_layer_ids = list(model.config.aux_layer_ids)
        self.max_k = int(model.config.num_depths)
        self.reset()

    def reset(self) -> None:
        self.caches = [Eagle3KVCache() for _ in self.model.layers]
        self.length = 0  # committed (depth-0) positions in the caches

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """See :meth:`Proposer.propose`.

        Raises:
            ValueError: ``k`` outside ``[1, num_depths]``.
        """
        m = self.model
        if not 1 <= k <= m.config.num_depths:
            raise ValueError(f"k={k}: this P-EAGLE draft was trained with num_depths={m.config.num_depths} "
                             f"parallel depths, so it proposes 1..{m.config.num_depths} tokens")
        dtype, device = m.fc.weight.dtype, m.fc.weight.device
        n = states.shape[0]
        hidden = m.fc(states.to(device, dtype))  # (n, H)
        masks = m.mask_state().to(dtype).expand(k - 1, -1)  # (k-1, H)
        hidden = torch.cat([hidden, masks]).unsqueeze(0)  # (1, n+k-1, H)
        ids = torch.cat([next_tokens.to(device),
                         torch.full((k - 1,), m.config.mask_token_id, dtype=torch.long, device=device)]).unsqueeze(0)
        positions = torch.arange(self.length, self.length + n + k - 1, device=device).unsqueeze(0)
        out = m.forward_cached(ids, hidden, positions, self.caches)  # (1, n+k-1, H)
        logits = m.compute_logits(out[0, n - 1:]).float()  # (k, Vd): bonus slot + k-1 mask slots
        self.length += n
        for cache in self.caches:
            cache.crop(self.length)
        proposal = self._chain(lambda i, prev: logits[i], k, temperature, generator)
        return to_target_vocab(proposal, m.d2t, m.config.vocab_size)


def peagle_proposer(path: Path, target_model: Any | None = None) -> PEagleProposer:
    """The proposer of a P-EAGLE export, sharing ``target_model``'s input embedding unless the
    export ships its own.

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.peagle.format.load_peagle`; aux layer ids the target does not have.
    """
    embed = target_model.get_input_embeddings().weight.detach() if target_model is not None else None
    model = load_peagle(path, embed)
    if target_model is not None:
        check_aux_layers(path, model.config.aux_layer_ids, target_model)
    return PEagleProposer(model)


def target_check(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of a P-EAGLE export;
    returns its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
        DraftLoadError: a config the format cannot read.
    """
    return check_draft_matches_target(export_dir, target_dir, method="peagle")
