"""XPress draft (speculators 0.9 ``XPressDraftModel``; vLLM 0.33 ``model_executor/models/qwen3_xpress.py``):
a DFlash block drafter (:mod:`draftsmith.models.dflash.model`) plus a causal low-rank refiner that
adds a logit bias to every block slot.

Shapes: N blocks, Bk block size (slot 0 = the anchor / pending token), H hidden size, r the rank
(``xpress_rank``), m = ``r * xpress_mlp_ratio``, V the target vocab (the draft vocab is the whole
vocab). ``n_k`` is slot k's final-normed hidden state ``norm(h_k)`` (the one ``lm_head`` reads),
``p_k`` the token before slot k (slot 0: the token before the anchor, slot 1: the anchor):

    c_k   = [down_h(n_k) ; down_g(mean_j n_j)]                  # (2r,) per slot, fixed per block
    x_k   = in_proj([c_k ; w1[p_k]])                             # (r,)
    u_k   = x_k + sum_{j <= k} L[:, k, j] * x_j                  # per channel c: a causal mix, L [r, Bk, Bk]
    z_k   = u_k + mlp.down_proj(silu(mlp.gate_proj(u_k)) * mlp.up_proj(u_k))
    logits_k = lm_head(n_k) + w2(z_k)                            # the drafter's logits + the bias

Slot k sees only the tokens before it, so at inference a block resolves by Jacobi passes
(:meth:`XPressRefiner.jacobi`): start from the drafter's argmax per slot, then K times re-score every
slot given the previous pass's tokens; a settled prefix stays settled. The mixer ``mix.L`` is stored
raw, as trained (only its lower triangle counts); vLLM folds it to ``tril(L) + I`` when it loads it.
The parameter names are the checkpoint names vLLM 0.33 loads (``xpress_head.w1.weight``, ...,
``xpress_head.mix.L``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..dflash.model import DFlashDraftModel, DFlashKVCache
from .config import XPressConfig


class XPressMixer(nn.Module):
    """The per-channel causal mix across the block: ``u = x + tril(L) x`` per channel, ``L [r, Bk, Bk]``
    (speculators ``mix_l``, vLLM ``mix.L``), zero at init (no mixing)."""

    def __init__(self, rank: int, block_size: int):
        super().__init__()
        self.L = nn.Parameter(torch.zeros(rank, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (N, Bk, r)`` -> ``(N, Bk, r)``; row k mixes rows ``j <= k`` only."""
        return x + torch.einsum("ckj,njc->nkc", torch.tril(self.L).to(x.dtype), x)


