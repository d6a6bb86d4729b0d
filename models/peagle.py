"""P-EAGLE draft: EAGLE-3 with parallel drafting (K tokens in one forward pass).

Follows P-EAGLE (arXiv:2602.01469) and the layout vLLM 0.32 serves as
``{"method": "eagle3", "parallel_drafting": true}`` (``llama_eagle3.py``, multi-layer;
SPEC_DFLASH_PEAGLE.md section 3):

    layer 0   : cat(input_layernorm(embed(x_{t+1})), hidden_norm(fc(g_t)))  -> attention (2H in) -> MLP
    layers >= 1: plain Llama pre-norm blocks on the hidden state only (no embedding, no hidden_norm)
    logits    : lm_head(norm(h))  over the draft vocab

Parallel drafting: after the bonus token ``b = x_{p+1}`` (hidden ``fc(g_p)``, RoPE position
p), vLLM appends K-1 *mask slots* (token ``mask_token_id``, hidden ``fc(mask_hidden)``, RoPE
positions p+1..p+K-1) and reads K draft logits from ONE causal forward. ``mask_hidden`` is a
learnable vector in the *raw* aux space ``[3 * Ht]`` that goes through the same ``fc`` as real
aux states (vLLM's ``combine_hidden_states``).

Training (SPEC section 3.3): conditional-drop (COD) sampling of (anchor, depth) elements on
the EAGLE-shifted sequence (:func:`cod_sample`), one forward over all elements under
:func:`cod_attention_mask`, forward KL to the target at position ``anchor + depth``. Depth 0
is exactly EAGLE-3's TTT step 0 (there is no TTT: vLLM never feeds draft states back).

The pieces shared with EAGLE-3 (config, RoPE, first-layer ``cat(embed, hidden)`` attention,
norms, MLP, KV cache) are :mod:`draftsmith.models.eagle3`'s.

Shapes: B batch, T tokens, S sampled elements per row, H hidden size, Ht target hidden size,
Vd draft vocab size, nh / nkv heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, repeat_kv

from .eagle3 import (Eagle3Attention, Eagle3Config, Eagle3DecoderLayer, Eagle3KVCache, TargetSharedDraft, shift_left,
                     ttt_prediction_mask)


@dataclass
class PEagleConfig(Eagle3Config):
    """An :class:`~draftsmith.models.eagle3.Eagle3Config` plus the parallel-drafting fields.

    Attributes:
        num_layers: decoder layers (layer 0 reads ``cat(embed, hidden)``, the rest hidden only).
        num_depths: D, parallel depths trained (depth 0 = the bonus slot); serve K <= D.
        mask_token_id: token id of the mask slots (vLLM ``pard_token``); must never occur in the data.
        train_embeddings: whether ``embed_tokens`` is trained (and then exported).
    """

    norm_before_residual: bool = False
    num_layers: int = 2
    num_depths: int = 4
    mask_token_id: int = 0
    train_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {self.num_depths}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target vocab of {self.vocab_size}")

    @classmethod
    def from_eagle3(cls, base: Eagle3Config, **fields: Any) -> "PEagleConfig":
        """The P-EAGLE config of an EAGLE-3 geometry (e.g. :meth:`Eagle3Config.from_target`)."""
        values = {k: getattr(base, k) for k in Eagle3Config.__dataclass_fields__}
        values.update(fields)
        return cls(**values)

    def to_layer_config(self) -> dict[str, Any]:
        out = super().to_layer_config()
        out["num_hidden_layers"] = self.num_layers
        return out

    def to_speculators(self, verifier: dict[str, Any], num_speculative_tokens: int, dtype: str,
                       version: str, draftsmith: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` of the speculators ``peagle`` format (vLLM's ``update_peagle`` hook):
        the EAGLE-3 file with the type switched, ``mask_token_id`` and ``norm_before_fc``;
        ``norm_before_residual`` is always written (absent means False for peagle).

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, num_depths]``.
        """
        if not 1 <= num_speculative_tokens <= self.num_depths:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be in [1, {self.num_depths}]: "
                             f"the draft was trained with num_depths={self.num_depths}")
        out = super().to_speculators(verifier, num_speculative_tokens, dtype, version, draftsmith)
        out["architectures"] = ["PEagleSpeculator"]
        out["speculators_model_type"] = "peagle"
        out["speculators_config"]["algorithm"] = "peagle"
        out["norm_before_fc"] = False
        out["mask_token_id"] = self.mask_token_id
        out["tie_word_embeddings"] = False
        return out

    @classmethod
    def from_speculators(cls, config: dict[str, Any]) -> "PEagleConfig":
        """Inverse of :meth:`to_speculators`; ``norm_before_residual`` defaults to False (vLLM's
        peagle hook). ``num_depths`` is read back from ``draftsmith.num_depths`` (else K).

        Raises:
            KeyError: a required key (``transformer_layer_config``, ``draft_vocab_size``,
                ``mask_token_id``, ``eagle_aux_hidden_state_layer_ids``) is missing.
            ValueError: an inconsistent geometry.
        """
        layer = config["transformer_layer_config"]
        base = Eagle3Config.from_layer_config(layer, config["draft_vocab_size"],
                                              config["eagle_aux_hidden_state_layer_ids"],
                                              config.get("target_hidden_size"),
                                              bool(config.get("norm_before_residual", False)))
        facts = Eagle3Config.export_facts(config)
        extra = config.get("draftsmith") or {}
        depths = extra.get("num_depths") or facts.num_speculative_tokens or 1
        return cls.from_eagle3(base, num_layers=int(layer.get("num_hidden_layers", 1)), num_depths=int(depths),
                               mask_token_id=int(config["mask_token_id"]),
                               train_embeddings=bool(extra.get("train_embeddings", False)))


