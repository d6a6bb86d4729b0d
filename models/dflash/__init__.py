"""DFlash block drafting (arXiv:2602.06036): :mod:`.config`, :mod:`.model` (a Qwen3-style stack
drafting a whole block in one bidirectional forward) and :mod:`.format` (the speculators / z-lab
layouts vLLM 0.32 serves as ``{"method": "dflash"}``). Also :mod:`.recipe` (its recipe ``draft``
section), :mod:`.training` (the training method, its labels, loss and dry-run estimates) and
:mod:`.proposer` (the reference decoder's proposer, the check that an export fits the target).
Registers the method in :mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="dflash", package=__name__, vllm_method="dflash", servable=True,
    vllm_releases=("0.32.0", "0.33.0"),
    parts={
        "recipe_config": ".recipe:DFlashDraftConfig",
        "config_class": ".config:DFlashConfig",
        "model_class": ".model:DFlashDraftModel",
        "format": ".format:DFLASH_FORMAT",
        "training_method": ".training:DFlashMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:dflash_proposer",
        "target_check": ".proposer:target_check",
    }))
