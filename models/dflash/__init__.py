"""DFlash block drafting (arXiv:2602.06036): :mod:`.config`, :mod:`.model` (a Qwen3-style stack
drafting a whole block in one bidirectional forward) and :mod:`.format` (the speculators / z-lab
layouts vLLM 0.32 serves as ``{"method": "dflash"}``). Registers the method in
:mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .config import DFlashConfig
from .format import DFLASH_FORMAT
from .model import DFlashDraftModel

register(DraftMethodSpec(name="dflash", vllm_method="dflash", config_class=DFlashConfig, model_class=DFlashDraftModel,
                         format=DFLASH_FORMAT, servable=True))
