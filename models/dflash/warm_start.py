"""Warm start of the DFlash family (``draft.init_from``): fine-tune an existing DFlash, DSpark or
DFlash2 draft instead of starting from scratch.

The draft to start from is an export folder (``config.json`` + ``model.safetensors``: draftsmith's
own, a speculators 0.9 checkpoint as its ``save_pretrained`` writes it, or a z-lab / ModelOpt
Format B folder) or a draftsmith training checkpoint (``checkpoints/step-N``). Its ``config.json``
is read by the method's own reader (the registry's ``config_class.from_export``), so a draft of
another method, or an option draftsmith does not train (``sample_from_anchor`` on a DFlash draft,
a causal sliding window, a gated Markov head, ...), is refused in one line naming the file.

Tensor names are the same on both sides (docs/speculators_interop.md, "DFlash and DSpark"):
``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``, DSpark's
``markov_head.*`` / ``confidence_head.*`` and DFlash2's convolutions and ``candidate_selector.*``
are copied as they are; ``embed_tokens.weight`` (the target's is shared) and speculators' frozen
``verifier_lm_head.weight`` / ``verifier_norm.weight`` are dropped; any other tensor is refused.

Before anything is trained the draft must fit the run (:func:`fit_problems`: the target's sizes
and architecture, the aux layer ids this run's hidden states were captured at, a draft vocab
sharing tokens with this run's, its mask token absent from the data) and the recipe
(:func:`config_problems`: ``draft.num_layers``, ``draft.block_size`` and every other key of the
method's section, and the layer geometry draftsmith builds from the target). Rows over the draft
vocab (``lm_head``, DSpark's ``markov_w2``) are carried over by target token id into this run's
draft vocab; rows of tokens the draft did not have keep their initialisation (the target's
``lm_head`` rows with ``draft.init_lm_head_from_target``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from ...layout import DRAFT_CONFIG_FILE, DraftLoadError, ExportError, read_export, read_export_config
from ...methods import UnknownMethodError, get_method, method_of_export
from ...target import TargetInfo
from ...train.checkpoint import read_draft
from ...train.mask_token import MaskTokenError
from ...train.method_base import MethodSetupError
from ..common import DraftFit, TargetFit
from ..common import fit_problems as common_fit_problems
from .config import DFlashConfig, layer_window

log = logging.getLogger("draftsmith.train")

DROPPED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
"""Tensors a DFlash-family checkpoint may hold that the draft takes from the target instead."""
DRAFT_VOCAB_ROWS = ("lm_head.weight", "markov_head.markov_w2.weight")
"""Tensors with one row per draft-vocab token, carried over by target token id."""
RUN_FIELDS = ("draft_vocab_size", "num_target_layers", "max_position_embeddings", "mask_token_id")
"""Config fields that are this run's (the draft vocab, the target's layer count, RoPE's position
limit) or taken from the draft (the mask token), never compared."""
FIT_FIELDS = ("hidden_size", "target_hidden_size", "vocab_size", "aux_layer_ids")  # fit_problems' own


class WarmStartError(MethodSetupError):
    """``draft.init_from`` names no readable draft of the run's method, or one that does not fit the run."""


@dataclasses.dataclass
class InitDraft:
    """A DFlash-family draft to start from.

    Attributes:
        config: its config (the method's config class).
        tensors: its tensors by draftsmith name, floating ones float32.
        path: the folder it was read from.
        verifier: the speculators ``verifier`` record (``name_or_path``, ``architectures``), or {}.
    """

    config: DFlashConfig
    tensors: dict[str, torch.Tensor]
    path: Path
    verifier: dict[str, Any]


