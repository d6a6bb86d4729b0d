"""DSpark draft (DFlash block drafting + a sequential Markov head + a confidence head) in the
layout vLLM 0.32 serves as ``{"method": "dspark"}`` (``model_executor/models/qwen3_dspark.py``,
``v1/worker/gpu/spec_decode/dspark/speculator.py``).

The backbone is :class:`~draftsmith.models.dflash.model.DFlashDraftModel` unchanged; what DSpark
changes (docs/dspark.md):

- block layout (``sample_from_anchor``): the block ``[x_a, M, ..., M]`` of ``Bk`` slots at
  positions ``a..a+Bk-1``; slot k predicts ``x_{a+k+1}`` (next-token, the anchor slot included),
  so one block proposes ``Bk`` tokens;
- sequential Markov correction: ``logits_k = lm_head(norm(h_k)) + markov_w2 @ markov_w1[y_{k-1}]``
  with ``y_{-1} = x_a`` (the anchor) and ``y_{k-1}`` the token chosen at slot k-1 (inference) or
  the true token ``x_{a+k}`` (training, teacher forcing). ``markov_w1 [V, r]`` embeds a *target*
  id, ``markov_w2 [Vd, r]`` projects to the draft vocab;
- confidence: ``sigmoid(proj(cat(norm(h_k), markov_w1[y_{k-1}])))`` (or ``proj(norm(h_k))``),
  the estimated probability that slot k's token is accepted.

Shapes: B batch, T tokens, A anchors per row, Bk block size, H hidden, r Markov rank, V target
vocab, Vd draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..dflash.model import DFlashDraftModel, DFlashKVCache
from .config import DSparkConfig


class DSparkMarkovHead(nn.Module):
    """``markov_w1`` (embedding ``[V, r]`` of the previous token, a target id) and ``markov_w2``
    (``[Vd, r]``, a bias over the draft vocab), vLLM's ``DSparkMarkovHead``. ``markov_w2`` starts
    at zero: an untrained head adds no bias (plain DFlash logits)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)


class DSparkConfidenceHead(nn.Module):
    """``proj``: ``[1, H (+ r)]`` weight and ``[1]`` bias (vLLM's ``DSparkConfidenceHead``)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        self.proj = nn.Linear(config.confidence_input_size, 1, bias=True)

    def forward(self, normed: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` post-norm hidden, ``(..., r)`` Markov embedding -> ``(...)`` float32 logits
        (pre-sigmoid). The projection runs in the weight's dtype (bf16 weights under DeepSpeed: an
        fp32 input would not meet them), its output is float32 like the loss's other terms."""
        x = torch.cat([normed, markov_embed], dim=-1) if self.with_markov else normed
        return self.proj(x.to(self.proj.weight.dtype)).float().squeeze(-1)


@dataclass
class DSparkTargets:
    """What :meth:`DSparkDraftModel.forward` trains its block slots towards (the loss runs
    inside the forward, as DFlash's :class:`~draftsmith.models.common.DistillTargets`).

    Attributes:
        teacher: ``(N, Vd)`` target logits over the draft vocab (no grad).
        teacher_index: ``(B, A, Bk)`` int64, the ``teacher`` row of each slot (``p_{a+k}``).
        labels: ``(B, A, Bk)`` int64 draft-vocab id of each slot's true next token (0 where not in
            the draft vocab).
        label_ok: ``(B, A, Bk)`` bool, the true next token is in the draft vocab (cross-entropy
            counted).
        weight: ``(B, A, Bk)`` float per-slot weight (0: not trained).
        compute: ``models/dspark/training.py``'s ``dspark_rows`` (the model imports nothing from ``train/``):
            ``compute(model, hidden (M, H), markov_embed (M, r), targets) -> DSparkOut``.
        options: the loss weights and divergence (``models/dspark/training.py``'s ``DSparkLossSpec``).
        chunk_size: rows per loss chunk (None: ``chunk_rows`` of Vd).
        accept: ``draft.accept_weighting`` / ``draft.opd`` (``train/losses.py``'s ``AcceptSpec``, a
            group of ``Bk`` slots), or None.
    """

    teacher: torch.Tensor
    teacher_index: torch.Tensor
    labels: torch.Tensor
    label_ok: torch.Tensor
    weight: torch.Tensor
    compute: Callable[..., Any]
    options: Any = None
    chunk_size: int | None = None
    accept: Any = None


