"""The EAGLE-3 draft layer's attentions (:mod:`draftsmith.models.eagle3.model` builds the layer):
the TTT attention they share (:func:`ttt_attention`, :class:`TTTAttention`, the inference
:class:`Eagle3KVCache`), Llama's (:class:`Eagle3Attention`, vLLM ``llama_eagle3``) and Qwen3's
(:class:`Qwen3Eagle3Attention`, vLLM ``qwen3_eagle3``); the multi-head latent attention of
``layer: mla`` is :mod:`draftsmith.models.eagle3.mla`.

Shapes: B batch, T positions, H hidden size, nh / nkv query / key-value heads, hd head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..attention import sdpa_with_mask
from ..common import RMSNorm
from .config import Eagle3Config
from .masks import TTTMask


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
    document_ids: torch.Tensor | None = None,
    mask: TTTMask | None = None,
) -> torch.Tensor:
    """Attention of TTT step ``len(keys) - 1`` under :func:`ttt_attention_mask`: ONE attention call
    over the step-major concatenation of every step's keys, memory linear in T (no ``T x T``
    score matrix is materialised; SDPA's flash / memory-efficient kernels, or flex-attention).

    Args:
        q: ``[B, nh, T, hd]`` queries of the current step.
        keys / values: one ``[B, nkv, T, hd]`` / ``[B, nkv, T, hd_v]`` tensor per step so far (index
            0 = step 0, last = current step), keys already RoPE-rotated; ``nkv`` divides ``nh`` (GQA);
            the value head width ``hd_v`` may differ from ``hd`` (MLA).
        scale: softmax scale (1/sqrt(hd)).
        document_ids: optional ``(B, T)`` document index per position (packed rows): the
            step-0 part never crosses a document boundary. Ignored when ``mask`` is given.
        mask: the unroll's :class:`TTTMask` (built once per forward); default: built here.

    Returns:
        ``[B, nh, T, hd_v]`` attention output.
    """
    T = q.shape[-2]
    if mask is None:
        mask = TTTMask.build(T, len(keys), q.device, document_ids)
    k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=2)  # (B, nkv, (k+1)T, hd)
    v = values[0] if len(values) == 1 else torch.cat(values, dim=2)
    return mask.attend(q, k, v, scale)


class TTTAttention(nn.Module):
    """What every EAGLE-3 draft attention shares: queries of TTT step k attend the keys/values of
    steps 0..k (``past`` plus this step's own, :func:`ttt_attention`), inference appends to an
    :class:`Eagle3KVCache`, and ``o_proj`` maps the heads' values back to H.

    A subclass builds the projections, sets ``scaling`` (the softmax scale), ``sliding_window``
    (tokens or None) and ``o_proj``, and defines ``_qkv(x, cos, sin)`` -> RoPE-rotated q
    ``(B, nh, T, hd_qk)``, k ``(B, nkv, T, hd_qk)`` and v ``(B, nkv, T, hd_v)``. The config's
    ``sliding_window`` applies at inference (:meth:`forward_cached`); in training the unroll's
    :class:`TTTMask` carries it."""

    scaling: float
    sliding_window: int | None
    o_proj: nn.Linear

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        mask: TTTMask | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Returns ``(output (B, T, H), this step's (key, value), each (B, nkv, T, hd))``.

        ``past``: the earlier steps' keys / values; ``mask``: the unroll's :class:`TTTMask`
        (default: plain TTT mask, no documents). A pure function of its inputs (the caller keeps
        the per-step list), so activation checkpointing can recompute it in backward."""
        q, k, v = self._qkv(x, cos, sin)
        steps = (*past, (k, v))
        out = ttt_attention(q, [c[0] for c in steps], [c[1] for c in steps], self.scaling, mask=mask)
        return self._out(out), (k, v)  # (B, T, H)

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: "Eagle3KVCache") -> torch.Tensor:
        """Inference: ``x (B, T, 2H)`` new positions appended to ``cache``; new query j
        sees every earlier cached key and the new ones causally (cache index = position, as in
        vLLM's KV cache), with a sliding window W only the keys less than W positions back.
        -> ``(B, T, H)``."""
        q, k, v = self._qkv(x, cos, sin)
        keys, values = cache.append(k, v)  # (B, nkv, L, hd)
        T, L = x.shape[1], keys.shape[2]
        mask = torch.ones(T, L, dtype=torch.bool, device=x.device).tril(diagonal=L - T)
        if self.sliding_window is not None:  # query j is at position L - T + j
            mask &= ~torch.ones_like(mask).tril(diagonal=L - T - self.sliding_window)
        return self._out(sdpa_with_mask(q, keys, values, mask, self.scaling))

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        raise NotImplementedError

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        """``(B, nh, T, hd_v)`` attention output -> ``o_proj`` ``(B, T, H)``."""
        B, _, T, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))


