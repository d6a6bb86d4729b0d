"""Medusa heads (arXiv:2401.10774): :mod:`.model` (config and heads) and :mod:`.format` (the
layout vLLM <= 0.32 serves as ``{"method": "medusa"}``). Registers the method in
:mod:`draftsmith.methods`."""

from ...methods import DraftMethodSpec, register
from .format import MEDUSA_FORMAT
from .model import MedusaConfig, MedusaModel

register(DraftMethodSpec(name="medusa", vllm_method="medusa", config_class=MedusaConfig, model_class=MedusaModel,
                         format=MEDUSA_FORMAT, servable=True))
