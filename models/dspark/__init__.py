"""DSpark block drafting: DFlash's block drafter (arXiv:2602.06036) plus a sequential low-rank
Markov head and a confidence head, served by vLLM 0.32 as ``{"method": "dspark"}``
(``Qwen3DSparkModel``): :mod:`.config`, :mod:`.model`, :mod:`.format` (docs/dspark.md). Also
:mod:`.recipe` (its recipe ``draft`` section), :mod:`.training` (the training method, its labels,
loss and dry-run estimates) and :mod:`.proposer` (the reference decoder's proposer, the check that
an export fits the target, the installed vLLM's serve check). Registers the method in
:mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

# vLLM serves it on a GPU only (V2 model runner); .proposer:check_vllm_serves says so
register(DraftMethodSpec(
    name="dspark", package=__name__, vllm_method="dspark", servable=True,
    vllm_releases=("0.32.0", "0.33.0"),
    parts={
        "recipe_config": ".recipe:DSparkDraftConfig",
        "config_class": ".config:DSparkConfig",
        "model_class": ".model:DSparkDraftModel",
        "format": ".format:DSPARK_FORMAT",
        "training_method": ".training:DSparkMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:dspark_proposer",
        "target_check": ".proposer:target_check",
        "vllm_serve_check": ".proposer:check_vllm_serves",
    }))
