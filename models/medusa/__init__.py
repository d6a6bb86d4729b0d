"""Medusa heads (arXiv:2401.10774): :mod:`.model` (config and heads) and :mod:`.format` (the layout
vLLM <= 0.32 serves as ``{"method": "medusa"}``). Also :mod:`.recipe` (its recipe ``draft``
section), :mod:`.training` (the training method, its labels, loss and dry-run estimates) and
:mod:`.proposer` (the reference decoder's proposer). Registers the
method in :mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="medusa", package=__name__, vllm_method="medusa", servable=True,
    vllm_releases=("0.32.0",), chain_drafts=True,  # vLLM 0.33 removed the method and its model code
    parts={
        "recipe_config": ".recipe:MedusaDraftConfig",
        "config_class": ".model:MedusaConfig",
        "model_class": ".model:MedusaModel",
        "format": ".format:MEDUSA_FORMAT",
        "training_method": ".training:MedusaMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:medusa_proposer",
    }))
