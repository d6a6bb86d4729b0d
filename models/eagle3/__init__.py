"""EAGLE-3 (arXiv:2503.01840): :mod:`.config`, :mod:`.model` (decoder layers, one unless
``draft.num_layers``, over three fused target aux states, trained with training-time test) and
:mod:`.format` (the speculators / legacy exports vLLM serves as ``{"method": "eagle3"}``). Also
:mod:`.recipe` (its recipe ``draft`` section), :mod:`.training` (the training method, its labels,
loss and dry-run estimates) and :mod:`.proposer` (the reference decoder's proposer, the check that
an export fits the target), :mod:`.simulate` (``draftsmith simulate``). Registers the method in
:mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="eagle3", package=__name__, vllm_method="eagle3", servable=True,
    vllm_releases=("0.32.0", "0.33.0"), chain_drafts=True,
    parts={
        "recipe_config": ".recipe:Eagle3DraftConfig",
        "config_class": ".config:Eagle3Config",
        "model_class": ".model:Eagle3DraftModel",
        "format": ".format:EAGLE3_FORMAT",
        "training_method": ".training:Eagle3Method",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:eagle3_proposer",
        "target_check": ".proposer:target_check",
        "simulator": ".simulate:simulate",
    }))
