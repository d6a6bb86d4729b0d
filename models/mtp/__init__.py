"""The target's own multi-token-prediction (MTP) layer, fine-tuned: :mod:`.config` (families,
target check), :mod:`.model` (the layer, as vLLM's ``deepseek_mtp.py`` / ``qwen3_next_mtp.py``
compute it), :mod:`.weights` (shipped names, warm start), :mod:`.format` (the export vLLM
serves with ``{"method": "mtp", "model": EXPORT}``), :mod:`.recipe`, :mod:`.training` and
:mod:`.proposer`. Registers the method in :mod:`draftsmith.methods`, its parts imported on
first use."""

from ...methods import DraftMethodSpec, register

register(DraftMethodSpec(
    name="mtp", package=__name__, vllm_method="mtp", servable=True,
    vllm_releases=("0.32.0", "0.33.0"), chain_drafts=True,  # vLLM reruns the one layer on its own output
    parts={
        "recipe_config": ".recipe:MTPDraftConfig",
        "config_class": ".config:MTPConfig",
        "model_class": ".model:MTPDraftModel",
        "format": ".format:MTP_FORMAT",
        "training_method": ".training:MTPMethod",
        "parameter_estimator": ".training:parameter_estimate",
        "activation_estimator": ".training:activation_estimate",
        "proposer_factory": ".proposer:mtp_proposer",
        "target_check": ".proposer:check_target",
    }))
