"""DFlash block-diffusion draft (z-lab, arXiv:2602.06036) in the layout vLLM 0.32 serves
(``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``).

The draft is a Qwen3-style stack (per-head ``q_norm`` / ``k_norm``, SiLU-GLU MLP) that drafts a
whole block of ``B = block_size`` positions in one forward pass. The target's aux hidden states
``g_t`` (ascending vLLM aux ids, concatenated) are the *context*:

    C_t   = hidden_norm(fc(g_t))                          # (T, H), every committed position
    K_ctx = RoPE(k_norm(k_proj_l(C_t)), t)                # per layer l; V_ctx = v_proj_l(C_t)
    block = embed([x_a, M, M, ..., M]) at positions a..a+B-1   # anchor token + B-1 mask tokens
    h     = layers(block)  # keys/values = cat(K_ctx[t < a], K_block); the block is bidirectional
    logits_k = lm_head(norm(h_k))                         # slot k predicts x_{a+k} (same position)

No EAGLE shift: block slot k (k = 1..B-1) predicts the token *at* position a+k, whose target
distribution is ``p_{a+k-1}`` (docs/parallel_drafts.md, "Labels" and "DFlash at inference"). Context reaches
each layer only through that layer's k/v projections (no ``input_layernorm``, no separate
context projections).

Training (:meth:`DFlashDraftModel.forward`) runs many anchor blocks of one sequence at once,
each block attending to the context strictly before its anchor (and within its document for
packed rows; within ``sliding_window`` positions of each query if set) and to its own block; inference (:meth:`DFlashDraftModel.append_context` +
:meth:`DFlashDraftModel.propose_block`) runs exactly what vLLM runs (docs/parallel_drafts.md, "DFlash at inference").

Attention (:func:`block_attention`): the A*Bk block queries of a row attend in ONE
``scaled_dot_product_attention`` call per layer over ``[context (T) | all block tokens (A*Bk)]``
with a head-free bool mask built once per forward (:func:`block_attention_mask`), so no
``(nh, A*Bk, T)`` scores exist (fused kernels); ``attention_backend="flex"`` uses
``flex_attention`` with a block mask instead (compiled on CUDA), built from each query's context
interval (:func:`anchor_block_mask`: no dense mask, the window a bound on the interval). With ``targets``
(:class:`~draftsmith.models.common.DistillTargets`) the forward returns the distillation loss, computed in chunks of rows.

Shapes: B batch, T sequence length (tokens), A anchors per row, Bk block size, H hidden size,
Ht target hidden size, n number of aux layers, Vd draft vocab size, nh / nkv query / key-value
heads, hd head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRotaryEmbedding, rotate_half

from ..attention import (
    BIG,
    FLEX_BLOCK,
    bucket_cached,
    flex_attention,
    padded_tiles,
    sdpa_with_mask,
    tile_block_mask,
    tile_bounds,
)
from ..common import ATTENTION_BACKENDS, DistillTargets, RMSNorm, TargetSharedDraft, resolve_attention_backend
from .config import DFlashConfig


# --------------------------------------------------------------------------------------
# Layers


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (HF ``rotate_half``, vLLM's default for DFlash): ``x (B, heads, S, hd)``,
    ``cos`` / ``sin`` ``(B, S, hd)``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


@dataclass
class DFlashAttentionMask:
    """Who each block query sees, built once per forward and shared by every layer
    (:func:`block_attention_mask`).

    Attributes:
        context_len: T, the number of context keys in front of the block keys.
        block_size: Bk (queries ``j*Bk .. j*Bk+Bk-1`` form block j).
        keep: ``(B, 1, A*Bk, 1)`` float 0/1: 0 zeroes the output of an invalid block.
        allow: ``"sdpa"``: ``(B, 1, A*Bk, T + A*Bk)`` bool (True = attend), else None.
        flex: ``"flex"``: the ``torch.nn.attention.flex_attention.BlockMask``, else None.
    """

    context_len: int
    block_size: int
    keep: torch.Tensor
    allow: torch.Tensor | None = None
    flex: Any = None


def block_attention_mask(ctx_allow: torch.Tensor, block_valid: torch.Tensor, block_size: int,
                         backend: str = "sdpa", sliding_window: int | None = None,
                         anchors: torch.Tensor | None = None) -> DFlashAttentionMask:
    """The attention mask of A anchor blocks over ``[context (T) | all block tokens (A*Bk)]``.

    Query slot i of block j sees context position t iff ``ctx_allow[j, t]`` (t strictly before
    the anchor, same document) and the block is valid, and the Bk tokens of its own block
    (bidirectionally), never another block's. Every query row therefore sees at least its own
    block: no fully masked row (SDPA would return NaN there); an invalid (padding) block sees
    only itself and its output is zeroed afterwards by ``keep`` (no host sync).

    With ``sliding_window`` W, slot i of block j (at position ``anchors[j] + i``) sees context
    position t only if ``anchors[j] + i - t < W``: vLLM's window, where a query at position p
    sees the keys at ``p - W + 1 .. p + W - 1`` (non-causal), so slot i sees ``W - 1 - i``
    positions of context before the anchor; the block, within ``Bk <= W`` of itself, stays whole
    (docs/formats.md, "DFlash family: the sliding window").

    Args:
        ctx_allow: ``(B, A, T)`` bool.
        block_valid: ``(B, A)`` bool.
        block_size: Bk.
        backend: ``"sdpa"`` (a dense bool mask, ``A*Bk x (T + A*Bk)`` per row, no head dim) or
            ``"flex"`` (a ``flex_attention`` block mask from a ``mask_mod``).
        sliding_window: W in tokens, or None (the whole context).
        anchors: ``(B, A)`` long, each block's anchor on the context's axis (context key t sits
            at t); needed with ``sliding_window``.

    Raises:
        ValueError: an unknown backend; ``sliding_window`` without ``anchors``, or below Bk.
    """
    B, A, T = ctx_allow.shape
    Bk, L = block_size, A * block_size
    W = sliding_window
    if W is not None and (anchors is None or W < Bk):
        raise ValueError(f"sliding_window={W} needs the anchors and must be >= block_size={Bk}")
    ctx = ctx_allow & block_valid[..., None]  # (B, A, T)
    keep = block_valid[:, None, :, None].expand(B, 1, A, Bk).reshape(B, 1, L, 1).float()
    backend = resolve_attention_backend(backend, ctx_allow.device)
    if backend == "sdpa":
        blk = torch.arange(L, device=ctx_allow.device) // Bk
        own = (blk[:, None] == blk[None, :]).expand(B, L, L)
        ctx = ctx[:, :, None, :].expand(B, A, Bk, T).reshape(B, L, T)
        if W is not None:
            q_pos = (anchors[..., None] + torch.arange(Bk, device=anchors.device)).reshape(B, L, 1)
            ctx = ctx & (q_pos - torch.arange(T, device=anchors.device) < W)
        return DFlashAttentionMask(T, Bk, keep, allow=torch.cat([ctx, own], dim=-1)[:, None])
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            j = q_idx // Bk
            seen = ctx[b, j, kv_idx.clamp(max=T - 1)]
            if W is not None:
                seen = seen & (anchors[b, j] + q_idx % Bk - kv_idx < W)
            return torch.where(kv_idx < T, seen, (kv_idx - T) // Bk == j)

        cuda = ctx_allow.device.type == "cuda"
        flex = create_block_mask(mask_mod, B, None, L, T + L, device=ctx_allow.device, _compile=cuda)
        return DFlashAttentionMask(T, Bk, keep, flex=flex)
    raise ValueError(f"unknown attention backend {backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")


def document_first(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` document ids (contiguous runs) -> ``(B, T)`` int64, the first position of each
    position's document (its run)."""
    B, T = document_ids.shape
    start = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0), value=True)  # (B, T) True at a run's start
    return torch.where(start, torch.arange(T, device=document_ids.device), 0).cummax(-1).values