def trained_layout(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json``) as its draft was trained. speculators trains full-attention
    layers bidirectionally whatever ``sliding_window_non_causal`` says (the key makes only its
    windowed layers causal), but vLLM reads ``false`` as causal on every layer, so the reader
    refuses it; a speculators checkpoint without windowed layers is read with the key true (what
    this run's export writes)."""
    layer = config.get("transformer_layer_config")
    if (config.get("sliding_window_non_causal") is False and isinstance(layer, dict)
            and layer_window(layer) is None):
        log.info("draft.init_from: sliding_window_non_causal false on full-attention layers, read as the draft "
                 "was trained (bidirectional); this run's export writes it true")
        return dict(config, sliding_window_non_causal=True)
    return config


def read_init_draft(path: str | Path, method: str) -> InitDraft:
    """Read ``draft.init_from`` for ``method`` (``dflash``, ``dspark``, ``dflash2``, ...).

    Raises:
        WarmStartError: one line naming the folder or file: no such folder, no ``config.json`` /
            ``model.safetensors``, a draft of another method (``speculators_model_type`` or
            architecture), a key or option the method's reader refuses, unreadable weights.
    """
    from safetensors import SafetensorError

    spec = get_method(method)
    path = Path(path).expanduser()
    if not path.is_dir():
        raise WarmStartError(f"draft.init_from={str(path)!r}: no such folder (a {method} export or checkpoint)")
    try:
        if (path / DRAFT_CONFIG_FILE).is_file():  # our training checkpoint
            try:
                ckpt = read_draft(path, method)
            except ExportError as exc:
                raise DraftLoadError(str(exc)) from None
            target = ckpt.meta.target
            tensors = {k: v.float() if v.is_floating_point() else v for k, v in ckpt.state.items()}
            verifier = {"name_or_path": target.get("name_or_path"), "architectures": target.get("architectures", [])}
            return InitDraft(ckpt.config, tensors, path, verifier)
        raw = read_export_config(path)
        where = path / "config.json"
        try:
            found = method_of_export(raw).name
        except UnknownMethodError:
            found = None
        if found != method:
            what = (f"a draft of method {found}" if found is not None else
                    f"speculators_model_type {raw.get('speculators_model_type')!r}, architectures "
                    f"{raw.get('architectures') or []}: a method draftsmith does not train")
            raise WarmStartError(f"draft.init_from: {where}: {what}; draft.method {method} starts only from "
                                 f"{method} drafts")
        config, tensors, _ = read_export(path, lambda c: spec.config_class.from_export(trained_layout(c)))
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    except (DraftLoadError, SafetensorError) as exc:
        raise WarmStartError(f"draft.init_from: {exc}") from None
    return InitDraft(config, tensors, path, verifier)


def target_ids(init: InitDraft) -> torch.Tensor:
    """``(Vd,)`` the target token id of each of ``init``'s draft tokens (``draft id + d2t``; the
    identity for a full-vocab draft, which ships no ``d2t``)."""
    d2t = init.tensors.get("d2t")
    if d2t is None:
        return torch.arange(init.config.draft_vocab_size)
    return torch.arange(d2t.shape[0]) + d2t.long()


def fit_problems(init: InitDraft, target_info: TargetInfo, d2t: torch.Tensor) -> list[str]:
    """What keeps ``init`` from being trained on this run's data (empty: it fits): the one target
    rule (:func:`~draftsmith.models.common.fit_problems`, aux ids from 1) with this run's aux
    layer ids, plus a draft vocab that must share tokens with this run's.

    Args:
        target_info: ``RUN_DIR/data/target.json``.
        d2t: this run's draft vocab offsets ``(Vd,)``.
    """
    c = init.config
    draft = DraftFit(hidden_size=c.hidden_size, target_hidden_size=c.target_hidden_size, vocab_size=c.vocab_size,
                     draft_vocab_size=None, aux_layer_ids=list(c.aux_layer_ids), verifier=init.verifier, aux_min=1,
                     mask_token_id=c.mask_token_id)
    target = TargetFit(hidden_size=int(target_info.hidden_size), vocab_size=int(target_info.vocab_size),
                       num_hidden_layers=target_info.num_hidden_layers,
                       architectures=list(target_info.architectures or []),
                       aux_layer_ids=list(target_info.aux_layer_ids))
    problems = common_fit_problems(draft, target)
    if c.vocab_size == target.vocab_size:
        run_ids = torch.arange(d2t.shape[0]) + d2t.long()
        if not set(target_ids(init).tolist()) & set(run_ids.tolist()):
            problems.append("its draft vocab shares no token with this run's")
    return problems


def read_init_from(method: Any) -> InitDraft | None:
    """``method.recipe.draft.init_from`` read (:func:`read_init_draft`) and checked against the run
    (:func:`fit_problems`, its mask token against the tokenised data); None without one.

    Args:
        method: the run's :class:`~draftsmith.models.dflash.training.DFlashMethod` (or a
            subclass), with its target info, draft vocab and tokenised data.

    Raises:
        WarmStartError: unreadable, or not fitting this run (every problem in one line).
    """
    draft = method.recipe.draft
    if not getattr(draft, "init_from", None):
        return None
    init = read_init_draft(draft.init_from, method.name)
    problems = fit_problems(init, method.target_info, method.d2t)
    mask = init.config.mask_token_id
    if draft.mask_token_id is not None and draft.mask_token_id != mask:
        problems.append(f"draft.mask_token_id={draft.mask_token_id} but the draft's mask slots embed token {mask} "
                        "(leave draft.mask_token_id unset)")
    elif not problems:
        try:
            method.mask_token_id(mask)
        except MaskTokenError as exc:
            problems.append(f"its mask token: {exc}")
    if problems:
        raise WarmStartError(f"draft.init_from={init.path} does not fit this run (target "
                             f"{method.target_info.name_or_path}): " + "; ".join(problems))
    return init


def config_problems(init: InitDraft, config: DFlashConfig, draft: Any) -> list[str]:
    """Where ``init``'s config and this run's (``config``, from the recipe's ``draft`` section and
    the target) disagree, one line each (empty: none). A key of the recipe's section is named
    ``draft.<key>``; the geometry draftsmith copies from the target (sizes, norm eps, activation,
    RoPE) is named as a field. :data:`RUN_FIELDS` and the fields :func:`fit_problems` checks are
    not compared."""
    ours, theirs = config.to_dict(), init.config.to_dict()
    recipe_keys = type(draft).model_fields
    problems = []
    for key, value in theirs.items():
        if key in RUN_FIELDS or key in FIT_FIELDS or ours.get(key) == value:
            continue
        if key in recipe_keys:
            problems.append(f"draft.{key}={ours.get(key)!r} but the draft has {key}={value!r} (set draft.{key})")
        else:
            problems.append(f"{key} {value!r} != {ours.get(key)!r}, this run's (draftsmith builds the draft's "
                            "layers with the target's geometry)")
    return problems


@torch.no_grad()
def load_init_weights(model: torch.nn.Module, init: InitDraft,
                      target_lm_head: torch.Tensor | None = None) -> dict[str, Any]:
    """Copy ``init``'s tensors into ``model`` (built from this run's config, target embedding and
    draft vocab installed): every tensor by name, :data:`DRAFT_VOCAB_ROWS` row by row by target
    token id.

    Args:
        target_lm_head: ``(Vd, H)`` the target's ``lm_head`` rows over this run's draft vocab,
            the head of a full-vocab draft that ships none (speculators saves no ``lm_head`` then:
            it is the verifier's).

    Returns:
        ``{"tensors": copied by name, "rows": {name: draft tokens carried over}, "draft_tokens": Vd}``.

    Raises:
        WarmStartError: a tensor the model needs is missing, one it has no place for is there, or
            one has another shape (all named).
    """
    own = model.state_dict()
    rows = [k for k in DRAFT_VOCAB_ROWS if k in own]
    wanted = [k for k in own if k not in rows and k not in ("d2t", "t2d")]
    have = {k for k in init.tensors if k not in DROPPED and k not in ("d2t", "t2d")}
    head_from_target = target_lm_head is not None and "d2t" not in init.tensors  # a full-vocab draft's head
    missing = [k for k in wanted + rows if k not in have and not (k == "lm_head.weight" and head_from_target)]
    unexpected = sorted(have - set(own))
    shaped = [f"{k} {list(init.tensors[k].shape)} (needs {list(own[k].shape)})" for k in wanted
              if k in have and tuple(init.tensors[k].shape) != tuple(own[k].shape)]
    shaped += [f"{k} {list(init.tensors[k].shape)} (needs [*, {own[k].shape[1]}])" for k in rows
               if k in have and init.tensors[k].shape[1:] != own[k].shape[1:]]
    if missing or unexpected or shaped:
        raise WarmStartError(f"draft.init_from={init.path}: its tensors do not match this {type(model).__name__}: "
                             f"missing {missing}, unexpected {unexpected}, mis-shaped {shaped}")
    for k in wanted:
        own[k].copy_(init.tensors[k].to(own[k].dtype))
    where = {int(t): i for i, t in enumerate(target_ids(init).tolist())}
    ours = (torch.arange(model.d2t.shape[0]) + model.d2t.long().cpu()).tolist()
    carried: dict[str, int] = {}
    for k in rows:
        src = init.tensors.get(k)
        if src is None:  # a full-vocab draft's head: the target's
            own[k].copy_(target_lm_head.to(own[k].dtype))
            carried[k] = 0
            continue
        pairs = [(i, where[t]) for i, t in enumerate(ours) if t in where]
        if pairs:
            dst, idx = torch.tensor(pairs).T
            own[k].index_copy_(0, dst.to(own[k].device), src[idx].to(own[k]))
        carried[k] = len(pairs)
    log.info("draft.init_from=%s: %d tensors loaded; rows carried over by token for %s of %d draft tokens",
             init.path, len(wanted), carried, len(ours))
    return {"tensors": len(wanted), "rows": carried, "draft_tokens": len(ours)}


def load_init(method: Any, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (built and initialised by ``method.init_draft``) with ``method.init`` loaded,
    after :func:`config_problems` against the model's config and ``method.recipe.draft``.

    Raises:
        WarmStartError: the recipe or geometry disagree with the draft (every problem in one
            line), or :func:`load_init_weights`'s.
    """
    init = method.init
    problems = config_problems(init, model.config, method.recipe.draft)
    if problems:
        raise WarmStartError(f"draft.init_from={init.path} does not fit this recipe: " + "; ".join(problems))
    load_init_weights(model, init, method.target_head.weight)
    return model
