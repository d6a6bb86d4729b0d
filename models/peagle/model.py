"""P-EAGLE draft: EAGLE-3 with parallel drafting (K tokens in one forward pass).

Follows P-EAGLE (arXiv:2602.01469) and the layout vLLM 0.32 serves as
``{"method": "eagle3", "parallel_drafting": true}`` (``llama_eagle3.py``, multi-layer;
docs/parallel_drafts.md and docs/formats.md, "P-EAGLE"):

    layer 0   : cat(input_layernorm(embed(x_{t+1})), hidden_norm(fc(g_t)))  -> attention (2H in) -> MLP
    layers >= 1: plain Llama pre-norm blocks on the hidden state only (no embedding, no hidden_norm)
    logits    : lm_head(norm(h))  over the draft vocab

Parallel drafting: after the bonus token ``b = x_{p+1}`` (hidden ``fc(g_p)``, RoPE position
p), vLLM appends K-1 *mask slots* (token ``mask_token_id``, hidden ``fc(mask_hidden)``, RoPE
positions p+1..p+K-1) and reads K draft logits from ONE causal forward. ``mask_hidden`` is a
learnable vector in the *raw* aux space ``[3 * Ht]`` that goes through the same ``fc`` as real
aux states (vLLM's ``combine_hidden_states``).

Training (docs/parallel_drafts.md, "P-EAGLE: conditional-drop (COD) elements"):
conditional-drop (COD) sampling of (anchor, depth) elements on
the EAGLE-shifted sequence (:func:`draftsmith.models.peagle.training.cod_sample`, vectorised on the batch's device with a fixed
number of slots per depth), one forward over all elements under the COD mask
(:func:`cod_attention_mask`; :class:`CODMask` builds it once per forward from per-element
interval keys, as an additive SDPA mask or a flex-attention block mask), the divergence to the
target at position ``anchor + depth`` computed in chunks of rows inside the forward
(:class:`~draftsmith.models.common.DistillTargets`). Depth 0 is exactly EAGLE-3's TTT step 0 (there is no TTT: vLLM never
feeds draft states back).

The pieces shared with EAGLE-3 (config, RoPE, first-layer ``cat(embed, hidden)`` attention,
norms, MLP, KV cache) are :mod:`draftsmith.models.eagle3.model`'s (the config :mod:`draftsmith.models.eagle3.config`'s).

Shapes: B batch, T tokens, S sampled elements per row, H hidden size, Ht target hidden size,
Vd draft vocab size, nh / nkv heads, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..attention import flex_attention, sdpa_with_mask
from ..common import ATTENTION_BACKENDS, DistillTargets, RMSNorm, TargetSharedDraft, resolve_attention_backend, shift_left
from ..eagle3.model import Eagle3DecoderLayer, Eagle3KVCache
from .config import PEagleConfig


# --------------------------------------------------------------------------------------
# COD sampling and the attention mask


@dataclass
class CODElements:
    """The sampled (anchor, depth) elements of a batch, S slots per row.

    Element s of row b sits at EAGLE-shifted position ``pos = anchor + depth``: depth 0 is the
    ordinary EAGLE input ``(x[pos+1], g_pos)``, depth d > 0 a mask slot of anchor's chain.
    The first T elements of every row are depth 0 at positions 0..T-1 (in order). Slots that
    hold no element (``valid`` False) have anchor 0 and depth 0.

    Attributes:
        anchor, depth: ``(B, S)`` int64.
        valid: ``(B, S)`` bool, False on empty slots.
        num_depths: an upper bound on the depths (every depth ``< num_depths``), host-side; None:
            S (the attention mask only needs a bound).
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    num_depths: int | None = None

    @property
    def pos(self) -> torch.Tensor:
        """``(B, S)`` EAGLE-shifted position ``anchor + depth`` (0 on empty slots)."""
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
        num_depths = max((max(d) for _, d in rows if d), default=0) + 1
        return cls(anchor.to(device), depth.to(device), valid.to(device), num_depths)


