"""MLP speculator (arXiv:2404.19124): :mod:`.model` (config and stages) and :mod:`.format` (IBM's
``MLPSpeculatorPreTrainedModel`` layout, vLLM <= 0.32's ``{"method": "mlp_speculator"}``).
Registers the method in :mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .format import MLP_SPECULATOR_FORMAT
from .model import MLPSpeculator, MLPSpeculatorConfig

register(DraftMethodSpec(name="mlp_speculator", vllm_method="mlp_speculator", config_class=MLPSpeculatorConfig,
                         model_class=MLPSpeculator, format=MLP_SPECULATOR_FORMAT,
                         servable=False))
