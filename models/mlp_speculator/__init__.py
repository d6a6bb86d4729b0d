"""MLP speculator (arXiv:2404.19124): :mod:`.model` (config and stages) and :mod:`.format` (IBM's
``MLPSpeculatorPreTrainedModel`` layout, vLLM <= 0.32's ``{"method": "mlp_speculator"}``). Also
:mod:`.recipe` (its recipe ``draft`` section), :mod:`.training` (the training method, its labels,
loss and dry-run estimates) and :mod:`.proposer` (the reference decoder's proposer). Registers the
method in :mod:`draftsmith.methods`, its parts imported on first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="mlp_speculator", package=__name__, vllm_method="mlp_speculator", servable=False,
    vllm_releases=("0.32.0",), chain_drafts=True,  # 0.32 keeps the method and model code; its V1 engine does not route it
    vllm_remedy="measure them with the reference decoder (draftsmith compare): vLLM 0.32's V1 engine does not "
                "route them either",
    parts={
        "recipe_config": ".recipe:MLPSpeculatorDraftConfig",
        "config_class": ".model:MLPSpeculatorConfig",
        "model_class": ".model:MLPSpeculator",
        "format": ".format:MLP_SPECULATOR_FORMAT",
        "training_method": ".training:MLPSpeculatorMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:mlp_speculator_proposer",
    }))
