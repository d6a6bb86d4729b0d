"""The draft-method registry: every place that depends on ``draft.method`` looks it up here.

A method (EAGLE-3, Medusa, MLP speculator, DFlash, P-EAGLE, DSpark, DFlash2) is one :class:`DraftMethodSpec`
holding real objects, filled in by the layer that owns each part, in the package's import
direction (``models`` <- ``train`` <- ``eval``):

- ``models/<name>/__init__.py`` registers the method (:func:`register`): its model and config
  classes, its on-disk format (``models/<name>/format.py``, a
  :class:`~draftsmith.models.common.DraftFormat`: tensor set, exporter, loader, the one detector of
  its exports, its target-fit facts and its model-card text) and the facts vLLM serves it by;
- ``recipe.py`` attaches its recipe ``draft`` section (:func:`attach`, ``recipe_config``) as it
  defines it;
- ``train/method_registry.py`` attaches the training method class and the dry run's parameter
  estimator;
- ``eval/method_registry.py`` attaches the reference decoder's proposer factory, the target
  check and (Medusa) the installed vLLM's serve check.

:data:`METHOD_PACKAGES` is the one list of method packages, in registration order;
:data:`LAYER_MODULES` the modules that attach the train and eval parts. A lookup loads what it
needs on first use (models on :func:`get_method`, the train / eval parts on first access of one
of theirs), so importing this module imports neither torch nor ``train/`` / ``eval/``, and a
layer never imports a layer above it. Adding a method is one ``models/<name>/`` package, one
line here, and its parts in the train and eval registries.

    spec = get_method(recipe.draft.method)
    model = spec.model_class(config)
    spec.format.export(...)   # through draftsmith.eval.export.export(ckpt, out)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

METHOD_PACKAGES: tuple[str, ...] = ("eagle3", "medusa", "mlp_speculator", "dflash", "peagle", "dspark", "dflash2")
"""The draft methods, in registration order: ``draftsmith.models.<name>`` registers each."""

LAYER_MODULES: dict[str, str] = {"train": "draftsmith.train.method_registry",
                                 "eval": "draftsmith.eval.method_registry"}
"""The module of each upper layer that attaches that layer's parts of every method."""

# the parts each upper layer attaches (the rest: models/<name> and recipe.py)
_LAYER_PARTS = {"training_method": "train", "parameter_estimator": "train",
                "proposer_factory": "eval", "target_check": "eval", "vllm_serve_check": "eval"}


class UnknownMethodError(ValueError):
    """A draft method name (or export / checkpoint format) no registered method has; the
    message lists the registered names."""


@dataclass
class DraftMethodSpec:
    """One draft method.

    Attributes (registered by ``models/<name>``):
        name: ``draft.method`` in recipes, ``method`` in ``draft_config.json`` of checkpoints.
        vllm_method: ``speculative_config["method"]`` vLLM serves the export as.
        config_class: the model config (built from ``draft_config.json``'s ``config``).
        model_class: the draft ``nn.Module``, built from its config; its
            ``_no_split_modules`` are the FSDP wrap units.
        format: the on-disk format (:class:`~draftsmith.models.common.DraftFormat`).
        servable: ``vllm serve`` serves its exports (the serving benchmark, acceptance).
        vllm_extra: further ``speculative_config`` keys its exports need (``(key, value)`` pairs).

    Attached by the upper layers (None until then; read through the properties of the same name):
        recipe_config: the pydantic class of its recipe ``draft`` section (``recipe.py``).
        training_method: the ``train/method_<name>.py`` class (``name``, ``build_model``, ...).
        parameter_estimator: ``estimator(recipe, eagle3_cfg, vocab_size) -> (parameter counts by
            part, an upper bound of unchunked logits bytes per micro-batch)`` (dry run).
        proposer_factory: ``factory(export_dir, target_model | None) -> Proposer`` of
            ``eval/spec_decode.py``.
        target_check: ``check(export_dir, target_dir)`` raising when the export does not fit the
            target; None: nothing to check.
        vllm_serve_check: ``check(export_dir)`` raising ValueError when the installed vLLM no
            longer serves it; None: nothing to check.
    """

    name: str
    vllm_method: str
    config_class: type
    model_class: type
    format: Any
    servable: bool
    vllm_extra: tuple[tuple[str, Any], ...] = ()
    parts: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def train_module(self) -> str:
        """The importable module of the thin entry script ``train/<name>.py`` (its ``main(argv)``
        trains; ``accelerate launch`` runs the file)."""
        return f"draftsmith.train.{self.name}"

    def _part(self, key: str) -> Any:
        layer = _LAYER_PARTS.get(key)
        if layer is not None:
            importlib.import_module(LAYER_MODULES[layer])
        return self.parts.get(key)

    @property
    def recipe_config(self) -> type:
        importlib.import_module("draftsmith.recipe")  # defines the sections and attaches them
        return self.parts["recipe_config"]

    @property
    def training_method(self) -> type:
        return self._part("training_method")

    @property
    def parameter_estimator(self) -> Callable[..., Any]:
        return self._part("parameter_estimator")

    @property
    def proposer_factory(self) -> Callable[..., Any]:
        return self._part("proposer_factory")

    @property
    def target_check(self) -> Callable[..., Any] | None:
        return self._part("target_check")

    @property
    def vllm_serve_check(self) -> Callable[..., Any] | None:
        return self._part("vllm_serve_check")