class Eagle3Attention(TTTAttention):
    """Llama self-attention whose q/k/v read ``[embedding ; hidden]`` (2H).

    ``input_size`` defaults to 2H (the EAGLE-3 layer); P-EAGLE's layers >= 1 read H."""

    def __init__(self, config: Eagle3Config, input_size: int | None = None):
        super().__init__()
        self.nh = config.num_attention_heads
        self.nkv = config.num_key_value_heads
        self.hd = config.head_dim
        self.scaling = 1.0 / math.sqrt(self.hd)
        bias = config.attention_bias
        d_in = input_size or 2 * config.hidden_size
        self.q_proj = nn.Linear(d_in, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(d_in, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(d_in, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, config.hidden_size, bias=bias and config.layer == "llama")
        self.sliding_window = config.sliding_window

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x (B, T, 2H)`` -> RoPE-rotated q ``(B, nh, T, hd)``, k and v ``(B, nkv, T, hd)``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def target_tensors(self, hidden_size: int) -> dict[str, torch.Tensor]:
        """:meth:`Eagle3DraftModel.init_layer_from_target`'s map: a target layer's ``self_attn.*`` tensor
        name -> the draft tensor (or view) it is copied into; the projections reading the layer input
        take the target's into their ``g`` columns ``[:, H:]``."""
        H = hidden_size
        out = {f"self_attn.{name}.weight": proj.weight[:, H:] for name, proj in
               (("q_proj", self.q_proj), ("k_proj", self.k_proj), ("v_proj", self.v_proj))}
        out["self_attn.o_proj.weight"] = self.o_proj.weight
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(self, name).bias is not None:
                out[f"self_attn.{name}.bias"] = getattr(self, name).bias
        return out


class Qwen3Eagle3Attention(Eagle3Attention):
    """Qwen3 self-attention (vLLM ``qwen3_eagle3``): Llama's, plus one RMSNorm over each query head
    (``q_norm``) and each key head (``k_norm``), weights ``[hd]`` shared by the heads, before RoPE;
    with ``attention_bias`` the q/k/v projections have biases and ``o_proj`` has none."""

    def __init__(self, config: Eagle3Config, input_size: int | None = None):
        super().__init__(config, input_size)
        self.q_norm = RMSNorm(self.hd, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, eps=config.rms_norm_eps)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x (B, T, 2H)`` -> q ``(B, nh, T, hd)``, k and v ``(B, nkv, T, hd)``: per-head RMSNorm, then RoPE."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def target_tensors(self, hidden_size: int) -> dict[str, torch.Tensor]:
        """:meth:`Eagle3Attention.target_tensors` plus the target's ``q_norm`` / ``k_norm``."""
        return super().target_tensors(hidden_size) | {"self_attn.q_norm.weight": self.q_norm.weight,
                                                      "self_attn.k_norm.weight": self.k_norm.weight}


class Eagle3KVCache:
    """Draft KV cache for inference (the reference decoder; vLLM keeps its own).

    Holds the draft layer's keys/values ``(B, nkv, L, hd)`` of every position appended so
    far; :meth:`crop` drops the tail (the chained steps of a proposal, or rejected drafts).
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, nkv, T, hd)`` keys / values; returns all cached keys and values."""
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
