"""DFlash2 draft (z-lab DFlash2; vLLM 0.32 ``model_executor/models/qwen3_dflash2.py``): a DFlash
draft (:mod:`draftsmith.models.dflash.model`) with two additions.

Grouped dynamic convolutions. Every decoder layer wraps its attention and its MLP in a
block-local causal convolution over the block slots, whose coefficients are a learned base plus a
per-row delta projected from the sublayer's normed input ``x`` (one projection for both sides):

    delta = kernel_projection(x).view(S, 2, T, G)                 # T taps, G = H / gs groups
    conv_s(y)[i, c] = sum_{t < T, t <= i} (base_kernel[s, t, c] + delta[i, s, t, c // gs]) * y[i - t, c]
    attention: h = h + conv_1(self_attn(conv_0(x)))  with x = input_layernorm(h)
    MLP:       h = h + conv_1'(mlp(conv_0'(x')))     with x' = post_attention_layernorm(h)

i is the slot index inside its block (0 = the anchor), so no tap crosses a block start; the context
rows never pass through a convolution (their keys / values come straight from ``hidden_norm(fc(.))``).

Candidate selector. Per trained / drafted slot l the ``lm_head`` logits' top-K give candidates
``c_{l,1..K}`` with unary scores ``u_{l,k}``; the score of candidate c after predecessor p is

    S_l(p, c) = u_l(c) + < predecessor_codebook[p] * hidden_projection(n_l), successor_codebook[c] >

with ``n_l`` the slot's final-normed hidden state. Slot 1's predecessor is the anchor (the pending
token); at T=0 vLLM's walk takes ``argmax_c S_l(prev, c)`` slot by slot, ``prev`` the token it
chose for the slot before. Shapes: S slots, H hidden, T taps, G groups, gs group size, V vocab,
r selector rank, K candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..common import DistillTargets
from ..dflash.model import DFlashDecoderLayer, DFlashDraftModel
from .config import DFlash2Config


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The block-local causal grouped convolution (vLLM's ``_grouped_conv``).

    Args:
        x: ``(..., S, H)`` rows of one block each along the S axis (slot 0 first).
        delta: ``(..., S, T, G)`` per-row dynamic coefficients of each tap and channel group.
        base: ``(T, H)`` learned base coefficients.

    Returns:
        ``(..., S, H)``: ``out[i] = sum_{t <= i} (base[t] + delta[i, t]) * x[i - t]``, per channel.
    """
    T, G = base.shape[0], delta.shape[-1]
    S = x.shape[-2]
    blocks = x.unflatten(-1, (G, -1))  # (..., S, G, gs)
    coefficients = base.view(T, G, -1) + delta.unsqueeze(-1)  # (..., S, T, G, gs)
    out = coefficients[..., 0, :, :] * blocks
    for tap in range(1, min(T, S)):
        shifted = F.pad(blocks[..., : S - tap, :, :], (0, 0, 0, 0, tap, 0))  # row i holds x[i - tap]
        out = out + coefficients[..., tap, :, :] * shifted
    return out.flatten(-2)


