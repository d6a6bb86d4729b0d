"""The attention kernels the draft models share (EAGLE-3, DFlash, P-EAGLE and the methods built on
them): ``scaled_dot_product_attention`` with a bool mask and grouped key/value heads
(:func:`sdpa_with_mask`, the ``sdpa`` backend) and torch's ``flex_attention`` under a
``BlockMask`` (:func:`flex_attention`, the ``flex`` backend; :func:`~draftsmith.models.common.resolve_attention_backend`).

Shapes: B batch, nh / nkv query / key-value heads, Tq / Tk query / key length, hd head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import repeat_kv


def sdpa_supports_gqa_with_mask(device: torch.device) -> bool:
    """Whether ``scaled_dot_product_attention(..., attn_mask=bool, enable_gqa=True)`` runs a fused
    kernel on ``device``: yes on CPU (torch's flash kernel for CPU takes masks and GQA); on CUDA
    a mask excludes the flash kernel and ``enable_gqa`` is not supported by the memory-efficient
    one, so SDPA would fall back to the math kernel (``O(T^2)`` per head): there the key/value
    heads are expanded instead (``repeat_kv``, a copy linear in T)."""
    return device.type == "cpu"


def sdpa_with_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with a bool mask (True = attend) and grouped key/value
    heads, on a kernel that keeps memory linear in the key length (see
    :func:`sdpa_supports_gqa_with_mask`).

    Args:
        q: ``(B, nh, Tq, hd)``. k / v: ``(B, nkv, Tk, hd)`` with ``nh % nkv == 0``.
        mask: bool (True = attend) or additive float in q's dtype, 4-D and broadcastable to
            ``(B, nh, Tq, Tk)`` with a head dimension of 1; every query row must allow a key.
    """
    groups = q.shape[1] // k.shape[1]
    native = groups > 1 and sdpa_supports_gqa_with_mask(q.device)
    if groups > 1 and not native:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=native)


_compiled_flex: Any = None


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """torch's ``flex_attention`` under a ``BlockMask`` (EAGLE-3, DFlash and P-EAGLE's ``flex``
    backend): ``torch.compile``d on CUDA, the fused kernel that skips fully masked tiles and keeps
    memory linear in the key length; eager elsewhere, an unfused reference that materialises the
    scores and has no backward on the CPU in torch 2.13 (tests only). The trainer pads every
    batch to one of a few length buckets under flex (:func:`draftsmith.train.packing.length_bucket`:
    one with packing, four without), so EAGLE-3 sees one or a few row lengths; shapes are left to
    torch.compile's automatic dynamic marking, so a second shape (another bucket, DFlash's anchor
    count, P-EAGLE's element count) compiles one dynamic-shape kernel and no shape after it compiles
    again (``dynamic=False`` would recompile for every new shape up to the recompile limit)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as _flex

    if q.device.type != "cuda":
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return _flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(_flex)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
