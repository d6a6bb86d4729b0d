"""DFlash2 block drafting (z-lab DFlash2; vLLM 0.32 ``qwen3_dflash2.py``): DFlash
(:mod:`draftsmith.models.dflash`) with grouped dynamic convolutions in every layer and a low-rank
candidate selector. :mod:`.config`, :mod:`.model`, :mod:`.format` (served by vLLM as ``{"method":
"dflash"}``, architecture ``DFlash2DraftModel``). Also :mod:`.recipe` (its recipe ``draft``
section), :mod:`.training` (the training method, its labels, loss and dry-run estimates) and
:mod:`.proposer` (the reference decoder's proposer, the check that an export fits the target, the
installed vLLM's serve check). Registers the method in :mod:`draftsmith.methods`, its parts imported
on first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="dflash2", package=__name__, vllm_method="dflash", servable=True,
    vllm_releases=("0.32.0", "0.33.0"),  # served as dflash, architecture DFlash2DraftModel
    parts={
        "recipe_config": ".recipe:DFlash2DraftConfig",
        "config_class": ".config:DFlash2Config",
        "model_class": ".model:DFlash2DraftModel",
        "format": ".format:DFLASH2_FORMAT",
        "training_method": ".training:DFlash2Method",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:dflash2_proposer",
        "target_check": ".proposer:target_check",
        "vllm_serve_check": ".proposer:check_vllm_serves",
    }))
