"""P-EAGLE parallel drafting (arXiv:2602.01469): :mod:`.config`, :mod:`.model` (EAGLE-3 with K
tokens drafted in one forward) and :mod:`.format` (the speculators ``peagle`` layout vLLM 0.32
serves as ``{"method": "eagle3", "parallel_drafting": true}``). Also :mod:`.recipe` (its recipe
``draft`` section), :mod:`.training` (the training method, its labels, loss and dry-run estimates)
and :mod:`.proposer` (the reference decoder's proposer, the check that an export fits the target).
Registers the method in :mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="peagle", package=__name__, vllm_method="eagle3", servable=True,
    vllm_releases=("0.32.0", "0.33.0"),  # served as eagle3 with parallel_drafting
    vllm_extra=(("parallel_drafting", True),),
    parts={
        "recipe_config": ".recipe:PEagleDraftConfig",
        "config_class": ".config:PEagleConfig",
        "model_class": ".model:PEagleDraftModel",
        "format": ".format:PEAGLE_FORMAT",
        "training_method": ".training:PEagleMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:peagle_proposer",
        "target_check": ".proposer:target_check",
    }))
