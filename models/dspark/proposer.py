"""The reference decoder's DSpark proposer (``{"method": "dspark"}`` in vLLM 0.32): block
drafting plus the sequential Markov correction, as vLLM's DSpark speculator
(``v1/worker/gpu/spec_decode/dspark/speculator.py``) runs it, over an export loaded by
:mod:`draftsmith.models.dspark.format`; the check that an export fits the target and the installed
vLLM's serve check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.acceptance import check_draft_matches_target
from ...eval.spec_decode import Proposal
from ...vllm_bridge.spec_config import check_vllm_has_v2_runner
from ..dflash.proposer import DFlashProposer, dflash_proposer
from .format import load_dspark
from .model import DSparkDraftModel


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
    def draft(self, bonus_token: int, position: int, k: int, temperature: float,
              generator: torch.Generator | None) -> Proposal:
        """The k draft tokens (draft-vocab ids) of the block ``[bonus_token, M * (k-1)]`` at
        ``position``, Markov-corrected left to right."""
        m, pending = self.model, bonus_token
        device = m.fc.weight.device
        hidden = m.propose_hidden(self.cache, pending, position, k)  # (k, H)

        def logits_fn(i: int, prev: int | None) -> torch.Tensor:
            prev_target = pending if prev is None else prev + int(m.d2t[prev])  # draft id -> target id
            e = m.markov_embed(torch.tensor(prev_target, device=device))
            return m.markov_logits(hidden[i], e).float()

        return self._chain(logits_fn, k, temperature, generator)


def dspark_proposer(path: Path, target_model: Any | None = None) -> DSparkProposer:
    """The proposer of a DSpark export, sharing ``target_model``'s input embedding
    (:func:`~draftsmith.models.dflash.proposer.dflash_proposer`).

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.dspark.format.load_dspark`; aux layer ids out of range.
    """
    return dflash_proposer(path, target_model, load=load_dspark, proposer_class=DSparkProposer)


def target_check(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of a DSpark export;
    returns its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
        DraftLoadError: a config the format cannot read.
    """
    return check_draft_matches_target(export_dir, target_dir, method="dspark")


V1_DSPARK_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"
"""vLLM 0.32's refusal of a DSpark draft without Triton (``config/vllm.py``; docs/dspark.md)."""


def check_vllm_serves(draft: Path) -> None:
    """:func:`~draftsmith.vllm_bridge.spec_config.check_vllm_has_v2_runner` for DSpark drafts (the
    sequential Markov head; docs/dspark.md)."""
    check_vllm_has_v2_runner(draft, "DSpark drafts", V1_DSPARK_REFUSAL)
