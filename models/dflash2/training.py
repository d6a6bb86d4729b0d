"""DFlash2's training side: the :class:`DFlash2Method` (the method's ``training_method``,
:mod:`draftsmith.methods`), its selector loss and the dry run's estimates.

DFlash2 trains exactly as DFlash (:mod:`draftsmith.models.dflash.training`: the same data, anchors,
slot weights and divergence) a :class:`~draftsmith.models.dflash2.model.DFlash2DraftModel`, whose
loss adds ``draft.selector_loss_alpha`` times the candidate selector's K-way cross-entropy
(:func:`dflash2_loss`, :class:`SelectorLoss`).
The draft vocab must be the target's whole vocab (vLLM 0.32 serves DFlash2 only so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...recipe import Recipe
from ...train.dry_run import Shapes, loss_chunk_rows
from ...train.losses import DistillOut
from ..common import DistillTargets, LayerGeometry
from ..dflash.training import DFlashMethod, dflash_loss
from ..dflash.training import activation_estimate as dflash_activation_estimate
from ..dflash.training import parameter_estimate as dflash_parameter_estimate
from .config import SELECTOR_KEYS, DFlash2Config
from .model import DFlash2DraftModel, SelectorTargets


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train a DFlash2 draft (DFlash with grouped dynamic convolutions and a candidate selector).

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume]
    draftsmith train RECIPE.yaml --run-dir runs/x

Reads and writes what DFlash training does (the same prepared ``RUN_DIR/data``, with the
draft vocab equal to the target's).
"""


class DFlash2Method(DFlashMethod):
    """DFlash2: :class:`DFlashMethod` with the convolution / selector geometry of the recipe's
    ``draft`` section and the selector term in the loss.

    Raises (at construction):
        ValueError: as :class:`~draftsmith.models.dflash.training.DFlashMethod`; a draft vocab smaller than the target's
            (``data.draft_vocab_size``), a ``conv_group_size`` not dividing the hidden size.
    """

    name = "dflash2"
    help_text = TRAIN_HELP
    config_class = DFlash2Config
    model_class = DFlash2DraftModel

    def config_extra(self) -> dict[str, Any]:
        return {key: getattr(self.recipe.draft, key) for key in SELECTOR_KEYS}

    def selector_loss(self) -> SelectorLoss:
        return SelectorLoss(self.recipe.draft.selector_loss_alpha)


# --------------------------------------------------------------------------------------
# The loss: DFlash's plus the candidate selector's K-way cross-entropy


@dataclass
class SelectorOut(DistillOut):
    """What :func:`chunked_selector` returns: :class:`DistillOut` (``row_loss`` the K-way
    cross-entropy, ``row_hit`` 1 where the selector's top score is the gold token) plus
    ``row_covered (M,)`` float32, 1 where the gold token was among the unary top-K."""

    row_covered: torch.Tensor