def cod_attention_keys(elements: CODElements, document_ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The COD attention rule as one interval test per (query, key): ``(x, lo, hi)``, each
    ``(B, S)`` int64, with ``allow(q, k) = lo[k] <= x[q] <= hi[k]`` equal to
    :func:`cod_attention_mask`'s rule.

    With R > every depth: ``x = anchor * R + depth``; a depth-0 key allows the queries whose
    anchor lies in ``[anchor_k, end of anchor_k's document]`` (``hi = doc_end * R + R - 1``), a
    depth-d key the queries of its own chain at depth >= d (``hi = anchor_k * R + R - 1``).
    Documents are contiguous runs of ``document_ids`` (as packing writes them). An empty slot
    s gets ``x = lo = hi = S * R + s``: it sees itself only and nobody sees it.
    """
    a, d, v = elements.anchor, elements.depth, elements.valid
    B, S = a.shape
    R = max(elements.num_depths or S, 1)
    if document_ids is None:
        end = torch.full_like(a, S - 1)
    else:
        T = document_ids.shape[1]
        idx = torch.arange(T, device=a.device)
        last = torch.ones_like(document_ids, dtype=torch.bool)
        last[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
        doc_end = torch.where(last, idx, T).flip(1).cummin(1).values.flip(1)  # (B, T) last index of the document
        end = doc_end.gather(1, a.clamp(0, T - 1))
    x = a * R + d
    hi = torch.where(d == 0, end, a) * R + (R - 1)
    empty = S * R + torch.arange(S, device=a.device)
    x = torch.where(v, x, empty)
    return x, x, torch.where(v, hi, empty)  # lo = x


def _row_chunks(B: int, S: int, elements: int = 1 << 24) -> int:
    """Query rows per chunk when filling a ``(B, S, S)`` mask: the ``(B, rows, S)`` temporaries
    stay below an eighth of the mask and near ``elements`` at most."""
    return max(16, min(elements // max(1, B * S), -(-S // 8)))


def cod_attention_mask(elements: CODElements, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, S, S)`` bool, True = query may attend key (speculators ``peagle/attention.py``)::

        allow(q, k) = same_doc & ((depth_k == 0 & anchor_k <= anchor_q)
                                  | (anchor_k == anchor_q & depth_k <= depth_q))

    so a mask slot sees the real context up to its own anchor and the earlier slots of its own
    chain, never a depth-0 entry of a later position: exactly what vLLM's causal forward over
    ``[context <= p, bonus, masks]`` gives. Empty keys are never attended; an empty query
    attends itself only (no empty softmax rows).

    Built from :func:`cod_attention_keys` by two comparisons per query chunk, written into the
    one ``(B, S, S)`` result (no other tensor of that size).

    Args:
        document_ids: optional ``(B, T)`` document per position (contiguous runs); an element's
            document is its anchor's.
    """
    x, lo, hi = cod_attention_keys(elements, document_ids)
    B, S = x.shape
    out = torch.empty(B, S, S, dtype=torch.bool, device=x.device)
    rows = _row_chunks(B, S)
    lo_k, hi_k = lo.unsqueeze(1), hi.unsqueeze(1)
    for i in range(0, S, rows):
        xq = x[:, i:i + rows].unsqueeze(-1)
        part = out[:, i:i + rows]
        torch.le(lo_k, xq, out=part)
        part &= xq <= hi_k
    return out


def cod_attention_bias(elements: CODElements, document_ids: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`cod_attention_mask` as an additive ``(B, 1, S, S)`` mask of ``dtype`` (0 = attend,
    -inf = not), the form SDPA converts a bool mask to on every call. Built once per forward and
    shared by every layer, it is the only ``S x S`` tensor alive (a bool mask would be converted,
    and its float copy saved for backward, once per layer). The rows are padded in memory to a
    multiple of 16 elements (a view of the first S columns), the alignment CUDA's
    memory-efficient kernel wants (otherwise it pads a copy on every call)."""
    x, lo, hi = cod_attention_keys(elements, document_ids)
    B, S = x.shape
    width = -(-S // 16) * 16
    bias = torch.empty(B, 1, S, width, dtype=dtype, device=x.device)[..., :S]
    rows = _row_chunks(B, S)
    lo_k, hi_k = lo.unsqueeze(1), hi.unsqueeze(1)
    for i in range(0, S, rows):
        xq = x[:, i:i + rows].unsqueeze(-1)
        allow = lo_k <= xq
        allow &= xq <= hi_k
        part = bias[:, 0, i:i + rows]
        part.fill_(float("-inf"))
        part.masked_fill_(allow, 0.0)
    return bias


def cod_block_mask(elements: CODElements, document_ids: torch.Tensor | None = None, block_size: int = 128):
    """:func:`cod_attention_mask` as a flex-attention ``BlockMask``, built from the per-element
    interval keys without any ``S x S`` tensor: per tile, the key block is *full* when every
    (query, key) pair passes the interval test (exact, from the blocks' min / max) and *partial*
    when the intervals overlap (a superset of the tiles with an allowed pair; ``mask_mod``
    decides inside them). Memory ``O((S / block_size)^2)``."""
    from torch.nn.attention.flex_attention import BlockMask

    x, lo, hi = cod_attention_keys(elements, document_ids)
    B, S = x.shape
    nb = -(-S // block_size)
    pad = nb * block_size - S
    big = 1 << 62
    real = F.pad(torch.ones_like(x, dtype=torch.bool), (0, pad), value=False).view(B, nb, block_size)
    xp = F.pad(x, (0, pad), value=0)
    lop = F.pad(lo, (0, pad), value=big)  # padded keys: never allowed, never full
    hip = F.pad(hi, (0, pad), value=-big)
    xb = xp.view(B, nb, block_size)
    x_min = torch.where(real, xb, big).amin(-1).unsqueeze(-1)  # (B, nb, 1) query blocks
    x_max = torch.where(real, xb, -big).amax(-1).unsqueeze(-1)
    lob, hib = lop.view(B, nb, block_size), hip.view(B, nb, block_size)
    lo_min, lo_max = lob.amin(-1).unsqueeze(1), lob.amax(-1).unsqueeze(1)  # (B, 1, nb) key blocks
    hi_min, hi_max = hib.amin(-1).unsqueeze(1), hib.amax(-1).unsqueeze(1)
    touch = (lo_min <= x_max) & (x_min <= hi_max)  # (B, nb, nb)
    full = (lo_max <= x_min) & (x_max <= hi_min)
    partial = touch & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = blocks.sum(-1, dtype=torch.int32).unsqueeze(1).contiguous()  # (B, 1, nb)
        idx = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True)
        return num, idx.to(torch.int32).unsqueeze(1).contiguous()  # (B, 1, nb, nb)

    def mask_mod(b, h, q_idx, kv_idx):
        xq = xp[b, q_idx]
        return (lop[b, kv_idx] <= xq) & (xq <= hip[b, kv_idx])

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(S, S))


class CODMask:
    """Who each COD element sees, built once per forward from the elements and shared by every
    layer (and by activation-checkpoint recomputation).

    ``"sdpa"``: one additive ``(B, 1, S, S)`` mask (:func:`cod_attention_bias`) made on the first
    call in the queries' dtype (autocast), one ``scaled_dot_product_attention`` per layer.
    ``"flex"``: a ``BlockMask`` (:func:`cod_block_mask`) and ``flex_attention`` (compiled on CUDA).

    Raises:
        ValueError: an unknown backend.
    """

    def __init__(self, elements: CODElements, document_ids: torch.Tensor | None = None, backend: str = "sdpa"):
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")
        backend = resolve_attention_backend(backend, elements.anchor.device)
        self.elements, self.document_ids, self.backend = elements, document_ids, backend
        self._bias: dict[torch.dtype, torch.Tensor] = {}
        self.block_mask = cod_block_mask(elements, document_ids) if backend == "flex" else None

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._bias:
            self._bias[dtype] = cod_attention_bias(self.elements, self.document_ids, dtype)
        return self._bias[dtype]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q (B, nh, S, hd)``, ``k / v (B, nkv, S, hd)`` -> ``(B, nh, S, hd)``."""
        if self.block_mask is not None:
            return flex_attention(q, k, v, self.block_mask, enable_gqa=q.shape[1] != k.shape[1])
        return sdpa_with_mask(q, k, v, self.bias(q.dtype))


# --------------------------------------------------------------------------------------
# Model


class PEagleDecoderLayer(Eagle3DecoderLayer):
    """One P-EAGLE layer. Layer 0 is the EAGLE-3 layer (``cat(embed, hidden)``, 2H q/k/v
    inputs, ``hidden_norm``); layers >= 1 are Llama pre-norm blocks on the hidden state
    (H q/k/v inputs, no ``hidden_norm``), as vLLM's ``llama_eagle3.LlamaDecoderLayer``: all of it
    :class:`Eagle3DecoderLayer`'s (cached inference too); only the training forward differs, one
    pass over the COD elements under their mask."""

    def forward(self, embeds: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: CODMask) -> torch.Tensor:
        """``hidden (B, S, H)`` (and ``embeds (B, S, H)`` for layer 0) under the elements'
        :class:`CODMask` -> pre-norm output ``(B, S, H)``."""
        x, residual = self._input(embeds, hidden)
        attn = self.self_attn
        q, k, v = attn._qkv(x, cos, sin)
        return self._output(residual, attn._out(mask.attend(q, k, v)))


class PEagleDraftModel(TargetSharedDraft):
    """P-EAGLE draft: ``fc`` fusion of three aux hidden states, ``num_layers`` decoder layers,
    a learnable ``mask_hidden [3 * Ht]`` (randn init) for the parallel slots.

    The token embedding is the target's: a frozen, non-persistent buffer (not saved, not
    exported; vLLM shares the target's) unless ``config.train_embeddings``, where it is a
    parameter saved as ``embed_tokens`` and exported as ``embed_tokens.weight``.
    ``d2t`` / ``t2d`` are persistent buffers (:mod:`draftsmith.data_prep.vocab`).
    ``attention_backend`` (the COD training forward only): ``"sdpa"`` (default) or ``"flex"``
    (:class:`CODMask`).
    """

    _no_split_modules = ["PEagleDecoderLayer"]  # FSDP unit

    def __init__(self, config: PEagleConfig, attention_backend: str = "auto"):
        super().__init__()
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")
        self.config = config
        self.attention_backend = attention_backend  # training forward only: "sdpa" or "flex" (CUDA, compiled)
        H, Ht = config.hidden_size, config.target_hidden_size
        if config.train_embeddings:
            self.embed_tokens = nn.Parameter(torch.zeros(config.vocab_size, H))
        else:
            self.register_buffer("embed_tokens", torch.zeros(config.vocab_size, H), persistent=False)
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(3 * Ht))
        self.layers = nn.ModuleList([PEagleDecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(H, eps=config.rms_norm_eps)
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

    compute_logits.fused_as = ("norm", "lm_head")  # lm_head(norm(.)): the fused loss may run it (train/losses.py)

    def _run_layers(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    mask: CODMask) -> torch.Tensor:
        embeds = F.embedding(ids, self.embed_tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        for i, layer in enumerate(self.layers):
            e = embeds if i == 0 else None
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
        targets: DistillTargets | None = None,
    ) -> Any:
        """COD training forward over the sampled elements (docs/parallel_drafts.md, "P-EAGLE:
        conditional-drop (COD) elements").

        Args:
            input_ids: ``(B, T)`` target tokens x_0..x_{T-1}.
            aux_hidden_states: ``(B, T, 3 * Ht)`` aux states g_t.
            elements: :func:`draftsmith.models.peagle.training.cod_sample`'s elements (positions in the EAGLE-shifted frame).
            position_ids: optional ``(B, T)`` RoPE positions (packed rows restart per
                document); element s rotates at ``position_ids[anchor] + depth``.
            document_ids: optional ``(B, T)`` document per position (packed rows).
            select: optional ``(B, S)`` bool (e.g. :func:`draftsmith.models.peagle.training.cod_targets`): return the logits of
                these elements only (boolean indexing: reads the mask on the host; tests and
                tools, the training step uses ``targets``).
            targets: the training step's :class:`~draftsmith.models.common.DistillTargets`: the divergence of every element
                against its teacher row, in chunks of rows recomputed in backward
                (:func:`~draftsmith.train.losses.chunked_distill`), so no ``(B*S, Vd)`` logits
                outlive a chunk.

        Returns:
            pre-norm hidden ``(B, S, H)`` (element s predicts x_{pos+2}; logits via
            :meth:`compute_logits`); with ``select`` the ``(M, Vd)`` logits of the M selected
            elements in row-major order; with ``targets`` a
            :class:`~draftsmith.train.losses.DistillOut` over the ``B*S`` elements in
            row-major order, or over ``targets.rows`` (``loss_sum`` with grad, detached
            ``row_loss`` / ``row_hit``).
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
        mask = CODMask(elements, document_ids, resolve_attention_backend(self.attention_backend, input_ids.device))
        hidden = self._run_layers(ids, hidden, torch.where(v, rope_pos, torch.zeros_like(rope_pos)), mask)
        if targets is not None:
            return targets(hidden, self.compute_logits)  # the B*S elements (or targets.rows of them)
        return hidden if select is None else self.compute_logits(hidden[select])

    def forward_cached(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                       caches: list[Eagle3KVCache]) -> torch.Tensor:
        """Inference as vLLM runs it (docs/parallel_drafts.md, "P-EAGLE at inference"): new slots
        appended to the per-layer
        KV ``caches``, ordinary causal attention over everything cached.

        Args:
            input_ids: ``(B, T)`` slot tokens (x_{t+1} for real positions, ``mask_token_id``
                for mask slots).
            hidden: ``(B, T, H)`` fused states (``fc(g_t)`` or :meth:`mask_state`).
            position_ids: ``(B, T)`` RoPE positions (incrementing through the mask slots).
            caches: one :class:`~draftsmith.models.eagle3.model.Eagle3KVCache` per layer, appended to.

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
