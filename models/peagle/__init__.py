"""P-EAGLE parallel drafting (arXiv:2602.01469): :mod:`.config`, :mod:`.model` (EAGLE-3 with K
tokens drafted in one forward) and :mod:`.format` (the speculators ``peagle`` layout vLLM 0.32
serves as ``{"method": "eagle3", "parallel_drafting": true}``). Registers the method in
:mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .config import PEagleConfig
from .format import PEAGLE_FORMAT
from .model import PEagleDraftModel

register(DraftMethodSpec(name="peagle", vllm_method="eagle3", config_class=PEagleConfig, model_class=PEagleDraftModel,
                         format=PEAGLE_FORMAT, servable=True,
                         vllm_extra=(("parallel_drafting", True),)))
