"""The draft-method registry: every place that depends on ``draft.method`` looks it up here.

A draft method (EAGLE-3, Medusa, MLP speculator, DFlash, P-EAGLE, DSpark, DFlash2, XPress, MTP,
or a third-party one) is ONE package, ``models/<name>/`` for the built-in ones, whose
``__init__.py`` registers one :class:`DraftMethodSpec` (:func:`register`): its facts (name, the
method vLLM serves it as, whether ``vllm serve`` serves it) and its parts, each a lazy
``"module:attr"`` string relative to the package:

- ``recipe_config``: its recipe ``draft`` section (``.recipe``, pydantic, torch-free);
- ``config_class``, ``model_class``, ``format``: the model config, the draft ``nn.Module``
  and the on-disk format (``.config``, ``.model``, ``.format``; a
  :class:`~draftsmith.models.common.DraftFormat`);
- ``training_method``, ``parameter_estimator``, ``activation_estimator``: the training method
  class and the dry run's estimators (``.training``);
- ``proposer_factory``, ``target_check``, ``vllm_serve_check``: the reference decoder's
  proposer, the export-fits-the-target check and the installed vLLM's serve check
  (``.proposer``);
- ``simulator``: the simulated acceptance length of a draft on prepared data
  (``draftsmith simulate``), where the method has one.

A part is imported (and cached) on its first access, so registering a method, listing the
methods and loading a recipe import neither torch nor ``train/`` / ``eval/``, and this module
imports no other module of the package.

Discovery: :data:`METHOD_PACKAGES` lists the built-in method packages, in registration order
(the one line a built-in method adds); installed third-party method packages are declared in
the entry-point group :data:`ENTRY_POINT_GROUP` (value: the package module, e.g.
``toy = toy_draft``) and registered after the built-ins.

A plug-in fails alone: one whose import fails (a missing module, an error in it, a name another
package registered first, registering twice) is left out with one logged warning naming its
entry point and distribution (:func:`plugin_load_failure`), every other method keeps working, and
asking for it (:func:`get_method` with the entry point's name) is an :class:`UnknownMethodError`
naming the plug-in and why it was not loaded. Two built-in packages registering one name stay a
programming error (ValueError).

    spec = get_method(recipe.draft.method)
    model = spec.model_class(config)
    spec.format.export(...)   # through draftsmith.eval.export.export(ckpt, out)
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

METHOD_PACKAGES: tuple[str, ...] = (
    "draftsmith.models.eagle3",
    "draftsmith.models.medusa",
    "draftsmith.models.mlp_speculator",
    "draftsmith.models.dflash",
    "draftsmith.models.peagle",
    "draftsmith.models.dspark",
    "draftsmith.models.dflash2",
    "draftsmith.models.xpress",
    "draftsmith.models.mtp",
)
"""The built-in method packages, in registration order: importing each registers its method."""

ENTRY_POINT_GROUP = "draftsmith.methods"
"""The entry-point group of third-party method packages (value: the package module)."""

PARTS: tuple[str, ...] = ("recipe_config", "config_class", "model_class", "format", "training_method",
                          "parameter_estimator", "activation_estimator", "proposer_factory", "target_check",
                          "vllm_serve_check", "simulator")
"""The parts a method package may declare in :attr:`DraftMethodSpec.parts`."""


class UnknownMethodError(ValueError):
    """A draft method name (or export / checkpoint format) no registered method has; the
    message lists the registered names."""


@dataclass
class DraftMethodSpec:
    """One draft method, registered by its package's ``__init__.py``.

    Attributes:
        name: ``draft.method`` in recipes, ``method`` in ``draft_config.json`` of checkpoints.
        package: the module name of the method's package (``__name__`` of its ``__init__``);
            the parts are resolved relative to it.
        vllm_method: ``speculative_config["method"]`` vLLM serves the export as.
        servable: ``vllm serve`` serves its exports (the serving benchmark, acceptance).
        vllm_extra: further ``speculative_config`` keys its exports need (``(key, value)`` pairs).
        vllm_releases: the checked vLLM releases
            (:data:`draftsmith.vllm_bridge.releases.CHECKED_RELEASES`) whose vLLM has the method (its
            ``speculative_config`` method and model code), oldest first; None: not checked (a
            third-party method that does not say).
        vllm_remedy: what to do instead where installing the last release that has the method
            does not serve it either (one clause of the refusal), else None.
        architecture_releases: ``(architecture, releases)`` pairs for export ``architectures`` only
            some checked releases load (XPress: ``Qwen3XPressModel``, 0.33 on).
        chain_drafts: its K = n proposal is the first n tokens of its K = n + 1 proposal (EAGLE-3,
            Medusa, the MLP speculator), so one measurement at K gives the acceptance of every
            smaller K; False for block and parallel drafters, which plan all K slots together (a
            speculation profile's ``accept_length_model``: ``chain_analytic`` or ``measured_per_k``).
        parts: part name (:data:`PARTS`) -> ``"module:attr"`` (module relative to ``package``,
            e.g. ``".model:DSparkDraftModel"``), or the object itself; a part left out is None.

    The parts, read through the properties of the same name (imported on first access):
        recipe_config: the pydantic class of its recipe ``draft`` section.
        config_class: the model config (built from ``draft_config.json``'s ``config``).
        model_class: the draft ``nn.Module``, built from its config; its
            ``_no_split_modules`` are the FSDP wrap units.
        format: the on-disk format (:class:`~draftsmith.models.common.DraftFormat`).
        training_method: the training method class (``name``, ``build_model``, ...).
        parameter_estimator: ``estimator(recipe, geometry, vocab_size) -> (parameter counts by
            part, an upper bound of unchunked logits bytes per micro-batch)`` (dry run; ``geometry``
            a :class:`~draftsmith.models.common.LayerGeometry` of the target).
        activation_estimator: ``estimator(recipe, shapes, trainable) -> bytes by part`` of the
            activations at the step's peak (dry run; ``shapes`` a
            :class:`~draftsmith.train.dry_run.Shapes`, ``trainable`` the trainable parameter
            count); None: the dry run counts the parameter estimator's logits bytes instead.
        proposer_factory: ``factory(export_dir, target_model | None) -> Proposer`` of
            ``eval/spec_decode.py``.
        target_check: ``check(export_dir, target_dir)`` raising when the export does not fit the
            target; None: nothing to check.
        vllm_serve_check: ``check(export_dir)`` raising ValueError when the installed vLLM no
            longer serves it; None: nothing to check.
        simulator: ``simulate(draft, data_dir, k, temperatures, batch_size, draft_sampling) ->
            metrics`` (``draftsmith simulate``); None: the method simulates none.
    """

    name: str
    package: str
    vllm_method: str
    servable: bool
    vllm_extra: tuple[tuple[str, Any], ...] = ()
    vllm_releases: tuple[str, ...] | None = None
    vllm_remedy: str | None = None
    architecture_releases: tuple[tuple[str, tuple[str, ...]], ...] = ()
    chain_drafts: bool = False
    parts: dict[str, Any] = field(default_factory=dict, repr=False)
    _resolved: dict[str, tuple[Any, Any]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def part(self, key: str) -> Any:
        """The part ``key`` (:data:`PARTS`): its ``"module:attr"`` imported relative to
        :attr:`package` on first use and cached; None when the method declares none."""
        ref = self.parts.get(key)
        cached = self._resolved.get(key)
        if cached is not None and cached[0] is ref:
            return cached[1]
        value = ref
        if isinstance(ref, str):
            module, _, attr = ref.partition(":")
            value = getattr(importlib.import_module(module, self.package), attr)
        self._resolved[key] = (ref, value)
        return value

    @property
    def recipe_config(self) -> type:
        return self.part("recipe_config")

    @property
    def config_class(self) -> type:
        return self.part("config_class")

    @property
    def model_class(self) -> type:
        return self.part("model_class")

    @property
    def format(self) -> Any:
        return self.part("format")

    @property
    def training_method(self) -> type:
        return self.part("training_method")

    @property
    def parameter_estimator(self) -> Callable[..., Any]:
        return self.part("parameter_estimator")

    @property
    def activation_estimator(self) -> Callable[..., Any] | None:
        return self.part("activation_estimator")

    @property
    def proposer_factory(self) -> Callable[..., Any]:
        return self.part("proposer_factory")

    @property
    def target_check(self) -> Callable[..., Any] | None:
        return self.part("target_check")

    @property
    def vllm_serve_check(self) -> Callable[..., Any] | None:
        return self.part("vllm_serve_check")

    @property
    def simulator(self) -> Callable[..., Any] | None:
        return self.part("simulator")


_REGISTRY: dict[str, DraftMethodSpec] = {}
_STATE = {"loaded": False, "loading": False}
_NOT_LOADED: dict[str, str] = {}  # entry-point name -> why that method plug-in was not loaded (one line)


def _builtin(package: str) -> bool:
    return package in METHOD_PACKAGES


def register(spec: DraftMethodSpec) -> DraftMethodSpec:
    """Add ``spec`` (called once by each method package's ``__init__.py``); returns it.

    Raises:
        ValueError: a method of that name is registered already (one line naming both
            packages), its package registered another method already, or ``spec.parts``
            names a part not in :data:`PARTS`. Raised inside a plug-in's import, the registry
            leaves that plug-in out with one warning (:func:`registered_methods`); a built-in
            method whose name a plug-in imported earlier took replaces it, with a warning.
    """
    have = _REGISTRY.get(spec.name)
    if have is not None and have.package == spec.package:
        raise ValueError(f"draft method {spec.name!r} is registered twice by {spec.package}")
    if have is not None and _builtin(spec.package) and not _builtin(have.package):
        # a plug-in imported before the registry loaded took a built-in name: the built-in is kept
        log.warning("draft method %r is registered by both %s and %s: %s's is dropped", spec.name, have.package,
                    spec.package, have.package)
        del _REGISTRY[spec.name]
        have = None
    if have is not None:
        raise ValueError(f"draft method {spec.name!r} is registered by both {have.package} and {spec.package}")
    other = next((s.name for s in _REGISTRY.values() if s.package == spec.package), None)
    if other is not None:
        raise ValueError(f"{spec.package} registers draft method {spec.name!r} after {other!r}: a method "
                         "package registers one method")
    unknown = sorted(set(spec.parts) - set(PARTS))
    if unknown:
        raise ValueError(f"draft method {spec.name!r} of {spec.package}: unknown parts {', '.join(unknown)} "
                         f"(known: {', '.join(PARTS)})")
    _REGISTRY[spec.name] = spec
    return spec


def _entry_points() -> list[Any]:
    """The installed :data:`ENTRY_POINT_GROUP` entry points, the first of each package module."""
    from importlib.metadata import entry_points

    try:
        found = entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # unreadable metadata of some installed distribution
        log.warning("method plug-ins (entry points %s) were not loaded: cannot read the installed packages' entry "
                    "points: %s", ENTRY_POINT_GROUP, _one_line(exc))
        return []
    first: dict[str, Any] = {}
    for ep in found:
        first.setdefault(ep.module, ep)
    return list(first.values())


def _one_line(exc: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _describe(ep: Any) -> str:
    """``method plug-in 'toy' (entry point draftsmith.methods: toy = toy_draft from distribution toy-draft 0.1)``."""
    source = ""
    dist = getattr(ep, "dist", None)
    if dist is not None:
        try:
            source = f" from distribution {dist.metadata['Name']} {dist.version}"
        except Exception:  # metadata without a name or version: the entry point says enough
            pass
    return f"method plug-in {ep.name!r} (entry point {ENTRY_POINT_GROUP}: {ep.name} = {ep.value}{source})"


def _load_plugin(ep: Any) -> None:
    """Import the package of entry point ``ep`` (it registers its method); a failure leaves it out,
    whatever it registered before failing, with one warning and a note for :func:`get_method`."""
    before = set(_REGISTRY)
    try:
        importlib.import_module(ep.module)
        why = None
        if not any(s.package == ep.module or s.package.startswith(ep.module + ".")
                   or ep.module.startswith(s.package + ".") for s in _REGISTRY.values()):
            why = (f"importing {ep.module} registered no draft method (its package calls "
                   "draftsmith.methods.register(DraftMethodSpec(...)))")
    except Exception as exc:
        why = _one_line(exc)
    if why is None:
        return
    for name in set(_REGISTRY) - before:
        del _REGISTRY[name]
    _NOT_LOADED[ep.name] = f"{_describe(ep)} was not loaded: {why}"
    log.warning("%s", _NOT_LOADED[ep.name])


def _load() -> None:
    """Import the built-in method packages, then the entry points' (each registers its method;
    one that fails is left out with a warning, once per process), and order the registry as they
    are listed, whatever imported a package first."""
    if _STATE["loaded"] or _STATE["loading"]:
        return
    _STATE["loading"] = True
    try:
        for module in METHOD_PACKAGES:
            importlib.import_module(module)
        plugins = _entry_points()
        for ep in plugins:
            _load_plugin(ep)
        packages = [*METHOD_PACKAGES, *(ep.module for ep in plugins)]
        rank = {package: i for i, package in enumerate(packages)}
        ordered = sorted(_REGISTRY.values(), key=lambda spec: rank.get(spec.package, len(rank)))
        _REGISTRY.clear()
        _REGISTRY.update((spec.name, spec) for spec in ordered)
        _STATE["loaded"] = True
    finally:
        _STATE["loading"] = False


def registered_methods() -> tuple[str, ...]:
    """Names of the registered draft methods, in registration order: :data:`METHOD_PACKAGES`'
    order, then the entry points' (loads the method packages' ``__init__`` modules, which import
    nothing heavy)."""
    _load()
    return tuple(_REGISTRY)


def plugin_load_failure(name: str) -> str | None:
    """Why the method plug-in of entry point ``name`` (the method it would register, by
    convention) was not loaded, in one line naming the entry point and its distribution; None
    when no such plug-in failed."""
    _load()
    return _NOT_LOADED.get(name)


def _not_loaded_note() -> str:
    return f"; method plug-ins not loaded: {', '.join(map(repr, _NOT_LOADED))}" if _NOT_LOADED else ""


def get_method(name: str) -> DraftMethodSpec:
    """The registered method ``name``.

    Raises:
        UnknownMethodError: no method of that name (the message lists the registered ones), or
            the plug-in of that name failed to load (the message says why).
    """
    _load()
    if name not in _REGISTRY:
        if name in _NOT_LOADED:
            raise UnknownMethodError(f"draft method {name!r} is not available: {_NOT_LOADED[name]}; fix or "
                                     f"uninstall that plug-in (registered: {', '.join(_REGISTRY)})")
        raise UnknownMethodError(f"unknown draft method {name!r}; registered: {', '.join(_REGISTRY)}"
                                 + _not_loaded_note())
    return _REGISTRY[name]


def method_of_export(config: dict[str, Any]) -> DraftMethodSpec:
    """The method whose exports look like ``config`` (an exported draft's ``config.json``): the
    first, in registration order, whose format's detector accepts it, unless a format that
    refines that method's (:attr:`~draftsmith.models.common.DraftFormat.refines`: DSpark's
    refines DFlash's) accepts it too: then the config is not the refined method's.

    Raises:
        UnknownMethodError: no registered method recognises it.
    """
    specs = [get_method(name) for name in registered_methods()]
    accepted = [spec for spec in specs if spec.format.detect(config)]
    refined = {spec.format.refines for spec in accepted}
    for spec in accepted:
        if spec.name not in refined:
            return spec
    raise UnknownMethodError(f"architectures {config.get('architectures') or []}, model_type "
                             f"{config.get('model_type')!r} is no registered draft format "
                             f"({', '.join(registered_methods())}{_not_loaded_note()})")