class XPressMLP(nn.Module):
    """The refiner's SwiGLU ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (r -> m -> r, no bias)."""

    def __init__(self, rank: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(rank, hidden, bias=False)
        self.up_proj = nn.Linear(rank, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, rank, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class XPressRefiner(nn.Module):
    """The causal refiner head (``xpress_head``): ``w1 [V, r]`` (the previous token's embedding),
    ``down_h`` / ``down_g [r, H]``, ``in_proj [r, 3r]``, ``mix.L [r, Bk, Bk]``, ``mlp`` (r -> m -> r)
    and ``w2 [V, r]`` (the readout to a logit bias). Initialised as speculators does: every
    projection and embedding ``N(0, 0.02)``, the mixer 0."""

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int, mlp_hidden: int):
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix = XPressMixer(rank, block_size)
        self.mlp = XPressMLP(rank, mlp_hidden)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, 0.02)

    def hidden_cache(self, normed: torch.Tensor) -> torch.Tensor:
        """``normed (N, Bk, H)`` final-normed block hidden states -> ``(N, Bk, 2r)``
        ``[down_h(n_k) ; down_g(mean over the block)]``: the part of every pass that the tokens
        do not change."""
        normed = normed.to(self.down_h.weight.dtype)
        mean = normed.mean(dim=1, keepdim=True).expand_as(normed)
        return torch.cat([self.down_h(normed), self.down_g(mean)], dim=-1)

    def latent(self, prev_ids: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """``prev_ids (N, Bk)`` (the token before each slot, target ids) and :meth:`hidden_cache`
        ``(N, Bk, 2r)`` -> the refined latent ``(N, Bk, r)`` (before ``w2``)."""
        x = self.in_proj(torch.cat([hcache, self.w1(prev_ids).to(hcache.dtype)], dim=-1))
        x = self.mix(x)
        return x + self.mlp(x)

    def bias(self, prev_ids: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """The logit bias ``w2(latent)`` ``(N, Bk, V)`` (:meth:`latent`'s arguments)."""
        return self.w2(self.latent(prev_ids, hcache))

    @torch.no_grad()
    def jacobi(self, base: torch.Tensor, hcache: torch.Tensor, anchor: torch.Tensor, predecessor: torch.Tensor,
               passes: int, topc: int = 0) -> torch.Tensor:
        """Greedy Jacobi resolution of N blocks, as vLLM 0.33's ``jacobi_refine_greedy``: slots
        1..Bk-1 start at the drafter's argmax; each pass re-scores every slot given the tokens of
        the pass before (slot 0 is the anchor, its predecessor ``predecessor``) and takes the argmax.

        Args:
            base: ``(N, Bk, V)`` the drafter's logits ``lm_head(n_k)`` (row 0, the anchor's, unused).
            hcache: ``(N, Bk, 2r)`` :meth:`hidden_cache`.
            anchor / predecessor: ``(N,)`` the anchor token and the token before it.
            passes: K refine passes (0: the drafter's argmax).
            topc: C > 0: each pass scores only the drafter's top-C tokens of the slot (vLLM's
                ``xpress_topc``; the bias read for those rows only); 0: the whole vocab.

        Returns:
            ``(N, Bk-1)`` int64 drafted tokens of slots 1..Bk-1.
        """
        slots = base[:, 1:]  # (N, Bk-1, V)
        block = torch.cat([anchor[:, None], slots.argmax(-1)], dim=1)  # (N, Bk)
        if topc:
            values, cand = slots.topk(min(topc, slots.shape[-1]), dim=-1)  # (N, Bk-1, C)
            readout = self.w2.weight[cand].to(values.dtype)  # (N, Bk-1, C, r)
        for _ in range(passes):
            prev = torch.cat([predecessor[:, None], block[:, :-1]], dim=1)
            lat = self.latent(prev, hcache)[:, 1:]  # (N, Bk-1, r)
            if topc:
                score = values + (readout @ lat.to(values.dtype)[..., None]).squeeze(-1)  # (N, Bk-1, C)
                drafted = cand.gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1)
            else:
                drafted = (slots + self.w2(lat).to(slots.dtype)).argmax(-1)
            block = torch.cat([anchor[:, None], drafted], dim=1)
        return block[:, 1:]


@dataclass
class XPressTargets:
    """What :meth:`XPressDraftModel.forward` trains its blocks towards (the loss runs inside the
    forward, as DFlash's :class:`~draftsmith.models.common.DistillTargets`).

    Attributes:
        teacher: ``(N, V)`` target logits (no grad).
        teacher_index: ``(B, A, Bk-1)`` int64, the ``teacher`` row of slots 1..Bk-1 (``p_{a+k-1}``).
        weight: ``(B, A, Bk-1)`` float loss weight of each slot in the refined terms (0: not trained).
        base_weight: ``(B, A, Bk-1)`` the same for the drafter's own logits.
        prev: ``(B, A, Bk)`` int64 teacher-forced predecessors ``[x_{a-1}, x_a, ..., x_{a+Bk-2}]``
            (``x_{a-1}``: the anchor itself where the anchor starts its document).
        compute: ``models/xpress/training.py``'s ``xpress_block_loss`` (the model imports nothing from
            ``train/``): ``compute(model, hidden (B, A, Bk, H), targets)``.
        options: the loss terms and weights (``models/xpress/training.py``'s ``XPressLossSpec``).
        chunk_size: rows per loss chunk (None: ``chunk_rows`` of V).
        accept: ``draft.accept_weighting`` / ``draft.opd`` (``train/losses.py``'s ``AcceptSpec``, a
            group of ``Bk - 1`` slots), or None.
    """

    teacher: torch.Tensor
    teacher_index: torch.Tensor
    weight: torch.Tensor
    base_weight: torch.Tensor
    prev: torch.Tensor
    compute: Callable[..., Any]
    options: Any = None
    chunk_size: int | None = None
    accept: Any = None

    def __call__(self, model: XPressDraftModel, hidden: torch.Tensor) -> Any:
        return self.compute(model, hidden, self)


class XPressDraftModel(DFlashDraftModel):
    """XPress draft: :class:`~draftsmith.models.dflash.model.DFlashDraftModel` (``fc``, ``hidden_norm``,
    layers, ``norm``, ``lm_head [V, H]``, the identity vocab map) plus :class:`XPressRefiner`
    (``xpress_head``)."""

    def __init__(self, config: XPressConfig, attention_backend: str = "auto"):
        super().__init__(config, attention_backend)
        self.xpress_head = XPressRefiner(config.vocab_size, config.hidden_size, config.block_size,
                                         config.xpress_rank, config.mlp_hidden)

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor, label_mask: torch.Tensor | None = None, *,
                targets: Any = None, **kwargs: Any) -> Any:
        """:meth:`DFlashDraftModel.forward` (the drafter's logits), or with :class:`XPressTargets`
        the XPress loss of the whole blocks (what ``targets.compute`` returns); ``kwargs``
        (``position_ids``, ``document_ids``) as there."""
        if not isinstance(targets, XPressTargets):
            return super().forward(input_ids, aux_hidden_states, anchors, anchor_valid, label_mask,
                                   targets=targets, **kwargs)
        return targets(self, self.block_hidden(input_ids, aux_hidden_states, anchors, anchor_valid, **kwargs))

    def refined_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """``hidden (N, Bk, H)`` pre-norm block hidden states and ``prev_ids (N, Bk)`` -> the refined
        logits ``lm_head(n_k) + w2(z_k)`` ``(N, Bk, V)``."""
        normed = self.norm(hidden)
        return self.lm_head(normed) + self.xpress_head.bias(prev_ids, self.xpress_head.hidden_cache(normed))

    @torch.no_grad()
    def propose_jacobi(self, cache: DFlashKVCache, bonus_token: int, position: int,
                       predecessor: int | None = None) -> torch.Tensor:
        """One draft forward over the whole block ``[bonus, M * (Bk-1)]`` at ``position`` (vLLM serves
        XPress at ``num_speculative_tokens = Bk - 1``: its mixer spans the block), then
        :meth:`XPressRefiner.jacobi` with the config's ``num_jacobi_passes`` and ``xpress_topc``.

        Args:
            predecessor: the token before ``bonus_token``; None: ``bonus_token`` itself, what vLLM
                0.33 passes (its speculator has no id buffer of that token).

        Returns:
            ``(Bk-1,)`` int64 drafted tokens for positions ``position+1 ..``.
        """
        cfg = self.config
        normed = self.norm(self.run_block(cache, bonus_token, position, cfg.block_size))[None]  # (1, Bk, H)
        base = self.lm_head(normed)
        anchor = torch.tensor([bonus_token], device=base.device)
        before = anchor if predecessor is None else torch.tensor([predecessor], device=base.device)
        return self.xpress_head.jacobi(base, self.xpress_head.hidden_cache(normed), anchor, before,
                                       cfg.num_jacobi_passes, cfg.xpress_topc)[0]
