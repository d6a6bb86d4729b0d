"""DSpark block drafting: DFlash's block drafter (arXiv:2602.06036) plus a sequential low-rank
Markov head and a confidence head, served by vLLM 0.32 as ``{"method": "dspark"}``
(``Qwen3DSparkModel``): :mod:`.config`, :mod:`.model`, :mod:`.format` (docs/dspark.md).
Registers the method in :mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .config import DSparkConfig
from .format import DSPARK_FORMAT
from .model import DSparkDraftModel

# vLLM serves it on a GPU only (V2 model runner); eval/method_registry.py attaches the check that says so
register(DraftMethodSpec(name="dspark", vllm_method="dspark", config_class=DSparkConfig, model_class=DSparkDraftModel,
                         format=DSPARK_FORMAT, servable=True))