def anchor_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, context_len: int, block_size: int,
                      backend: str = "sdpa", sliding_window: int | None = None,
                      document_ids: torch.Tensor | None = None, tile: int | None = None) -> DFlashAttentionMask:
    """The mask of the training forward's anchor blocks (:meth:`DFlashDraftModel.block_hidden`):
    :func:`block_attention_mask` with the context of block j the positions strictly before its
    anchor ``anchors[b, j]``, in the anchor's document (``document_ids``: contiguous runs).

    ``"sdpa"``: exactly :func:`block_attention_mask` of the dense ``(B, A, T)`` context mask.
    ``"flex"``: the ``BlockMask`` from per-query intervals, without evaluating the mask anywhere but
    inside the kernel's partial tiles: slot i of block j sees the context keys
    ``max(start, a_j + i - W + 1) .. a_j - 1`` (``start`` the first position of the anchor's
    document; W the sliding window, a bound on the interval and nothing more) and its own block;
    an invalid block only its own block. The tile flags come from each query tile's least /
    greatest bounds (``O(L (T + L) / bs^2)``; ``tile``: the flex tile, default 128).

    Args:
        anchors / block_valid: ``(B, A)`` long / bool. context_len: T.

    Raises:
        ValueError: as :func:`block_attention_mask`.
    """
    B, A = anchors.shape
    T, Bk, W = context_len, block_size, sliding_window
    if W is not None and W < Bk:
        raise ValueError(f"sliding_window={W} needs the anchors and must be >= block_size={Bk}")
    device = anchors.device
    if resolve_attention_backend(backend, device) != "flex":
        ctx_allow = torch.arange(T, device=device)[None, None, :] < anchors[..., None]  # (B, A, T)
        if document_ids is not None:
            anchor_doc = document_ids.gather(1, anchors)  # (B, A)
            ctx_allow = ctx_allow & (document_ids[:, None, :] == anchor_doc[..., None])
        return block_attention_mask(ctx_allow, block_valid, Bk, backend, W, anchors)
    bs, L = tile or FLEX_BLOCK, A * Bk
    keep = block_valid[:, None, :, None].expand(B, 1, A, Bk).reshape(B, 1, L, 1).float()
    first = torch.zeros_like(anchors) if document_ids is None else document_first(document_ids).gather(1, anchors)
    if W is None:
        lo = first[..., None].expand(B, A, Bk)
    else:  # slot i stands at a + i: the keys less than W positions back
        back = bucket_cached(("dflash window", Bk, W, str(device)),
                             lambda: torch.arange(1 - W, Bk + 1 - W, device=device))  # (Bk,) i - W + 1
        lo = torch.maximum(first[..., None], anchors[..., None] + back)
    lo = torch.where(block_valid[..., None], lo, BIG).reshape(B, L)  # (B, L) an invalid block: no context
    hi = (anchors - 1).repeat_interleave(Bk, dim=1)  # (B, L)
    lo, hi = padded_tiles(lo, bs, BIG), padded_tiles(hi, bs, -BIG)  # (B, nq, bs); a padding query: no context
    k_first, k_last, k_full, b_touch, b_full = bucket_cached(("dflash tiles", T, L, Bk, str(device), bs),
                                                             lambda: _anchor_tiles(T, L, Bk, device, bs))
    touch = ((lo.amin(-1)[..., None] <= k_last) & (k_first <= hi.amax(-1)[..., None])) | b_touch  # (B, nq, nk)
    full = ((lo.amax(-1)[..., None] <= k_first) & (k_full <= hi.amin(-1)[..., None])) | b_full
    lo, hi = lo.flatten(1), hi.flatten(1)

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (lo[b, q_idx] <= kv_idx) & (kv_idx <= hi[b, q_idx])
        return seen | ((kv_idx >= T) & ((kv_idx - T) // Bk == q_idx // Bk))

    return DFlashAttentionMask(T, Bk, keep, flex=tile_block_mask(touch ^ full, full, L, T + L, mask_mod, bs))


def _anchor_tiles(T: int, L: int, Bk: int, device: torch.device, bs: int) -> tuple[torch.Tensor, ...]:
    """The constants of :func:`anchor_block_mask` for T context keys and L block queries: the first
    and last key of each key tile ``(1, nk)`` (the last for the full test beyond reach in a tile
    with padding keys), and the tiles where a query's own block touches / fills the key tile
    ``(nq, nk)`` (query q's block keys are ``T + (q // Bk) * Bk ..`` Bk of them)."""
    k_first, k_last = tile_bounds(T + L, bs, device)
    k_full = k_last.clone()
    if (T + L) % bs:
        k_full[-1] = BIG
    own = T + torch.arange(L, device=device) // Bk * Bk  # (L,) the first key of each query's block
    lo, hi = padded_tiles(own, bs, BIG), padded_tiles(own + Bk - 1, bs, -BIG)  # (nq, bs)
    touch = (lo.amin(-1)[:, None] <= k_last) & (k_first <= hi.amax(-1)[:, None])
    full = (lo.amax(-1)[:, None] <= k_first) & (k_full <= hi.amin(-1)[:, None])
    return k_first[None], k_last[None], k_full[None], touch, full


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, mask: DFlashAttentionMask, scale: float) -> torch.Tensor:
    """Anchor blocks attending to the context and bidirectionally to their own block: ONE
    attention call over the concatenated keys ``[context (T) | all block tokens (A*Bk)]``.

    Args:
        q: ``(B, nh, A*Bk, hd)`` block queries.
        k_ctx / v_ctx: ``(B, nkv, T, hd)`` context keys / values (shared by all blocks).
        k_blk / v_blk: ``(B, nkv, A*Bk, hd)`` the blocks' own keys / values.
        mask: :func:`block_attention_mask`.
        scale: softmax scale (hd ** -0.5).

    Returns:
        ``(B, nh, A*Bk, hd)``; exactly 0 for the queries of invalid blocks.

    Memory is linear in T per head: the CPU flash and CUDA memory-efficient SDPA kernels never
    build the ``(nh, A*Bk, T + A*Bk)`` scores; only the head-free mask is materialised. GQA
    (nkv < nh): on CPU the un-repeated keys go in with ``enable_gqa=True`` (the CPU flash
    kernel takes a mask and GQA together); on CUDA an explicit mask with ``enable_gqa`` falls
    back to the quadratic math kernel, so the keys are repeated per group there (linear in T).
    """
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    nh, nkv = q.shape[1], k.shape[1]
    if mask.flex is not None:
        out = flex_attention(q, k, v, mask.flex, scale, nkv != nh)
    else:
        out = sdpa_with_mask(q, k, v, mask.allow, scale)
    return out * mask.keep.to(out.dtype)


class DFlashAttention(nn.Module):
    """Qwen3 attention of one draft layer: per-head ``q_norm`` / ``k_norm`` before RoPE; the same
    ``k_proj`` / ``v_proj`` / ``k_norm`` project the context rows (vLLM's fused context KV)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, self.nh, self.nkv, self.hd = (config.hidden_size, config.num_attention_heads,
                                         config.num_key_value_heads, config.head_dim)
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=bias)
        self.q_norm = RMSNorm(self.hd, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, eps=config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (B, S, H)`` -> keys ``k_norm`` + RoPE and values, each ``(B, nkv, S, hd)`` (GQA
        groups not repeated)."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd)).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, mask: DFlashAttentionMask) -> torch.Tensor:
        """``x (B, A, Bk, H)`` normed block inputs, ``cos`` / ``sin`` ``(B, A*Bk, hd)`` at the block
        positions, context keys / values ``(B, nkv, T, hd)`` -> ``(B, A, Bk, H)``."""
        B, A, Bk, H = x.shape
        flat = x.reshape(B, A * Bk, H)
        q = self.q_norm(self.q_proj(flat).view(B, A * Bk, self.nh, self.hd)).transpose(1, 2)  # (B, nh, A*Bk, hd)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(flat, cos, sin)  # (B, nkv, A*Bk, hd)
        out = block_attention(q, k_ctx, v_ctx, k, v, mask, 1.0 / math.sqrt(self.hd))  # (B, nh, A*Bk, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, A, Bk, self.nh * self.hd))


class DFlashDecoderLayer(nn.Module):
    """One draft layer (vLLM ``DFlashQwen3DecoderLayer``): pre-norm attention over context +
    block, pre-norm SiLU-GLU MLP, residual adds."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.llama_config())

    def forward(self, h: torch.Tensor, context: torch.Tensor, ctx_cos: torch.Tensor, ctx_sin: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, mask: DFlashAttentionMask) -> torch.Tensor:
        """``h (B, A, Bk, H)``, ``context (B, T, H)`` = hidden_norm(fc(aux)) -> ``(B, A, Bk, H)``."""
        k_ctx, v_ctx = self.self_attn.kv(context, ctx_cos, ctx_sin)  # context: no input_layernorm
        return self.attend(h, k_ctx, v_ctx, cos, sin, mask)

    def attend(self, h: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mask: DFlashAttentionMask) -> torch.Tensor:
        """As :meth:`forward` with precomputed context keys / values ``(B, nkv, T, hd)``."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_ctx, v_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashKVCache:
    """Per-layer context keys / values ``(1, nkv, n, hd)`` of the committed positions (inference;
    vLLM keeps them in its paged cache). Only committed positions are appended, so nothing is
    ever cropped: the block's own keys are recomputed each proposal."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == len(self.keys):
            self.keys.append(k), self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)


