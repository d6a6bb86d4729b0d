"""The evaluation layer's part of every draft method, attached to :mod:`draftsmith.methods`: the
reference decoder's proposer factory (``eval/spec_decode.py``, ``eval/dflash.py``,
``eval/dflash2.py``, ``eval/peagle.py``), the target check of the drafts that share the target's embedding and vocab
(:func:`~draftsmith.eval.acceptance.check_draft_matches_target`, driven by each format's ``fit``)
and, for Medusa and DFlash2, the installed vLLM's serve check.

:class:`draftsmith.methods.DraftMethodSpec` loads this module on first access of one of these.
"""

from __future__ import annotations

from functools import partial

from ..methods import attach
from .acceptance import check_draft_matches_target
from .dflash import dflash_proposer
from .dspark import dspark_proposer
from .dflash2 import dflash2_proposer
from .peagle import peagle_proposer
from ..vllm_bridge.spec_config import check_vllm_serves_dflash2, check_vllm_serves_dspark, check_vllm_serves_medusa
from .spec_decode import eagle3_proposer, medusa_proposer, mlp_speculator_proposer

attach("eagle3", proposer_factory=eagle3_proposer, target_check=partial(check_draft_matches_target, method="eagle3"))
attach("medusa", proposer_factory=medusa_proposer, vllm_serve_check=check_vllm_serves_medusa)
attach("mlp_speculator", proposer_factory=mlp_speculator_proposer)
attach("dflash", proposer_factory=dflash_proposer, target_check=partial(check_draft_matches_target, method="dflash"))
attach("peagle", proposer_factory=peagle_proposer, target_check=partial(check_draft_matches_target, method="peagle"))
attach("dspark", proposer_factory=dspark_proposer, target_check=partial(check_draft_matches_target, method="dspark"),
       vllm_serve_check=check_vllm_serves_dspark)
attach("dflash2", proposer_factory=dflash2_proposer, target_check=partial(check_draft_matches_target, method="dflash2"),
       vllm_serve_check=check_vllm_serves_dflash2)