class DSparkDraftModel(DFlashDraftModel):
    """DSpark draft: the DFlash draft (``fc``, ``hidden_norm``, layers, ``norm``, ``lm_head``) plus
    ``markov_head`` and, with ``config.confidence_head``, ``confidence_head``."""

    def __init__(self, config: DSparkConfig, attention_backend: str = "auto"):
        super().__init__(config, attention_backend)
        self.markov_head = DSparkMarkovHead(config)
        self.confidence_head = DSparkConfidenceHead(config) if config.confidence_head else None

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``(...)`` previous tokens (target ids) -> ``(..., r)`` Markov embeddings."""
        return self.markov_head.markov_w1(prev_ids)

    def markov_logits(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` pre-norm hidden and ``(..., r)`` Markov embedding -> ``(..., Vd)`` corrected
        logits ``lm_head(norm(h)) + markov_w2(e)``."""
        return self.compute_logits(hidden) + self.markov_head.markov_w2(markov_embed.to(hidden.dtype))

    def confidence_logit(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` pre-norm hidden -> ``(...)`` confidence logit (``sigmoid`` of it: the
        estimated acceptance probability).

        Raises:
            ValueError: the draft has no confidence head.
        """
        if self.confidence_head is None:
            raise ValueError("this DSpark draft has no confidence head (config.confidence_head is false)")
        return self.confidence_head(self.norm(hidden), markov_embed)

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, targets: DSparkTargets | None = None) -> Any:
        """Training forward over A anchor blocks per row, teacher-forced Markov correction.

        Args:
            input_ids / aux_hidden_states / anchors / anchor_valid / position_ids / document_ids:
                as :meth:`DFlashDraftModel.forward`.
            targets: :class:`DSparkTargets`: compute the loss here (returns what
                ``targets.compute`` returns) instead of the logits.

        Returns:
            Without ``targets``: ``(B, A, Bk, Vd)`` Markov-corrected logits, slot k predicting
            ``x_{a+k+1}`` with the bias of the true previous token ``x_{a+k}``.
        """
        h = self.block_hidden(input_ids, aux_hidden_states, anchors, anchor_valid, position_ids, document_ids)
        T, Bk = input_ids.shape[1], self.config.block_size
        prev_pos = (anchors[..., None] + torch.arange(Bk, device=anchors.device)).clamp(max=T - 1)  # (B, A, Bk)
        prev = input_ids.gather(1, prev_pos.flatten(1)).view_as(prev_pos)
        e = self.markov_embed(prev)  # (B, A, Bk, r)
        if targets is not None:
            return targets.compute(self, h.reshape(-1, h.shape[-1]), e.reshape(-1, e.shape[-1]), targets)
        return self.markov_logits(h, e)

    # ----------------------------------------------------------------------------------
    # Inference, as vLLM's DSpark speculator runs it

    @torch.no_grad()
    def propose_hidden(self, cache: DFlashKVCache, bonus_token: int, position: int, k: int) -> torch.Tensor:
        """The block ``[bonus, M * (k-1)]`` at positions ``position..position+k-1``: ``(k, H)``
        pre-norm hidden states, row i drafting the token at ``position + i + 1``.

        Raises:
            ValueError: ``k`` outside ``[1, block_size]``.
        """
        Bk = self.config.block_size
        if not 1 <= k <= Bk:
            raise ValueError(f"k={k} drafts, but this DSpark draft was trained with block_size={Bk}: "
                             f"it proposes 1..{Bk} tokens per block")
        return self.run_block(cache, bonus_token, position, k)
