"""EAGLE-3 (arXiv:2503.01840): :mod:`.config`, :mod:`.model` (one decoder layer over three fused
target aux states, trained with training-time test) and :mod:`.format` (the speculators / legacy
exports vLLM serves as ``{"method": "eagle3"}``). Registers the method in :mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .config import Eagle3Config
from .format import EAGLE3_FORMAT
from .model import Eagle3DraftModel

register(DraftMethodSpec(name="eagle3", vllm_method="eagle3", config_class=Eagle3Config, model_class=Eagle3DraftModel,
                         format=EAGLE3_FORMAT, servable=True))
