"""The recipe against its target, before anything is written: every check that needs the
target's ``config.json`` but no weights.

``draftsmith train --dry-run`` reports on these checks (:func:`preflight`), and the real
``prepare`` and ``train`` make the same checks first (:func:`preflight_run`, which also refuses a
local target folder without weights when a stage will load them). So a recipe the dry run
refuses never gets as far as writing data or starting an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..draft_section import sliding_window_problem
from ..methods import get_method
from ..models.common import LayerGeometry
from ..recipe import Recipe
from ..target import (
    aux_layer_ids,
    check_lengths,
    config_from_json,
    num_decoder_layers,
    text_config,
    validate_geometry,
)
from ..target.resolve import load_config_json
from ..vllm_bridge.eagle3_targets import eagle3_target_problem


def parameter_counts(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> dict[str, int]:
    """The method's parameter counts by part (``methods`` registry estimator), with the draft's
    ``lm_head`` as ``frozen_lm_head`` under ``draft.freeze_lm_head``. Parts named ``frozen_*``
    are not trained (:func:`trainable_parameters`)."""
    counts, _ = get_method(recipe.draft.method).parameter_estimator(recipe, geometry, vocab_size)
    if getattr(recipe.draft, "freeze_lm_head", False) and "lm_head" in counts:
        counts["frozen_lm_head"] = counts.pop("lm_head")
    return counts



@dataclass
class Preflight:
    """What :func:`preflight` read and checked (the target's config, its geometry, the draft's
    parameter counts)."""

    config_json: dict[str, Any]
    source: str
    config: Any
    num_layers: int
    aux_layer_ids: list[int]
    vocab_size: int
    geometry: LayerGeometry
    counts: dict[str, int]


def preflight(recipe: Recipe, target_config: Path | None = None) -> Preflight:
    """Every check of the recipe against its target that needs no weights: the checks the dry
    run makes, which ``prepare`` and ``train`` make too before any stage writes (the target's
    ``config.json`` only; a local target, the embedded one or a shipped copy, else the hub).

    Raises:
        ValueError: aux layer ids invalid for the target; a draft vocab smaller than the target's for
            a method drafting over the full vocab (a larger one is capped, as the vocab stage does); the
            target config lacks a geometry
            key or is not JSON; ``data.max_length`` or ``draft.sliding_window`` beyond the target's
            ``max_position_embeddings``; the method's own geometry checks.
        FileNotFoundError: the target config cannot be read.
    """
    config_json, source = load_config_json(recipe, target_config)
    validate_geometry(config_json, source)
    check_lengths(config_json, [recipe.data.max_length], source)
    config = config_from_json(config_json, recipe.target.trust_remote_code)
    if get_method(recipe.draft.method).vllm_method == "eagle3":  # EAGLE-3 and P-EAGLE read aux hidden states
        problem = eagle3_target_problem(config_json.get("architectures") or [], recipe.target.name_or_path)
        if problem:
            raise ValueError(f"{problem} ({source})")
    text = text_config(config)
    window = sliding_window_problem(getattr(recipe.draft, "sliding_window", None),
                                    getattr(text, "max_position_embeddings", None))
    if window:
        raise ValueError(f"{window} ({source})")
    n = num_decoder_layers(config)
    ids = aux_layer_ids(recipe.data.aux_layer_ids, n)
    V = int(text.vocab_size)
    # a draft vocab above the target's is capped at it, as the vocab stage builds it
    Vd = min(recipe.data.draft_vocab_size, V)
    # the target's shapes for every method's estimator (a method's own options, e.g. the EAGLE-3.1
    # norms, are its parameter_estimator's, which also refuses what its config would)
    geometry = LayerGeometry.from_target(config, Vd, ids)
    counts = parameter_counts(recipe, geometry, V)
    return Preflight(config_json, source, config, n, ids, V, geometry, counts)


class PreflightError(ValueError):
    """The recipe does not fit its target (one line naming the key and the target's value)."""


def preflight_run(recipe: Recipe, stages: Iterable[str] | None = None, run_dir: Path | None = None) -> Preflight:
    """:func:`preflight` for a real ``prepare`` / ``train`` of ``stages`` (None: all): also refuses
    a local target folder without weight files when a stage will load the target (regeneration,
    offline capture, online training). With ``run_dir`` whose ``data/target.json`` names a
    local target folder of the same target, its ``config.json`` is read (no hub access).

    Raises:
        PreflightError (a ValueError): as :func:`preflight`'s ValueError.
        FileNotFoundError: the target config cannot be read; a target folder without weights.
    """
    from ..layout import RunLayout
    from ..target import TargetInfo
    from ..target.load import weights_missing

    config = None
    if run_dir is not None and RunLayout(Path(run_dir)).data.target_info.is_file():
        try:
            info = TargetInfo.read(RunLayout(Path(run_dir)).data.target_info)
        except Exception:  # noqa: BLE001 - an unreadable target.json is reported where it is read
            info = None
        if info is not None and info.name_or_path == recipe.target.name_or_path \
                and (Path(info.path) / "config.json").is_file():
            config = Path(info.path) / "config.json"
    name = recipe.target.name_or_path
    if config is None and not Path(name).expanduser().is_dir():
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        from ..target.resolve import EMBEDDED_PREFIX, resolve_target

        if not name.startswith(EMBEDDED_PREFIX):
            try:
                validate_repo_id(name)
            except HFValidationError:  # a path that does not exist: the target stage's own message
                resolve_target(name)
    try:
        checked = preflight(recipe, config)
    except PreflightError:
        raise
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    stages = set(stages) if stages is not None else {"regenerate", "hidden-states"}
    loads = ("regenerate" in stages and recipe.data.regenerate.enabled) or "hidden-states" in stages
    if loads and Path(name).expanduser().is_dir():
        missing = weights_missing(Path(name).expanduser())
        if missing:
            raise FileNotFoundError(missing)
    return checked