# --------------------------------------------------------------------------------------
# COD sampling and the attention mask


@dataclass
class CODElements:
    """The sampled (anchor, depth) elements of a batch, padded to S per row.

    Element s of row b sits at EAGLE-shifted position ``pos = anchor + depth``: depth 0 is the
    ordinary EAGLE input ``(x[pos+1], g_pos)``, depth d > 0 a mask slot of anchor's chain.
    The first T elements of every row are depth 0 at positions 0..T-1 (in order).

    Attributes:
        anchor, depth: ``(B, S)`` int64.
        valid: ``(B, S)`` bool, False on row padding.
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor

    @property
    def pos(self) -> torch.Tensor:
        """``(B, S)`` EAGLE-shifted position ``anchor + depth`` (0 on padding)."""
        return torch.where(self.valid, self.anchor + self.depth, torch.zeros_like(self.anchor))

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[int]]], device: torch.device | None = None) -> "CODElements":
        """Pad per-row ``(anchors, depths)`` lists into tensors."""
        S = max(len(a) for a, _ in rows)
        B = len(rows)
        anchor = torch.zeros(B, S, dtype=torch.long)
        depth = torch.zeros(B, S, dtype=torch.long)
        valid = torch.zeros(B, S, dtype=torch.bool)
        for b, (a, d) in enumerate(rows):
            anchor[b, : len(a)] = torch.tensor(a, dtype=torch.long)
            depth[b, : len(d)] = torch.tensor(d, dtype=torch.long)
            valid[b, : len(a)] = True
        return cls(anchor.to(device), depth.to(device), valid.to(device))


def _random_subset(items: list[int], size: int, generator: torch.Generator) -> list[int]:
    if len(items) <= size:
        return list(items)
    idx = torch.randperm(len(items), generator=generator)[:size]
    return sorted(items[i] for i in idx.tolist())


def cod_sample(
    prediction_mask: torch.Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    generator: torch.Generator,
    max_anchors: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> CODElements:
    """Conditional-drop sampling (speculators ``peagle/data.py``; SPEC section 3.3).

    Per row: depth 0 at every position; depth d (1 <= d < D) keeps
    ``int(max(0, n - d) * max(ratio**d, ratio_min))`` chains, drawn from the positions that
    continue a depth-(d-1) chain one step right (depth 1: from the seeds), that are trained
    (``prediction_mask``), at least d from the start, and in the anchor's document.

    Args:
        prediction_mask: ``(B, T)`` bool, the EAGLE-3 step-0 loss mask (position i predicts
            x_{i+2}, trained when True).
        num_depths: D (depths 0..D-1).
        ratio, ratio_min: r and r_min.
        generator: CPU RNG of this step (reproducible with the same seed).
        max_anchors: optional number of seeds (random subset of the trained positions).
        document_ids: optional ``(B, T)`` document per position (packed rows).

    Returns:
        :class:`CODElements` on ``prediction_mask``'s device; n = number of seeds.
    """
    B, T = prediction_mask.shape
    pm = prediction_mask.bool().cpu()
    docs = document_ids.cpu() if document_ids is not None else None
    rows = []
    for b in range(B):
        valid_set = set(torch.nonzero(pm[b]).flatten().tolist())
        seeds = sorted(valid_set)
        if max_anchors is not None:
            seeds = _random_subset(seeds, max_anchors, generator)
        anchors, depths = list(range(T)), [0] * T
        prev = seeds
        for d in range(1, num_depths):
            eligible = [i for i in prev if i >= d and (docs is None or docs[b, i] == docs[b, i - d])]
            size = int(max(0, len(seeds) - d) * max(ratio**d, ratio_min))
            size = min(size, len(eligible))
            if size == 0:
                break
            chosen = _random_subset(eligible, size, generator)
            anchors += [i - d for i in chosen]
            depths += [d] * len(chosen)
            prev = [i + 1 for i in chosen if (i + 1) in valid_set]
        rows.append((anchors, depths))
    return CODElements.from_rows(rows, prediction_mask.device)


def cod_attention_mask(elements: CODElements, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, S, S)`` bool, True = query may attend key (speculators ``peagle/attention.py``)::

        allow(q, k) = same_doc & ((depth_k == 0 & anchor_k <= anchor_q)
                                  | (anchor_k == anchor_q & depth_k <= depth_q))

    so a mask slot sees the real context up to its own anchor and the earlier slots of its own
    chain, never a depth-0 entry of a later position: exactly what vLLM's causal forward over
    ``[context <= p, bonus, masks]`` gives. Padding keys are never attended; a padding query
    attends itself only (no empty softmax rows).

    Args:
        document_ids: optional ``(B, T)`` document per position; an element's document is
            its anchor's.
    """
    a, d, v = elements.anchor, elements.depth, elements.valid
    aq, ak = a.unsqueeze(-1), a.unsqueeze(-2)
    dq, dk = d.unsqueeze(-1), d.unsqueeze(-2)
    allow = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))
    if document_ids is not None:
        doc = document_ids.gather(1, a)
        allow = allow & (doc.unsqueeze(-1) == doc.unsqueeze(-2))
    allow = allow & v.unsqueeze(-2) & v.unsqueeze(-1)
    eye = torch.eye(a.shape[1], dtype=torch.bool, device=a.device)
    return allow | (eye & ~v.unsqueeze(-1))


