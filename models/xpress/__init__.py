"""XPress block drafting (speculators 0.9 ``xpress``; vLLM 0.33 ``qwen3_xpress.py``): DFlash
(:mod:`draftsmith.models.dflash`) plus a causal low-rank refiner that biases every block slot's
logits by the token before it, resolved at inference by parallel Jacobi passes. :mod:`.config`,
:mod:`.model`, :mod:`.format` (served by vLLM 0.33 as ``{"method": "dflash"}``, architecture
``Qwen3XPressModel``, with a ``speculators_config.json`` for speculators; docs/xpress.md). Also
:mod:`.recipe` (its recipe ``draft`` section), :mod:`.training` (the training method, its loss and
dry-run estimates) and :mod:`.proposer` (the reference decoder's proposer, the check that an export
fits the target, the installed vLLM's serve check). Registers the method in
:mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

# vLLM serves it from 0.33 on a GPU only (V2 model runner); .proposer:check_vllm_serves says so
register(DraftMethodSpec(
    name="xpress", package=__name__, vllm_method="dflash", servable=True,
    vllm_releases=("0.33.0",),  # served as dflash, architecture Qwen3XPressModel
    architecture_releases=(("Qwen3XPressModel", ("0.33.0",)), ("DFlashQwen3XPressModel", ("0.33.0",))),
    parts={
        "recipe_config": ".recipe:XPressDraftConfig",
        "config_class": ".config:XPressConfig",
        "model_class": ".model:XPressDraftModel",
        "format": ".format:XPRESS_FORMAT",
        "training_method": ".training:XPressMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:xpress_proposer",
        "target_check": ".proposer:target_check",
        "vllm_serve_check": ".proposer:check_vllm_serves",
    }))
