"""Warm start (``draft.init_from``): fine-tune an existing EAGLE-3 draft instead of starting
from scratch (P-EAGLE's, :mod:`draftsmith.models.peagle.warm_start`, builds on this one).

The draft to start from is an export folder (``config.json`` + ``model.safetensors``, the
speculators format vLLM loads, written by draftsmith or by the speculators library, whose
checkpoints use the same tensor names; the legacy ``LlamaForCausalLMEagle3`` layout too) or a
draftsmith training checkpoint (``checkpoints/step-N`` or ``checkpoints/best``). A draft of
another method, of a kind draftsmith does not train, or with an option it does not train is
refused in one line naming the file (docs/speculators_interop.md).

Before anything is trained it must fit this run: its hidden size, aux-state width and vocab
size must be the target's, its aux layer ids the ones this run's hidden states were captured
at (``RUN_DIR/data/target.json``), its verifier architecture (when recorded) the target's, and
its draft vocab must share tokens with this run's. The draft keeps its own layer geometry
(decoder layer: Llama, Qwen3 or MLA; intermediate size, heads, attention window),
``norm_before_residual`` and EAGLE-3.1 options; its
``lm_head`` rows are carried over by target token id into this run's draft vocab (``d2t``), rows of
tokens it did not have keep the target's ``lm_head`` rows (``draft.init_lm_head_from_target``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ...layout import DRAFT_CONFIG_FILE, DraftLoadError, ExportError, read_export
from ...target import TargetInfo
from ...train.checkpoint import read_draft
from ...train.method_base import MethodSetupError
from ..common import DraftFit, TargetFit
from ..common import fit_problems as common_fit_problems
from .config import EAGLE31_OPTIONS, Eagle3Config

log = logging.getLogger("draftsmith.train")

_NOT_LOADED = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")  # remapped or the target's


class WarmStartError(MethodSetupError):
    """``draft.init_from`` names no readable draft of the run's method (EAGLE-3, P-EAGLE), one with
    an option draftsmith does not train, or one that does not fit this run."""


@dataclasses.dataclass
class InitDraft:
    """A draft to start from: its config, tensors (float32, ``layers.0.*`` names) and path."""

    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    path: Path
    verifier: dict[str, Any]


def read_init_draft(path: str | Path, method: str = "eagle3",
                    parse: Callable[[dict[str, Any]], Eagle3Config] | None = None) -> InitDraft:
    """Read ``draft.init_from``: an export folder or a draftsmith training checkpoint of ``method``.

    An export folder is draftsmith's or the speculators library's (docs/speculators_interop.md):
    its ``config.json`` must be a ``method`` draft (:func:`refuse_other_method`) that ``parse``
    reads; its tensors keep their names (legacy ``midlayer.*`` read as ``layers.0.*``).

    Args:
        method: the run's ``draft.method`` (``eagle3``; ``peagle`` through
            :mod:`draftsmith.models.peagle.warm_start`).
        parse: the ``config.json`` reader (default :func:`eagle3_init_config`).

    Raises:
        WarmStartError: naming the path (and the file), for a missing folder, a draft of another
            method or of one draftsmith does not train, an option draftsmith does not train, or
            unreadable weights.
    """
    from safetensors import SafetensorError

    path = Path(path).expanduser()
    if not path.is_dir():
        raise WarmStartError(f"draft.init_from={str(path)!r}: no such folder (a {method} export or checkpoint)")
    parse = parse or eagle3_init_config
    try:
        if (path / DRAFT_CONFIG_FILE).is_file():  # our training checkpoint
            try:
                ckpt = read_draft(path, method)
            except ExportError as exc:
                raise DraftLoadError(str(exc)) from None
            config = ckpt.config
            tensors = {k: v.float() if v.is_floating_point() else v for k, v in ckpt.state.items()}
            target = ckpt.meta.target
            verifier = {"name_or_path": target.get("name_or_path"), "architectures": target.get("architectures", [])}
        else:
            raw_config: dict[str, Any] = {}

            def checked(raw: dict[str, Any]) -> Eagle3Config:
                raw_config.update(raw)
                refuse_other_method(raw, method)
                return parse(raw)

            config, tensors, _ = read_export(path, checked)
            verifier = Eagle3Config.export_facts(raw_config).verifier
    except (DraftLoadError, SafetensorError) as exc:
        raise WarmStartError(f"draft.init_from: {exc}") from None
    return InitDraft(config, tensors, path, verifier)


def refuse_other_method(config: dict[str, Any], method: str) -> None:
    """Refuse an export ``config.json`` that is no ``method`` draft: one of another registered
    method (:func:`draftsmith.methods.method_of_export`), or of a kind draftsmith does not train
    (a speculators ``mtp`` draft, an unknown ``speculators_model_type``).

    Raises:
        ValueError: one line naming the ``speculators_model_type`` (or ``architectures``) and ``method``.
    """
    from ...methods import UnknownMethodError, method_of_export

    kind = config.get("speculators_model_type")
    what = f"speculators_model_type {kind!r}" if kind else f"architectures {config.get('architectures') or []}"
    try:
        found = method_of_export(config).name
    except UnknownMethodError:
        raise ValueError(f"{what}: draftsmith trains no such draft (draft.method {method} starts from {method} "
                         "drafts only)") from None
    if found != method:
        raise ValueError(f"{what}: its method is {found}, and draft.method {method} starts from {method} drafts only")


def eagle3_init_config(raw: dict[str, Any]) -> Eagle3Config:
    """The :class:`Eagle3Config` of an EAGLE-3 export to warm-start from (either format), refusing a
    speculators ``embed_requires_grad: true``: that draft trained its own embedding, and an EAGLE-3
    run trains with the target's (the checkpoint's ``embed_tokens.weight`` is not loaded).

    Raises:
        KeyError / ValueError: as :meth:`Eagle3Config.from_export`; the embedding option, named.
    """
    if raw.get("embed_requires_grad"):
        raise ValueError("embed_requires_grad true: the draft trained its own embedding, and draft.method eagle3 "
                         "trains with the target's embedding")
    return Eagle3Config.from_export(raw)


def fit_problems(init: InitDraft, target_info: TargetInfo, d2t: torch.Tensor) -> list[str]:
    """What keeps ``init`` from being trained on this run's data (empty: it fits): the one target
    rule (:func:`~draftsmith.models.common.fit_problems`) with this run's aux layer ids, plus a
    draft vocab that must share tokens with this run's.

    Args:
        target_info: ``RUN_DIR/data/target.json`` (hidden_size, vocab_size, aux_layer_ids,
            architectures).
        d2t: this run's draft vocab offsets ``(Vd,)``.
    """
    c = init.config
    V = int(target_info.vocab_size)
    draft = DraftFit(hidden_size=c.hidden_size, target_hidden_size=c.target_hidden_size or c.hidden_size,
                     vocab_size=c.vocab_size, draft_vocab_size=None, aux_layer_ids=list(c.aux_layer_ids),
                     verifier=init.verifier)
    target = TargetFit(hidden_size=int(target_info.hidden_size), vocab_size=V,
                       architectures=list(target_info.architectures or []),
                       aux_layer_ids=list(target_info.aux_layer_ids))
    problems = common_fit_problems(draft, target)
    if "d2t" in init.tensors and c.vocab_size == V:
        shared = len(set(target_ids(init.tensors["d2t"]).tolist()) & set(target_ids(d2t).tolist()))
        if shared == 0:
            problems.append("its draft vocab shares no token with this run's")
    return problems


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """``(Vd,)`` the target token id of every draft id (``draft id + d2t[draft id]``)."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def warm_config(init: InitDraft, run_config: Eagle3Config) -> Eagle3Config:
    """The config to train: the init draft's layer (``draft.layer``) and geometry, residual norm,
    EAGLE-3.1 options and attention window, this run's draft vocab size (a recipe that says otherwise is warned about, naming the key)."""
    for key in ("layer", "num_layers", "norm_before_residual", *EAGLE31_OPTIONS, "sliding_window"):
        if getattr(init.config, key) != getattr(run_config, key):
            log.warning("draft.init_from: %s=%s as the draft was trained (the recipe says %s)",
                        key, getattr(init.config, key), getattr(run_config, key))
    return dataclasses.replace(init.config, draft_vocab_size=run_config.draft_vocab_size,
                               extra=dict(run_config.extra))


