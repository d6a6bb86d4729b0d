"""The draft-method registry: every place that depends on ``draft.method`` looks it up here.

A method (EAGLE-3, Medusa, MLP speculator, DFlash, P-EAGLE) is one
:class:`DraftMethodSpec`: its recipe section, draft model class, FSDP block classes, training
method and entry script, exporter and export loader, the vLLM ``speculative_config`` method its
export serves as, the dry run's parameter estimator and the reference decoder's proposer
factory. Adding a method is one :func:`register` call (plus its own modules).

Entries name their implementations by dotted path (``"package.module:attribute"``) and resolve
them on use, so importing the registry imports neither torch nor ``train/`` / ``eval/``, and
``recipe.py`` can take the method names from it (like the speculators package's registry of
algorithms by name).

    spec = get_method(recipe.draft.method)
    model = spec.model_class(config)
    spec.exporter(ckpt, out, dtype="bfloat16")
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


class UnknownMethodError(ValueError):
    """A draft method name (or export / checkpoint format) no registered method has; the
    message lists the registered names."""


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DraftMethodSpec:
    """One draft method. Fields ending in ``_path`` are ``"module:attribute"`` paths, read
    through the property of the same name without the suffix.

    Attributes:
        name: ``draft.method`` in recipes, ``method`` in ``draft_config.json`` of checkpoints.
        vllm_method: ``speculative_config["method"]`` vLLM serves the export as.
        fsdp_block_classes: the model class's ``_no_split_modules`` (FSDP wrap units).
        fsdp_block_parts: keys of the dry-run parameter estimate inside those blocks.
        train_script: thin entry script, relative to the package root (``accelerate launch`` runs it).
        supports_gradient_checkpointing: ``train.gradient_checkpointing`` applies to it.
        export_options: keyword options of ``eval/export.py``'s ``export`` the exporter takes
            besides ``dtype`` (``legacy``, ``num_speculative_tokens``, ``embed_tokens``).
        servable: ``eval/serve_bench.py`` serves its exports with ``vllm serve``.
        recipe_config_path: the pydantic class of its recipe ``draft`` section (a member of
            ``recipe.DraftConfig``, the union discriminated by ``method``).
        model_class_path: the draft ``nn.Module``, built from its config.
        training_method_path: the ``train/method_<name>.py`` class (``name``, ``build_model``, ...).
        exporter_path: ``exporter(ckpt, out, dtype=..., **export_options) -> out``.
        export_loader_path: ``loader(export_dir) -> model`` (float32, eval mode); EAGLE-3
            takes the target embedding as a second argument when the export has none.
        export_detector_path: ``detector(config_json: dict) -> bool``, true for its exports.
        parameter_estimator_path: ``estimator(recipe, eagle3_cfg, vocab_size) ->
            (parameter counts by part, an upper bound of unchunked logits bytes per micro-batch)``
            (dry run; its per-GPU memory estimate uses the method's own terms in ``train/dry_run.py``).
        proposer_factory_path: ``factory(export_dir, target_model | None) -> Proposer`` of
            ``eval/spec_decode.py``.
        vllm_serve_check_path: ``check(export_dir)`` raising ValueError when the installed vLLM
            no longer serves it; None: nothing to check.
        target_check_path: ``check(export_dir, target_dir)`` raising when the export does not
            fit the target; None: nothing to check.
        vllm_extra: further ``speculative_config`` keys its exports need (``(key, value)`` pairs).
    """

    name: str
    vllm_method: str
    fsdp_block_classes: tuple[str, ...]
    fsdp_block_parts: tuple[str, ...]
    train_script: str
    supports_gradient_checkpointing: bool
    export_options: tuple[str, ...]
    servable: bool
    recipe_config_path: str
    model_class_path: str
    training_method_path: str
    exporter_path: str
    export_loader_path: str
    export_detector_path: str
    parameter_estimator_path: str
    proposer_factory_path: str
    vllm_serve_check_path: str | None = None
    target_check_path: str | None = None
    vllm_extra: tuple[tuple[str, Any], ...] = ()

    def speculative_config(self, model: str, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` serving an export of this method: ``method``,
        ``model``, ``num_speculative_tokens`` and the method's :attr:`vllm_extra` (P-EAGLE:
        ``parallel_drafting``)."""
        return {"method": self.vllm_method, "model": model, "num_speculative_tokens": num_speculative_tokens,
                **dict(self.vllm_extra)}

    @property
    def recipe_config(self) -> type:
        return _resolve(self.recipe_config_path)

    @property
    def model_class(self) -> type:
        return _resolve(self.model_class_path)

    @property
    def training_method(self) -> type:
        return _resolve(self.training_method_path)

    @property
    def train_module(self) -> str:
        """The importable module of the entry script (its ``main(argv)`` trains)."""
        return "draftsmith." + self.train_script.removesuffix(".py").replace("/", ".")

    @property
    def exporter(self) -> Any:
        return _resolve(self.exporter_path)

    @property
    def export_loader(self) -> Any:
        return _resolve(self.export_loader_path)

    @property
    def export_detector(self) -> Any:
        return _resolve(self.export_detector_path)

    @property
    def parameter_estimator(self) -> Any:
        return _resolve(self.parameter_estimator_path)

    @property
    def proposer_factory(self) -> Any:
        return _resolve(self.proposer_factory_path)

    @property
    def vllm_serve_check(self) -> Any | None:
        return _resolve(self.vllm_serve_check_path) if self.vllm_serve_check_path else None

    @property
    def target_check(self) -> Any | None:
        return _resolve(self.target_check_path) if self.target_check_path else None


_REGISTRY: dict[str, DraftMethodSpec] = {}


def register(spec: DraftMethodSpec) -> DraftMethodSpec:
    """Add ``spec`` to the registry; returns it.

    Raises:
        ValueError: a method of that name is registered already.
    """
    if spec.name in _REGISTRY:
        raise ValueError(f"draft method {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


def registered_methods() -> tuple[str, ...]:
    """Names of the registered draft methods, in registration order."""
    return tuple(_REGISTRY)


def get_method(name: str) -> DraftMethodSpec:
    """The registered method ``name``.

    Raises:
        UnknownMethodError: no method of that name (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownMethodError(f"unknown draft method {name!r}; registered: {', '.join(_REGISTRY)}") from None


def method_of_export(config: dict[str, Any]) -> DraftMethodSpec:
    """The method whose exports look like ``config`` (an exported draft's ``config.json``).

    Raises:
        UnknownMethodError: no registered method recognises it.
    """
    for spec in _REGISTRY.values():
        if spec.export_detector(config):
            return spec
    raise UnknownMethodError(f"architectures {config.get('architectures') or []}, model_type "
                             f"{config.get('model_type')!r} is no registered draft format "
                             f"({', '.join(_REGISTRY)})")


register(DraftMethodSpec(
    name="eagle3",
    vllm_method="eagle3",
    fsdp_block_classes=("Eagle3DecoderLayer",),
    fsdp_block_parts=("attention", "mlp"),
    train_script="train/eagle3.py",
    supports_gradient_checkpointing=True,
    export_options=("legacy", "num_speculative_tokens", "embed_tokens"),
    servable=True,
    recipe_config_path="draftsmith.recipe:Eagle3DraftConfig",
    model_class_path="draftsmith.models.eagle3.model:Eagle3DraftModel",
    training_method_path="draftsmith.train.method_eagle3:Eagle3Method",
    exporter_path="draftsmith.eval.export:export_eagle3",
    export_loader_path="draftsmith.eval.spec_decode:load_eagle3",
    export_detector_path="draftsmith.eval.export:is_eagle3_export",
    parameter_estimator_path="draftsmith.train.dry_run:eagle3_parameter_estimate",
    proposer_factory_path="draftsmith.eval.spec_decode:eagle3_proposer",
    target_check_path="draftsmith.eval.acceptance:check_draft_matches_target",
))
register(DraftMethodSpec(
    name="medusa",
    vllm_method="medusa",
    fsdp_block_classes=("MedusaBlock",),
    fsdp_block_parts=("resblocks",),
    train_script="train/medusa.py",
    supports_gradient_checkpointing=False,
    export_options=(),
    servable=True,
    recipe_config_path="draftsmith.recipe:MedusaDraftConfig",
    model_class_path="draftsmith.models.medusa.model:MedusaModel",
    training_method_path="draftsmith.train.method_medusa:MedusaMethod",
    exporter_path="draftsmith.eval.export_heads:export_medusa",
    export_loader_path="draftsmith.eval.export_heads:load_medusa",
    export_detector_path="draftsmith.eval.export_heads:is_medusa_export",
    parameter_estimator_path="draftsmith.train.dry_run:medusa_parameter_estimate",
    proposer_factory_path="draftsmith.eval.spec_decode:medusa_proposer",
    vllm_serve_check_path="draftsmith.eval.serving.run:check_vllm_serves_medusa",
))
register(DraftMethodSpec(
    name="mlp_speculator",
    vllm_method="mlp_speculator",
    fsdp_block_classes=(),
    fsdp_block_parts=(),
    train_script="train/mlp_speculator.py",
    supports_gradient_checkpointing=False,
    export_options=(),
    servable=False,
    recipe_config_path="draftsmith.recipe:MLPSpeculatorDraftConfig",
    model_class_path="draftsmith.models.mlp_speculator.model:MLPSpeculator",
    training_method_path="draftsmith.train.method_mlp_speculator:MLPSpeculatorMethod",
    exporter_path="draftsmith.eval.export_heads:export_mlp_speculator",
    export_loader_path="draftsmith.eval.export_heads:load_mlp_speculator",
    export_detector_path="draftsmith.eval.export_heads:is_mlp_speculator_export",
    parameter_estimator_path="draftsmith.train.dry_run:mlp_speculator_parameter_estimate",
    proposer_factory_path="draftsmith.eval.spec_decode:mlp_speculator_proposer",
))
register(DraftMethodSpec(
    name="dflash",
    vllm_method="dflash",
    fsdp_block_classes=("DFlashDecoderLayer",),
    fsdp_block_parts=("attention", "mlp"),
    train_script="train/dflash.py",
    supports_gradient_checkpointing=True,
    export_options=(),
    servable=True,
    recipe_config_path="draftsmith.recipe:DFlashDraftConfig",
    model_class_path="draftsmith.models.dflash.model:DFlashDraftModel",
    training_method_path="draftsmith.train.method_dflash:DFlashMethod",
    exporter_path="draftsmith.eval.dflash:export_dflash",
    export_loader_path="draftsmith.eval.dflash:load_dflash",
    export_detector_path="draftsmith.eval.dflash:is_dflash_export",
    parameter_estimator_path="draftsmith.train.dry_run:dflash_parameter_estimate",
    proposer_factory_path="draftsmith.eval.dflash:dflash_proposer",
    target_check_path="draftsmith.eval.dflash:check_dflash_matches_target",
))
register(DraftMethodSpec(
    name="peagle",
    vllm_method="eagle3",
    fsdp_block_classes=("PEagleDecoderLayer",),
    fsdp_block_parts=("attention", "mlp"),
    train_script="train/peagle.py",
    supports_gradient_checkpointing=True,
    export_options=(),
    servable=True,
    recipe_config_path="draftsmith.recipe:PEagleDraftConfig",
    model_class_path="draftsmith.models.peagle.model:PEagleDraftModel",
    training_method_path="draftsmith.train.method_peagle:PEagleMethod",
    exporter_path="draftsmith.eval.peagle:export_peagle",
    export_loader_path="draftsmith.eval.peagle:load_peagle",
    export_detector_path="draftsmith.eval.peagle:is_peagle_export",
    parameter_estimator_path="draftsmith.train.dry_run:peagle_parameter_estimate",
    proposer_factory_path="draftsmith.eval.peagle:peagle_proposer",
    target_check_path="draftsmith.eval.peagle:check_peagle_matches_target",
    vllm_extra=(("parallel_drafting", True),),
))
