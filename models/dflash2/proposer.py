"""The reference decoder's DFlash2 proposer (vLLM 0.32 ``{"method": "dflash"}`` with a
``DFlash2DraftModel``): DFlash's block forward, then vLLM's candidate walk
(``v1/worker/gpu/spec_decode/dflash2/speculator.py``) over an export loaded by
:mod:`draftsmith.models.dflash2.format`; the check that an export fits the target and the installed
vLLM's serve check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...eval.acceptance import check_draft_matches_target
from ...eval.spec_decode import Proposal
from ...vllm_bridge.spec_config import check_vllm_has_v2_runner
from ..dflash.proposer import DFlashProposer, dflash_proposer
from .format import load_dflash2


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


def dflash2_proposer(path: Path, target_model: Any | None = None) -> DFlash2Proposer:
    """The proposer of a DFlash2 export, sharing ``target_model``'s input embedding
    (:func:`~draftsmith.models.dflash.proposer.dflash_proposer`).

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.dflash2.format.load_dflash2`; aux layer ids out of
            range for the target.
    """
    return dflash_proposer(path, target_model, load=load_dflash2, proposer_class=DFlash2Proposer)


def target_check(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of a DFlash2 export;
    returns its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
        DraftLoadError: a config the format cannot read.
    """
    return check_draft_matches_target(export_dir, target_dir, method="dflash2")


V1_CANDIDATE_HEAD_REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"
"""vLLM 0.32's refusal of a DFlash2 draft without Triton (``config/vllm.py``; docs/dflash2.md)."""


def check_vllm_serves(draft: Path) -> None:
    """:func:`~draftsmith.vllm_bridge.spec_config.check_vllm_has_v2_runner` for DFlash2 drafts (the
    candidate selector; docs/dflash2.md)."""
    check_vllm_has_v2_runner(draft, "DFlash2 drafts", V1_CANDIDATE_HEAD_REFUSAL)