@torch.no_grad()
def load_init_weights(model: torch.nn.Module, init: InitDraft, keep: tuple[str, ...] = ()) -> dict[str, int]:
    """Copy ``init``'s weights into ``model`` (built with :func:`warm_config`, target embedding and
    vocab mapping installed): every other tensor of ``model.state_dict()`` under its own name, as
    is, ``lm_head`` rows by target token id.

    Args:
        keep: ``model`` tensors kept as they are when ``init`` has none (P-EAGLE's trained
            embedding, which then starts as the target's).

    Returns:
        ``{"tensors": copied, "lm_head_rows": carried over, "lm_head_rows_new": kept from the target}``.

    Raises:
        WarmStartError: a tensor the model needs is missing or has another shape.
    """
    own = model.state_dict()
    wanted = [k for k in own if k not in _NOT_LOADED and (k in init.tensors or k not in keep)]
    missing = [k for k in wanted if k not in init.tensors]
    if missing:
        raise WarmStartError(f"draft.init_from={init.path}: missing tensors {missing}")
    for k in wanted:
        src = init.tensors[k]
        if tuple(src.shape) != tuple(own[k].shape):
            raise WarmStartError(f"draft.init_from={init.path}: {k} has shape {list(src.shape)}, this draft "
                                 f"needs {list(own[k].shape)}")
        own[k].copy_(src.to(own[k].dtype))
    rows_new = model.lm_head.weight.shape[0]
    carried = 0
    if "lm_head.weight" in init.tensors:
        src_rows = init.tensors["lm_head.weight"]
        src_ids = target_ids(init.tensors["d2t"]) if "d2t" in init.tensors else torch.arange(src_rows.shape[0])
        where = {int(t): i for i, t in enumerate(src_ids.tolist())}
        for i, t in enumerate(target_ids(model.d2t).tolist()):
            j = where.get(int(t))
            if j is not None:
                model.lm_head.weight[i].copy_(src_rows[j].to(model.lm_head.weight.dtype))
                carried += 1
    log.info("draft.init_from=%s: %d tensors loaded, lm_head rows carried over for %d of %d draft tokens",
             init.path, len(wanted), carried, rows_new)
    return {"tensors": len(wanted), "lm_head_rows": carried, "lm_head_rows_new": rows_new - carried}