class DFlashGroupedConv(nn.Module):
    """The two convolutions around one sublayer (vLLM ``DFlashGroupedConv``): ``base_kernel
    [2, T, H]`` and ``kernel_projection [2*T*G, H]``. Initialised to the identity (base tap 0 = 1,
    other taps and the projection 0), so an untrained DFlash2 layer computes the DFlash layer."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (..., S, H)`` the normed sublayer input -> (its input-side convolution, the output
        side's deltas ``(..., S, T, G)``)."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))  # (..., S, 2, T, G)
        return grouped_conv(x, delta[..., 0, :, :], self.base_kernel[0]), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The output-side convolution of the sublayer's output ``y (..., S, H)``."""
        return grouped_conv(y, delta, self.base_kernel[1])


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with ``attention_conv`` / ``mlp_conv`` around its sublayers (vLLM
    ``DFlash2Qwen3DecoderLayer``)."""

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.attention_conv = DFlashGroupedConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = DFlashGroupedConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def attend(self, h: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mask: Any) -> torch.Tensor:
        """As :meth:`DFlashDecoderLayer.attend` (``h (B, A, Bk, H)``), each sublayer convolved
        along the block axis."""
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, k_ctx, v_ctx, mask), delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)


class CandidateSelector(nn.Module):
    """The low-rank predecessor-conditioned re-ranker (vLLM ``CandidateSelector``):
    ``predecessor_codebook [V, r]``, ``successor_codebook [V, r]``, ``hidden_projection [r, H]``.
    The successor codebook starts at 0, so an untrained selector ranks by the unary logits alone
    (the DFlash argmax)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * rank ** -0.5)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edge_scores(self, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor, unary: torch.Tensor,
                    normed: torch.Tensor) -> torch.Tensor:
        """``S(p, c)`` for predecessors ``(..., P)`` and candidates ``(..., C)`` with unary scores
        ``(..., C)`` of slots whose final-normed hidden states are ``normed (..., H)`` ->
        ``(..., P, C)`` float32."""
        gate = self.hidden_projection(normed)  # (..., r)
        a = self.predecessor_codebook[predecessor_ids] * gate.unsqueeze(-2)  # (..., P, r)
        b = self.successor_codebook[candidate_ids]  # (..., C, r)
        return unary.float().unsqueeze(-2) + (a @ b.transpose(-1, -2)).float()

    def forward(self, candidate_ids: torch.Tensor, unary: torch.Tensor, normed: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's scoring of a drafted block: ``candidate_ids`` / ``unary`` ``(B, L, K)``, ``normed
        (B, L, H)``, ``anchor_ids (B,)`` -> ``(B, L, K, K)`` scores ``[b, l, p, c]`` of candidate c
        of slot l after candidate p of slot l-1 (slot 0: after the anchor, every row alike)."""
        K = candidate_ids.shape[-1]
        predecessors = torch.cat([anchor_ids[:, None, None].expand(-1, 1, K), candidate_ids[:, :-1]], dim=1)
        return self.edge_scores(predecessors, candidate_ids, unary, normed)


@dataclass
class SelectorTargets:
    """The DFlash2 training targets a draft's forward computes its loss against: the DFlash
    divergence (``distill``) and the selector's K-way cross-entropy (``select``,
    ``draftsmith.models.dflash2.training.chunked_selector``), both over the trained block slots.

    Attributes:
        distill: the DFlash :class:`~draftsmith.models.common.DistillTargets`.
        predecessor: ``(B, A, Bk-1)`` the token before each slot (slot 1: the anchor).
        gold: ``(B, A, Bk-1)`` the token each slot should draft.
        weight: ``(B, A, Bk-1)`` float loss weight of each slot (0: not trained).
        select: ``select(hidden (M, H), score_fn, predecessor (M,), gold (M,), weight (M,), chunk_size)``.
        chunk_size: rows per chunk (None: the default for V).
    """

    distill: DistillTargets
    predecessor: torch.Tensor
    gold: torch.Tensor
    weight: torch.Tensor
    select: Callable[..., Any]
    chunk_size: int | None = None

    def __call__(self, hidden: torch.Tensor, score_fn: Callable[..., Any]) -> Any:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self.select(flat, score_fn, self.predecessor.reshape(-1), self.gold.reshape(-1),
                           self.weight.reshape(-1), self.chunk_size)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft: :class:`~draftsmith.models.dflash.model.DFlashDraftModel` with
    :class:`DFlash2DecoderLayer` layers and a :class:`CandidateSelector` (``candidate_selector``).
    Full target vocab: ``lm_head [V, H]``, ``d2t`` / ``t2d`` the identity."""

    _no_split_modules = ["DFlash2DecoderLayer"]
    decoder_layer_cls = DFlash2DecoderLayer

    def __init__(self, config: DFlash2Config, attention_backend: str = "auto"):
        super().__init__(config, attention_backend)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank,
                                                    config.selector_top_k)

    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden (..., H)`` pre-norm -> (candidate ids ``(..., K)``, their unary logits ``(..., K)``
        float32, descending, the final-normed hidden ``(..., H)``): vLLM's ``compute_candidates``."""
        normed = self.norm(hidden)
        values, ids = self.lm_head(normed).float().topk(self.config.selector_top_k, dim=-1)
        return ids, values, normed

    def teacher_forced_scores(self, hidden: torch.Tensor, predecessor: torch.Tensor,
                              gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selector's K-way training scores of M slots (predecessor = the true previous token).

        A gold token outside a slot's unary top-K replaces its K-th candidate (with its own unary
        logit), so every row has a target (speculators PR #1006 / SpecForge PR #772).

        Args:
            hidden: ``(M, H)`` pre-norm slot hidden states.
            predecessor / gold: ``(M,)`` token ids.

        Returns:
            ``(scores (M, K) float32, target (M,) index of gold among the candidates, covered (M,)
            bool: gold was in the unary top-K)``.
        """
        normed = self.norm(hidden)
        logits = self.lm_head(normed).float()  # (M, V)
        unary, ids = logits.topk(self.config.selector_top_k, dim=-1)
        hit = ids == gold[:, None]
        covered = hit.any(-1)
        ids = torch.where(covered[:, None], ids, torch.cat([ids[:, :-1], gold[:, None]], dim=-1))
        unary = torch.where(covered[:, None], unary, torch.cat([unary[:, :-1], logits.gather(1, gold[:, None])], -1))
        target = (ids == gold[:, None]).float().argmax(-1)
        scores = self.candidate_selector.edge_scores(predecessor[:, None], ids, unary, normed)[:, 0]  # (M, K)
        return scores, target, covered

    def block_loss(self, targets: Any, hidden: torch.Tensor) -> Any:
        """DFlash's loss (a :class:`~draftsmith.models.common.DistillTargets`), or with
        :class:`SelectorTargets` the pair (DFlash divergence, selector cross-entropy) of the
        slots ``hidden (B, A, Bk-1, H)``."""
        if not isinstance(targets, SelectorTargets):
            return super().block_loss(targets, hidden)
        return super().block_loss(targets.distill, hidden), targets(hidden, self.teacher_forced_scores)

    @torch.no_grad()
    def propose_scores(self, cache: Any, bonus_token: int, position: int,
                       k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward (:meth:`propose_hidden`) and vLLM's candidate scoring of its k slots.

        Returns:
            ``(candidate_ids (k, K), scores (k, K, K) float32)``: ``scores[l, p, c]`` of candidate c
            of slot l after candidate p of slot l-1 (slot 0: after ``bonus_token``).
        """
        ids, unary, normed = self.candidates(self.propose_hidden(cache, bonus_token, position, k))
        anchor = torch.tensor([bonus_token], device=ids.device)
        return ids, self.candidate_selector(ids[None], unary[None], normed[None], anchor)[0]