_REGISTRY: dict[str, DraftMethodSpec] = {}
_PENDING: dict[str, dict[str, Any]] = {}  # parts attached before the method package registered


def register(spec: DraftMethodSpec) -> DraftMethodSpec:
    """Add ``spec`` (called by ``models/<name>/__init__.py``); returns it.

    Raises:
        ValueError: a method of that name is registered already, or one not in :data:`METHOD_PACKAGES`.
    """
    if spec.name in _REGISTRY:
        raise ValueError(f"draft method {spec.name!r} is registered already")
    if spec.name not in METHOD_PACKAGES:
        raise ValueError(f"draft method {spec.name!r} is not in draftsmith.methods.METHOD_PACKAGES")
    spec.parts.update(_PENDING.pop(spec.name, {}))
    _REGISTRY[spec.name] = spec
    return spec


def attach(name: str, **parts: Any) -> None:
    """Attach an upper layer's ``parts`` (``recipe_config``, ``training_method``,
    ``parameter_estimator``, ``proposer_factory``, ``target_check``, ``vllm_serve_check``) to
    method ``name``; parts attached before the method package is loaded wait for it.

    Raises:
        ValueError: a method not in :data:`METHOD_PACKAGES`, or a part attached twice.
    """
    if name not in METHOD_PACKAGES:
        raise ValueError(f"draft method {name!r} is not in draftsmith.methods.METHOD_PACKAGES")
    have = _REGISTRY[name].parts if name in _REGISTRY else _PENDING.setdefault(name, {})
    twice = sorted(set(parts) & set(have))
    if twice:
        raise ValueError(f"draft method {name!r}: {', '.join(twice)} attached twice")
    have.update(parts)


def attached_part(name: str, key: str) -> Any:
    """The part ``key`` attached to method ``name`` (None: none), without loading the method
    packages: ``recipe.py`` reads its own sections so, and loading a recipe stays free of torch."""
    return (_REGISTRY[name].parts if name in _REGISTRY else _PENDING.get(name, {})).get(key)


def _load() -> None:
    for name in METHOD_PACKAGES:
        if name not in _REGISTRY:
            importlib.import_module(f"draftsmith.models.{name}")


def registered_methods() -> tuple[str, ...]:
    """Names of the registered draft methods, in registration order."""
    return METHOD_PACKAGES


def get_method(name: str) -> DraftMethodSpec:
    """The registered method ``name``.

    Raises:
        UnknownMethodError: no method of that name (the message lists the registered ones).
    """
    if name not in METHOD_PACKAGES:
        raise UnknownMethodError(f"unknown draft method {name!r}; registered: {', '.join(METHOD_PACKAGES)}")
    _load()
    return _REGISTRY[name]


def method_of_export(config: dict[str, Any]) -> DraftMethodSpec:
    """The method whose exports look like ``config`` (an exported draft's ``config.json``): the
    one whose format's detector accepts it.

    Raises:
        UnknownMethodError: no registered method recognises it.
    """
    _load()
    for name in METHOD_PACKAGES:
        spec = _REGISTRY[name]
        if spec.format.detect(config):
            return spec
    raise UnknownMethodError(f"architectures {config.get('architectures') or []}, model_type "
                             f"{config.get('model_type')!r} is no registered draft format "
                             f"({', '.join(METHOD_PACKAGES)})")
