"""The reference decoder's EAGLE-3 proposer (``{"method": "eagle3"}`` in vLLM): chain drafting with
a draft KV cache over an export loaded by :mod:`draftsmith.models.eagle3.format`, and the check
that an export fits the target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.acceptance import check_draft_matches_target
from ...eval.spec_decode import Proposal, Proposer, check_aux_layers, to_target_vocab
from .format import load_eagle3
from .model import Eagle3DraftModel, Eagle3KVCache


class Eagle3Proposer(Proposer):
    """EAGLE-3 chain drafting with a draft KV cache per draft layer (``caches``).

    Layer 0's cache holds, per position, the key/value of its step-0 input
    ``(emb(x_{t+1}), fc(aux_t))`` at RoPE position t (a later layer's, of its input there). A proposal after pending token ``x_m``
    runs step 0 on the new positions (causal), then chained steps i = 1..K-1 at RoPE
    position ``m-1+i`` with the previous step's output hidden state and the drafted token
    ``d_i``; each attends to every cached key (with ``sliding_window`` W, those less than W
    positions back: the cache is indexed by position, as vLLM's), which is exactly the TTT mask
    of training (step-0 keys causally + the same position's earlier steps, see
    :func:`draftsmith.models.eagle3.model.ttt_attention_mask`). Chained keys are cropped after
    the proposal. The arithmetic is the model's own
    (:meth:`draftsmith.models.eagle3.model.Eagle3DraftModel.step_cached`).
    """

    def __init__(self, model: Eagle3DraftModel):
        self.model = model
        self.aux_layer_ids = list(model.config.aux_layer_ids)
        self.reset()

    def reset(self) -> None:
        self.caches = [Eagle3KVCache() for _ in self.model.layers]  # one per draft layer
        self.length = 0  # committed (step-0) positions in the cache

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        m = self.model
        dtype, device = m.fc.weight.dtype, m.fc.weight.device
        n = states.shape[0]
        hidden = m.fuse(states.to(device, dtype)).unsqueeze(0)  # (1, n, H)
        positions = torch.arange(self.length, self.length + n, device=device)
        hidden = m.step_cached(next_tokens.to(device).unsqueeze(0), hidden, positions.unsqueeze(0), self.caches)
        hidden = hidden[:, -1:]  # (1, 1, H)
        self.length += n
        d2t = m.d2t
        V = m.config.vocab_size

        def logits_fn(i: int, prev: int | None) -> torch.Tensor:
            nonlocal hidden
            if i > 0:
                prev_ids = (prev + d2t[prev]).view(1, 1)  # the embedding is over target ids
                hidden = m.step_cached(prev_ids, m.next_hidden(hidden),  # post-norm with norm_output
                                       torch.tensor([[self.length - 1 + i]], device=device), self.caches)
            return m.compute_logits(hidden[0, -1]).float()  # (Vd,)

        proposal = self._chain(logits_fn, k, temperature, generator)
        for cache in self.caches:
            cache.crop(self.length)
        return to_target_vocab(proposal, d2t, V)


def eagle3_proposer(path: Path, target_model: Any | None = None) -> Eagle3Proposer:
    """The proposer of an EAGLE-3 export, sharing ``target_model``'s input embedding.

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.eagle3.format.load_eagle3`; aux layer ids the target does not have.
    """
    embed = target_model.get_input_embeddings().weight.detach() if target_model is not None else None
    model = load_eagle3(path, embed)
    if target_model is not None:
        check_aux_layers(path, model.config.aux_layer_ids, target_model)
    return Eagle3Proposer(model)


def target_check(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of an EAGLE-3 export;
    returns its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
        DraftLoadError: a config the format cannot read.
    """
    return check_draft_matches_target(export_dir, target_dir, method="eagle3")