def _selector_chunk(hidden: torch.Tensor, predecessor: torch.Tensor, gold: torch.Tensor, weight: torch.Tensor,
                    score_fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    scores, target, covered = score_fn(hidden, predecessor, gold)  # (C, K), (C,), (C,)
    ce = F.cross_entropy(scores, target, reduction="none")
    return (weight * ce).sum(), ce.detach(), (scores.argmax(-1) == target).float(), covered.float()


def chunked_selector(hidden: torch.Tensor, score_fn: Callable[..., Any], predecessor: torch.Tensor,
                     gold: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> SelectorOut:
    """The weighted K-way cross-entropy of the DFlash2 selector over M slots, in chunks of
    ``chunk_size`` rows recomputed in backward (as :func:`~draftsmith.train.losses.chunked_distill`:
    no ``(M, V)`` tensor).

    Args:
        hidden: ``(M, H)`` pre-norm slot hidden states, with grad.
        score_fn: ``score_fn(hidden (C, H), predecessor (C,), gold (C,)) -> (scores (C, K), target
            (C,), covered (C,))`` (:meth:`~draftsmith.models.dflash2.model.DFlash2DraftModel.teacher_forced_scores`).
        predecessor / gold: ``(M,)`` token ids; weight: ``(M,)`` float (0: not trained).
        chunk_size: rows per chunk.

    Returns:
        :class:`SelectorOut`; ``loss_sum = sum(weight * CE)`` with grad.
    """
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for s in range(0, max(hidden.shape[0], 1), chunk_size):  # one (possibly empty) chunk at M = 0
        args = (hidden[s:s + chunk_size], predecessor[s:s + chunk_size], gold[s:s + chunk_size],
                weight[s:s + chunk_size], score_fn)
        parts.append(checkpoint(_selector_chunk, *args, use_reentrant=False) if grad else _selector_chunk(*args))
    total = torch.stack([p[0] for p in parts]).sum()
    return SelectorOut(total, *(torch.cat([p[i] for p in parts]) for i in (1, 2, 3)))


@dataclass
class SelectorLoss:
    """The DFlash2 selector term of :func:`~draftsmith.models.dflash.training.dflash_loss`
    (speculators PR #1006 / SpecForge PR #772): ``alpha * sum_slots w * CE(S(pred, .), gold) / sum w``,
    S the teacher-forced scores of the unary top-K candidates (the gold token injected as the K-th
    when missing), ``pred`` the true previous token (the anchor for slot 1), ``gold`` the
    sequence's token at the slot, w DFlash's slot weights.

    Attributes:
        alpha: the term's weight (``draft.selector_loss_alpha``; 1.0 in both references).
        chunk_size: rows per chunk (None: ``dflash_loss``'s ``chunk_size``, else ``chunk_rows`` of V).
    """

    alpha: float = 1.0
    chunk_size: int | None = None

    def targets(self, distill: DistillTargets, input_ids: torch.Tensor, label_pos: torch.Tensor,
                rows: int) -> SelectorTargets:
        """The :class:`SelectorTargets` of blocks at ``label_pos (B, A, Bk)`` (slot 0 = the anchor),
        ``rows`` per chunk."""
        tokens = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)  # (B, A, Bk)
        return SelectorTargets(distill, predecessor=tokens[:, :, :-1], gold=tokens[:, :, 1:], weight=distill.weight,
                               select=chunked_selector, chunk_size=rows)

    @staticmethod
    def metrics(out: SelectorOut, total: torch.Tensor, trained: torch.Tensor) -> dict[str, torch.Tensor]:
        """``selector_loss`` (the weighted term before alpha), ``selector_acc`` (teacher-forced top
        score is the gold token) and ``selector_coverage`` (gold among the unary top-K), means
        over the trained slots ``trained (B, A, Bk-1)``; detached."""
        w = trained.reshape(-1).float()
        n = w.sum().clamp_min(1.0)
        return {"selector_loss": total.detach(), "selector_acc": ((out.row_hit * w).sum() / n).detach(),
                "selector_coverage": ((out.row_covered * w).sum() / n).detach()}


def dflash2_loss(model: Any, *args: Any, alpha: float = 1.0,
                 **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash2 loss: :func:`~draftsmith.models.dflash.training.dflash_loss` (same arguments,
    ``model`` a :class:`~draftsmith.models.dflash2.model.DFlash2DraftModel`) with the selector
    term ``SelectorLoss(alpha)``."""
    return dflash_loss(model, *args, selector=SelectorLoss(alpha), **kwargs)


# --------------------------------------------------------------------------------------
# The dry run's estimates


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """DFlash2 counterpart of :func:`~draftsmith.models.dflash.training.parameter_estimate`:
    DFlash's counts plus per layer two grouped convolutions (``base_kernel [2, T, H]``,
    ``kernel_projection [2*T*H/gs, H]``) and the candidate selector (two ``[V, r]`` codebooks,
    ``[r, H]``). The selector's cross-entropy adds one more fp32 ``(rows, V)`` logits chunk per
    block row (the unary top-K), counted with the rest."""
    counts, logits_bytes = dflash_parameter_estimate(recipe, geometry, vocab_size)
    d, H = recipe.draft, geometry.hidden_size
    T = d.conv_kernel_size
    counts["convolutions"] = d.num_layers * 2 * (2 * T * H + 2 * T * (H // d.conv_group_size) * H)
    counts["candidate_selector"] = 2 * vocab_size * d.selector_rank + d.selector_rank * H
    return counts, logits_bytes * 4 // 3


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """DFlash2: :func:`~draftsmith.models.dflash.training.activation_estimate` plus, per layer kept
    for backward, the four grouped convolutions' inputs and ``(T+1)`` fp32 coefficient copies of
    the ``Eb x H`` block rows, and the selector's loss chunk (one more fp32 ``(rows, V)`` logits
    chunk with its top-K)."""
    out = dflash_activation_estimate(recipe, s, trainable)
    d = recipe.draft
    Eb = s.B * max(1, min(d.num_anchors, s.T - 1)) * d.block_size
    kept = 1 if s.checkpointing else d.num_layers
    out["convolutions"] = kept * 4 * (d.conv_kernel_size + 1) * Eb * s.H * 4
    out["selector_chunk"] = 3 * loss_chunk_rows(recipe, Eb, s.V) * s.V * 4
    return out
