"""DFlash2 block drafting (z-lab DFlash2; vLLM 0.32 ``qwen3_dflash2.py``): DFlash
(:mod:`draftsmith.models.dflash`) with grouped dynamic convolutions in every layer and a
low-rank candidate selector. :mod:`.config`, :mod:`.model`, :mod:`.format` (served by vLLM as
``{"method": "dflash"}``, architecture ``DFlash2DraftModel``). Registers the method in
:mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .config import DFlash2Config
from .format import DFLASH2_FORMAT
from .model import DFlash2DraftModel

register(DraftMethodSpec(name="dflash2", vllm_method="dflash", config_class=DFlash2Config,
                         model_class=DFlash2DraftModel, format=DFLASH2_FORMAT, servable=True))
