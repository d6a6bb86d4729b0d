"""The reference decoder's XPress proposer (vLLM 0.33 ``{"method": "dflash"}`` with a
``Qwen3XPressModel`` draft): DFlash's block forward, then the greedy Jacobi passes of vLLM's
``XPressSpeculator`` (``v1/worker/gpu/spec_decode/xpress/speculator.py``) over an export loaded by
:mod:`draftsmith.models.xpress.format`; the check that an export fits the target and the installed
vLLM's serve check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...eval.acceptance import check_draft_matches_target
from ...eval.spec_decode import Proposal
from ...vllm_bridge.spec_config import check_vllm_has_v2_runner
from ..dflash.proposer import DFlashProposer, dflash_proposer
from .format import load_xpress

V1_XPRESS_REFUSAL = "Model Runner V1 does not support: xpress speculative decoding"
"""vLLM 0.33's refusal of an XPress draft without its V2 model runner (``config/vllm.py``)."""


class XPressProposer(DFlashProposer):
    """XPress drafting as vLLM 0.33's ``XPressSpeculator`` runs it: ONE draft forward over the
    whole block ``[pending token, M * (Bk-1)]``, the drafter's argmax per slot, then
    ``num_jacobi_passes`` refine passes (:meth:`~draftsmith.models.xpress.model.XPressDraftModel.propose_jacobi`),
    the token before the pending one standing in as the pending token itself, as vLLM 0.33 does.
    The drafts are greedy at every temperature (vLLM verifies them as one-hot proposals); asked for
    k < Bk-1 tokens it returns the first k of the block (the refiner is causal, so they are the
    tokens a full block drafts)."""

    draft_sampling = "greedy"

    def draft(self, bonus_token: int, position: int, k: int, temperature: float,
              generator: torch.Generator | None) -> Proposal:
        tokens = self.model.propose_jacobi(self.cache, bonus_token, position)[:k].cpu()
        probs = None
        if temperature > 0:
            probs = F.one_hot(tokens, self.model.config.vocab_size).float()
        return Proposal(tokens, probs)


def xpress_proposer(path: Path, target_model: Any | None = None) -> XPressProposer:
    """The proposer of an XPress export, sharing ``target_model``'s input embedding
    (:func:`~draftsmith.models.dflash.proposer.dflash_proposer`).

    Raises:
        DraftLoadError: see :func:`~draftsmith.models.xpress.format.load_xpress`; aux layer ids out of
            range for the target.
    """
    return dflash_proposer(path, target_model, load=load_xpress, proposer_class=XPressProposer)


def target_check(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """:func:`~draftsmith.eval.acceptance.check_draft_matches_target` of an XPress export; returns
    its ``config.json``.

    Raises:
        DraftMismatchError: the export does not fit the target, or is another method's.
        DraftLoadError: a config the format cannot read.
    """
    return check_draft_matches_target(export_dir, target_dir, method="xpress")


def check_vllm_serves(draft: Path) -> None:
    """Raises ValueError, in one line and before any engine starts, where the installed vLLM cannot
    run an XPress draft: XPress runs only in vLLM's V2 model runner, which needs Triton
    (:func:`~draftsmith.vllm_bridge.spec_config.check_vllm_has_v2_runner`). A vLLM before 0.33, which
    has no XPress drafter at all, is refused before this by the release table
    (:func:`~draftsmith.vllm_bridge.releases.check_vllm_loads`: ``xpress`` and ``Qwen3XPressModel``
    from 0.33 on)."""
    check_vllm_has_v2_runner(draft, "XPress drafts", V1_XPRESS_REFUSAL)