class DFlashDraftModel(TargetSharedDraft):
    """DFlash draft: ``fc`` + ``hidden_norm`` over the aux states, L Qwen3-style layers, ``norm``,
    ``lm_head [Vd, H]``.

    The target's token embedding is a frozen, non-persistent buffer (not trained, not in
    checkpoints, not exported: vLLM shares the target's). ``d2t`` / ``t2d`` are persistent buffers
    (:mod:`draftsmith.data_prep.vocab`). Activation checkpointing is applied from outside
    (:func:`draftsmith.train.activation_checkpointing.apply_activation_checkpointing`).
    ``attention_backend`` (training forward only; ``train.attention_backend``): ``"sdpa"``
    (default) or ``"flex"`` (``flex_attention`` with a block mask, compiled on CUDA; on CPU it
    runs eagerly, forward only: torch has no flex backward on CPU).
    """

    _no_split_modules = ["DFlashDecoderLayer"]
    decoder_layer_cls: type[DFlashDecoderLayer] = DFlashDecoderLayer

    def __init__(self, config: DFlashConfig, attention_backend: str = "auto"):
        super().__init__()
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")
        self.config = config
        self.attention_backend = attention_backend
        H, n = config.hidden_size, len(config.aux_layer_ids)
        self.register_buffer("embed_tokens", torch.zeros(config.vocab_size, H), persistent=False)
        self.fc = nn.Linear(n * config.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([self.decoder_layer_cls(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())

    def context(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``(B, T, n*Ht)`` aux states -> context rows ``hidden_norm(fc(.))`` ``(B, T, H)``."""
        return self.hidden_norm(self.fc(aux_hidden_states))

    def block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """``(B, A)`` anchor tokens -> ``(B, A, Bk, H)`` embeddings of ``[x_a, M, ..., M]``."""
        B, A = anchor_ids.shape
        ids = torch.full((B, A, self.config.block_size), self.config.mask_token_id, dtype=torch.long,
                         device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return F.embedding(ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` pre-norm hidden -> ``(..., Vd)`` draft-vocab logits."""
        return self.lm_head(self.norm(hidden))

    compute_logits.fused_as = ("norm", "lm_head")  # lm_head(norm(.)): the fused loss may run it (train/losses.py)

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor, label_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                targets: DistillTargets | None = None) -> Any:
        """Training forward over A anchor blocks per row (docs/parallel_drafts.md, "DFlash: anchor blocks").

        Args:
            input_ids: ``(B, T)`` target tokens (right-padded).
            aux_hidden_states: ``(B, T, n*Ht)`` aux states at every position, unshifted.
            anchors: ``(B, A)`` anchor positions a (:func:`draftsmith.models.dflash.training.sample_anchors`).
            anchor_valid: ``(B, A)`` bool; False marks padding anchors (outputs zero, no NaN).
            label_mask: optional ``(B, A, Bk)`` bool (:func:`draftsmith.models.dflash.training.block_labels`): return logits only
                at those slots (boolean indexing: a host sync; training passes ``targets``).
            position_ids: optional ``(B, T)`` RoPE positions (packed rows restart per document);
                default ``0..T-1``. Block j sits at ``position_ids[a_j] + 0..Bk-1``.
            document_ids: optional ``(B, T)`` document per position (packed rows): blocks see
                only their anchor's document.
            targets: optional :class:`~draftsmith.models.common.DistillTargets` over block slots
                1..Bk-1 (``teacher_index`` / ``weight`` shaped ``(B, A, Bk - 1)``): compute the
                distillation loss here instead of returning logits.

        Returns:
            Without ``targets``: ``(B, A, Bk, Vd)`` logits (slot k predicts x_{a+k}; slot 0 is
            the anchor's own), or ``(M, Vd)`` at the M slots ``label_mask`` selects, in
            row-major order. With ``targets``: the ``chunked_distill`` output (``loss_sum`` with
            grad, detached per-row ``row_loss`` / ``row_hit``) over the ``B*A*(Bk-1)`` rows of
            slots 1..Bk-1.
        """
        h = self.block_hidden(input_ids, aux_hidden_states, anchors, anchor_valid, position_ids, document_ids)
        if targets is not None:
            return self.block_loss(targets, h[:, :, 1:])  # slots 1..Bk-1 (slot 0 is the anchor)
        if label_mask is not None:
            h = h[label_mask]  # (M, H)
        return self.compute_logits(h)

    def block_hidden(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, anchors: torch.Tensor,
                     anchor_valid: torch.Tensor, position_ids: torch.Tensor | None = None,
                     document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The pre-norm hidden states ``(B, A, Bk, H)`` of the A anchor blocks of each row (the
        body of :meth:`forward`; same arguments)."""
        B, T = input_ids.shape
        Bk = self.config.block_size
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        # the context strictly before each anchor, in its document
        mask = anchor_block_mask(anchors, anchor_valid, T, Bk,
                                 resolve_attention_backend(self.attention_backend, input_ids.device),
                                 self.config.sliding_window, document_ids)
        q_pos = position_ids.gather(1, anchors)[..., None] + torch.arange(Bk, device=input_ids.device)  # (B, A, Bk)
        context = self.context(aux_hidden_states)  # (B, T, H)
        ctx_cos, ctx_sin = self.rotary_emb(context, position_ids)  # (B, T, hd)
        cos, sin = self.rotary_emb(context, q_pos.flatten(1))  # (B, A*Bk, hd)
        h = self.block_embeddings(input_ids.gather(1, anchors)).to(context.dtype)  # (B, A, Bk, H)
        for layer in self.layers:
            h = layer(h, context, ctx_cos, ctx_sin, cos, sin, mask)
        return h

    def block_loss(self, targets: DistillTargets, hidden: torch.Tensor) -> Any:
        """The training loss of the trained block slots ``hidden (B, A, Bk-1, H)`` (pre-norm): the
        divergence ``targets`` computes through :meth:`compute_logits`."""
        return targets(hidden, self.compute_logits)

    # ----------------------------------------------------------------------------------
    # Inference, as vLLM runs it (docs/parallel_drafts.md, "DFlash at inference")

    @torch.no_grad()
    def append_context(self, cache: DFlashKVCache, aux_hidden_states: torch.Tensor,
                       positions: torch.Tensor) -> None:
        """Write the context keys / values of newly committed positions into ``cache``
        (vLLM's ``precompute_and_store_context_kv``).

        Args:
            aux_hidden_states: ``(n, n_aux*Ht)`` target aux states of those positions.
            positions: ``(n,)`` their token positions.
        """
        context = self.context(aux_hidden_states.unsqueeze(0))  # (1, n, H)
        cos, sin = self.rotary_emb(context, positions.unsqueeze(0))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(context, cos, sin)  # (1, nkv, n, hd)
            cache.append(i, k, v)

    @torch.no_grad()
    def propose_block(self, cache: DFlashKVCache, bonus_token: int, position: int, k: int) -> torch.Tensor:
        """One draft forward (:meth:`propose_hidden`) -> ``(k, Vd)`` float32 logits; row i-1 drafts
        the token at position P+i. Raises as :meth:`propose_hidden`."""
        return self.compute_logits(self.propose_hidden(cache, bonus_token, position, k)).float()

    @torch.no_grad()
    def propose_hidden(self, cache: DFlashKVCache, bonus_token: int, position: int, k: int) -> torch.Tensor:
        """One draft forward: the block ``[bonus, M * k]`` at positions ``position..position+k``
        attends to the cached context positions (those within ``config.sliding_window`` of each
        query, if set) and (non-causally) to itself.

        Args:
            cache: context of positions ``0..position-1`` (:meth:`append_context`).
            bonus_token: the pending token at ``position`` (target id).
            position: its token position P.
            k: drafts wanted, ``1 <= k <= block_size - 1``.

        Returns:
            ``(k, H)`` pre-norm hidden states of the mask slots (the anchor row's is discarded).

        Raises:
            ValueError: ``k`` outside ``[1, block_size - 1]``.
        """
        Bk = self.config.block_size
        if not 1 <= k <= Bk - 1:
            raise ValueError(f"k={k} drafts, but this DFlash draft was trained with block_size={Bk}: "
                             f"it proposes 1..{Bk - 1} tokens per block")
        return self.run_block(cache, bonus_token, position, k + 1)[1:]  # the anchor row's output is discarded

    @torch.no_grad()
    def run_block(self, cache: DFlashKVCache, bonus_token: int, position: int, n: int) -> torch.Tensor:
        """The draft layers over the block ``[bonus, M * (n-1)]`` at positions
        ``position..position+n-1`` (context: every cached position, cache index = position,
        within ``config.sliding_window`` of each query if set; the block non-causal).

        Returns:
            ``(n, H)`` pre-norm hidden states, one row per block slot.
        """
        device = self.fc.weight.device
        ids = torch.full((1, 1, n), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[..., 0] = bonus_token
        h = F.embedding(ids, self.embed_tokens).to(self.fc.weight.dtype)  # (1, 1, n, H)
        pos = torch.arange(position, position + n, device=device).unsqueeze(0)
        cos, sin = self.rotary_emb(h, pos)
        ctx_allow = torch.ones(1, 1, len(cache), dtype=torch.bool, device=device)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)
        mask = block_attention_mask(ctx_allow, valid, n, sliding_window=self.config.sliding_window,
                                    anchors=torch.full((1, 1), position, device=device))
        for i, layer in enumerate(self.layers):
            h = layer.attend(h, cache.keys[i], cache.values[i], cos, sin, mask)
        return h[0, 0]
