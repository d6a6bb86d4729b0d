"""The reference decoder's DFlash proposer (``{"method": "dflash"}`` in vLLM 0.32): block
drafting as vLLM runs it, over an export loaded by :mod:`draftsmith.models.dflash.format`, and the check that an export fits
the target."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ...eval.acceptance import check_draft_matches_target
from ...eval.spec_decode import Proposal, Proposer, check_aux_layers, to_target_vocab
from .format import load_dflash
from .model import DFlashDraftModel, DFlashKVCache


class DFlashProposer(Proposer):
    """DFlash block drafting, as vLLM runs it: each proposal appends the context keys / values
    of the newly committed positions to the draft cache, then ONE draft forward over
    ``[pending token, M * k]`` at positions ``P..P+k`` proposes all k tokens (the argmax of
    each mask slot at T=0, a sample of ``softmax(logits / T)`` at T>0: the slots are
    independent given the block, as in vLLM's parallel drafting)."""

    def __init__(self, model: DFlashDraftModel):
        self.model = model
        self.aux_layer_ids = list(model.config.aux_layer_ids)
        self.max_k = model.config.block_size - 1
        self.reset()

    def reset(self) -> None:
        self.cache = DFlashKVCache()

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """See :meth:`Proposer.propose`.

        Raises:
            ValueError: ``k`` > ``block_size - 1`` (names the trained block size).
        """
        m = self.model
        if k > self.max_k:
            raise ValueError(f"k={k}: this {type(m).__name__.removesuffix('DraftModel')} draft was trained with "
                             f"block_size={m.config.block_size} and proposes at most {self.max_k} tokens per block")
        device, dtype = m.fc.weight.device, m.fc.weight.dtype
        start, n = len(self.cache), states.shape[0]
        m.append_context(self.cache, states.to(device, dtype), torch.arange(start, start + n, device=device))
        proposal = self.draft(int(next_tokens[-1]), start + n, k, temperature, generator)
        return to_target_vocab(proposal, m.d2t, m.config.vocab_size)

    def draft(self, bonus_token: int, position: int, k: int, temperature: float,
              generator: torch.Generator | None) -> Proposal:
        """The k draft tokens (draft-vocab ids) of the block ``[bonus_token, M * k]`` at ``position``."""
        logits = self.model.propose_block(self.cache, bonus_token, position, k)  # (k, Vd)
        return self._chain(lambda i, prev: logits[i], k, temperature, generator)


def dflash_proposer(path: Path, target_model: Any | None = None, *, load: Callable[..., Any] = load_dflash,
                    proposer_class: type[DFlashProposer] = DFlashProposer) -> DFlashProposer:
    """The proposer of a DFlash export (a DFlash-family one with ``load`` / ``proposer_class``),
    sharing ``target_model``'s input embedding (and its ``lm_head`` when the export ships none and
    the vocab is full).

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.dflash.format.load_dflash`; aux layer ids out of range for
            the target.
    """
    embed = head = None
    if target_model is not None:
        embed = target_model.get_input_embeddings().weight.detach()
        head = target_model.get_output_embeddings().weight.detach()
    model = load(path, embed, head)
    if target_model is not None:
        check_aux_layers(path, model.config.aux_layer_ids, target_model, lowest=1)
    return proposer_class(model)


def target_check(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of a DFlash export;
    returns its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
        DraftLoadError: a config the format cannot read.
    """
    return check_draft_matches_target(export_dir, target_dir, method="dflash")