# --------------------------------------------------------------------------------------
# Model


class PEagleDecoderLayer(Eagle3DecoderLayer):
    """One P-EAGLE layer. Layer 0 is the EAGLE-3 layer (``cat(embed, hidden)``, 2H q/k/v
    inputs, ``hidden_norm``); layers >= 1 are Llama pre-norm blocks on the hidden state
    (H q/k/v inputs, no ``hidden_norm``), as vLLM's ``llama_eagle3.LlamaDecoderLayer``."""

    def __init__(self, config: PEagleConfig, layer_idx: int):
        super().__init__(config)
        self.layer_idx = layer_idx
        if layer_idx > 0:
            self.self_attn = Eagle3Attention(config, input_size=config.hidden_size)
            del self.hidden_norm

    def _layer_input(self, embeds: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx == 0:
            return self._input(embeds, hidden)
        return self.input_layernorm(hidden), hidden

    def forward(self, embeds: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """``hidden (B, S, H)`` (and ``embeds (B, S, H)`` for layer 0) under the bool attention
        mask ``(B, S, S)`` -> pre-norm output ``(B, S, H)``."""
        x, residual = self._layer_input(embeds, hidden)
        attn = self.self_attn
        q, k, v = attn._qkv(x, cos, sin)
        groups = attn.nh // attn.nkv
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                             attn_mask=mask.unsqueeze(1))
        return self._output(residual, attn._out(out))

    def forward_cached(self, embeds: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, cache: Eagle3KVCache) -> torch.Tensor:
        """Inference: new slots ``(B, T, H)`` appended to ``cache``, causal -> ``(B, T, H)``."""
        x, residual = self._layer_input(embeds, hidden)
        return self._output(residual, self.self_attn.forward_cached(x, cos, sin, cache))


class PEagleDraftModel(TargetSharedDraft):
    """P-EAGLE draft: ``fc`` fusion of three aux hidden states, ``num_layers`` decoder layers,
    a learnable ``mask_hidden [3 * Ht]`` (randn init) for the parallel slots.

    The token embedding is the target's: a frozen, non-persistent buffer (not saved, not
    exported; vLLM shares the target's) unless ``config.train_embeddings``, where it is a
    parameter saved as ``embed_tokens`` and exported as ``embed_tokens.weight``.
    ``d2t`` / ``t2d`` are persistent buffers (:mod:`draftsmith.data_prep.vocab`).
    """

    _no_split_modules = ["PEagleDecoderLayer"]  # FSDP unit

    def __init__(self, config: PEagleConfig):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False
        H, Ht = config.hidden_size, config.target_hidden_size
        if config.train_embeddings:
            self.embed_tokens = nn.Parameter(torch.zeros(config.vocab_size, H))
        else:
            self.register_buffer("embed_tokens", torch.zeros(config.vocab_size, H), persistent=False)
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(3 * Ht))
        self.layers = nn.ModuleList([PEagleDecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())

    def mask_state(self) -> torch.Tensor:
        """``(H,)`` fused hidden of the mask slots, ``fc(mask_hidden)`` (vLLM's ``H_mask``)."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` pre-norm hidden -> ``(..., Vd)`` draft-vocab logits."""
        return self.lm_head(self.norm(hidden))

    def _run_layers(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        embeds = F.embedding(ids, self.embed_tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        for i, layer in enumerate(self.layers):
            e = embeds if i == 0 else None
            if self.gradient_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(layer, e, hidden, cos, sin, mask, use_reentrant=False)
            else:
                hidden = layer(e, hidden, cos, sin, mask)
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        elements: CODElements,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """COD training forward over the sampled elements (SPEC section 3.3).

        Args:
            input_ids: ``(B, T)`` target tokens x_0..x_{T-1}.
            aux_hidden_states: ``(B, T, 3 * Ht)`` aux states g_t.
            elements: :func:`cod_sample`'s elements (positions in the EAGLE-shifted frame).
            position_ids: optional ``(B, T)`` RoPE positions (packed rows restart per
                document); element s rotates at ``position_ids[anchor] + depth``.
            document_ids: optional ``(B, T)`` document per position (packed rows).
            select: optional ``(B, S)`` bool (e.g. :func:`cod_targets`): return the logits of
                these elements only (the lm_head is the largest matmul).

        Returns:
            pre-norm hidden ``(B, S, H)`` (element s predicts x_{pos+2}; logits via
            :meth:`compute_logits`), or with ``select`` the ``(M, Vd)`` logits of the M
            selected elements in row-major order.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        a, d, v = elements.anchor, elements.depth, elements.valid
        pos = elements.pos.clamp_max(T - 1)
        is_mask = d > 0
        shifted = shift_left(input_ids, 1)  # tok[i] = x[i+1]
        ids = torch.where(is_mask, torch.full_like(pos, self.config.mask_token_id), shifted.gather(1, pos))
        fused = self.fc(aux_hidden_states)  # (B, T, H)
        hidden = fused.gather(1, pos.unsqueeze(-1).expand(-1, -1, fused.shape[-1]))  # (B, S, H)
        hidden = torch.where(is_mask.unsqueeze(-1), self.mask_state().to(hidden.dtype), hidden)
        rope_pos = position_ids.gather(1, a) + d
        mask = cod_attention_mask(elements, document_ids)
        hidden = self._run_layers(ids, hidden, torch.where(v, rope_pos, torch.zeros_like(rope_pos)), mask)
        return hidden if select is None else self.compute_logits(hidden[select])

    def forward_cached(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                       caches: list[Eagle3KVCache]) -> torch.Tensor:
        """Inference as vLLM runs it (SPEC section 3.2): new slots appended to the per-layer
        KV ``caches``, ordinary causal attention over everything cached.

        Args:
            input_ids: ``(B, T)`` slot tokens (x_{t+1} for real positions, ``mask_token_id``
                for mask slots).
            hidden: ``(B, T, H)`` fused states (``fc(g_t)`` or :meth:`mask_state`).
            position_ids: ``(B, T)`` RoPE positions (incrementing through the mask slots).
            caches: one :class:`~draftsmith.models.eagle3.Eagle3KVCache` per layer, appended to.

        Returns:
            pre-norm hidden ``(B, T, H)``.
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"{len(caches)} KV caches for {len(self.layers)} layers")
        embeds = F.embedding(input_ids, self.embed_tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            hidden = layer.forward_cached(embeds if i == 0 else None, hidden, cos, sin, cache)
        return hidden


def cod_targets(elements: CODElements, prediction_mask: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` bool: the elements trained on (valid, and ``prediction_mask`` at ``pos``)."""
    return elements.valid & prediction_mask.bool().gather(1, elements.pos)


def step0_prediction_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The EAGLE-3 step-0 loss mask on the shifted sequence (position i predicts x_{i+2})."""
    return ttt_prediction_mask(loss_mask, 0, document_ids)
