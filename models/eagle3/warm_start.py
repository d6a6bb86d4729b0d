"""Warm start (``draft.init_from``): fine-tune an existing EAGLE-3 draft instead of starting
from scratch.

The draft to start from is an export folder (``config.json`` + ``model.safetensors``, the
speculators format vLLM loads, written by draftsmith or any public speculators-format EAGLE-3
checkpoint; the legacy ``LlamaForCausalLMEagle3`` layout too) or a draftsmith training
checkpoint (``checkpoints/step-N`` or ``checkpoints/best``).

Before anything is trained it must fit this run: its hidden size, aux-state width and vocab
size must be the target's, its aux layer ids the ones this run's hidden states were captured
at (``RUN_DIR/data/target.json``), its verifier architecture (when recorded) the target's, and
its draft vocab must share tokens with this run's. The draft keeps its own layer geometry
(intermediate size, heads), ``norm_before_residual`` and EAGLE-3.1 options; its ``lm_head`` rows
are carried over by target token id into this run's draft vocab (``d2t``), rows of tokens it did
not have keep the target's ``lm_head`` rows (``draft.init_lm_head_from_target``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from ...layout import DRAFT_CONFIG_FILE, DraftLoadError, ExportError, read_export
from ...target import TargetInfo
from ...train.checkpoint import read_draft
from ...train.method_base import MethodSetupError
from ..common import DraftFit, TargetFit
from ..common import fit_problems as common_fit_problems
from .config import EAGLE31_OPTIONS, Eagle3Config
from .model import Eagle3DraftModel

log = logging.getLogger("draftsmith.train")

_NOT_LOADED = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")  # remapped or the target's


class WarmStartError(MethodSetupError):
    """``draft.init_from`` names no readable EAGLE-3 draft, or one that does not fit this run."""


@dataclasses.dataclass
class InitDraft:
    """A draft to start from: its config, tensors (float32, ``layers.0.*`` names) and path."""

    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    path: Path
    verifier: dict[str, Any]


def read_init_draft(path: str | Path) -> InitDraft:
    """Read ``draft.init_from``: an export folder or a draftsmith training checkpoint.

    Raises:
        WarmStartError: naming the path, for a missing folder, no EAGLE-3 config, or unreadable weights.
    """
    from safetensors import SafetensorError

    path = Path(path).expanduser()
    if not path.is_dir():
        raise WarmStartError(f"draft.init_from={str(path)!r}: no such folder (an EAGLE-3 export or checkpoint)")
    try:
        if (path / DRAFT_CONFIG_FILE).is_file():  # our training checkpoint
            try:
                ckpt = read_draft(path, "eagle3")
            except ExportError as exc:
                raise DraftLoadError(str(exc)) from None
            config = ckpt.config
            tensors = {k: v.float() if v.is_floating_point() else v for k, v in ckpt.state.items()}
            target = ckpt.meta.target
            verifier = {"name_or_path": target.get("name_or_path"), "architectures": target.get("architectures", [])}
        else:
            raw_config: dict[str, Any] = {}

            def parse(raw: dict[str, Any]) -> Eagle3Config:
                raw_config.update(raw)
                return Eagle3Config.from_export(raw)

            config, tensors, _ = read_export(path, parse)
            verifier = Eagle3Config.export_facts(raw_config).verifier
    except (DraftLoadError, SafetensorError) as exc:
        raise WarmStartError(f"draft.init_from: {exc}") from None
    return InitDraft(config, tensors, path, verifier)


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
    """The config to train: the init draft's geometry, residual norm and EAGLE-3.1 options, this
    run's draft vocab size (a recipe that says otherwise is warned about, naming the key)."""
    for key in ("norm_before_residual", *EAGLE31_OPTIONS):
        if getattr(init.config, key) != getattr(run_config, key):
            log.warning("draft.init_from: %s=%s as the draft was trained (the recipe says %s)",
                        key, getattr(init.config, key), getattr(run_config, key))
    return dataclasses.replace(init.config, draft_vocab_size=run_config.draft_vocab_size,
                               extra=dict(run_config.extra))


@torch.no_grad()
def load_init_weights(model: Eagle3DraftModel, init: InitDraft) -> dict[str, int]:
    """Copy ``init``'s weights into ``model`` (built with :func:`warm_config`, target embedding and
    vocab mapping installed): every layer tensor as is, ``lm_head`` rows by target token id.

    Returns:
        ``{"tensors": copied, "lm_head_rows": carried over, "lm_head_rows_new": kept from the target}``.

    Raises:
        WarmStartError: a tensor the model needs is missing or has another shape.
    """
    own = model.state_dict()
    wanted = [k for k in own if k not in _NOT_LOADED]
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
