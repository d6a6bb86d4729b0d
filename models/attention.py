"""The attention kernels the draft models share (EAGLE-3, DFlash, P-EAGLE and the methods built on
them): ``scaled_dot_product_attention`` with a bool mask and grouped key/value heads
(:func:`sdpa_with_mask`, the ``sdpa`` backend) and torch's ``flex_attention`` under a
``BlockMask`` (:func:`flex_attention`, the ``flex`` backend; :func:`~draftsmith.models.common.resolve_attention_backend`).
A ``BlockMask`` is built from tile flags the drafts derive from their masks' structure
(:func:`tile_block_mask`), never by evaluating the ``mask_mod`` over every (query, key) pair: the
kernel evaluates it inside the partial tiles only, so a bound such as a sliding window costs nothing
per step; what depends on the length bucket alone is built once per bucket (:func:`bucket_cached`).

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


FLEX_BLOCK = 128  # flex_attention's tile (query and key rows), torch's default sparse block size
BIG = 1 << 62  # beyond any position: the bound of a padding row, never within reach
_BUCKET_CACHE: dict[tuple, Any] = {}
_BUCKET_CACHE_SIZE = 64


def bucket_cached(key: tuple, build: Any) -> Any:
    """``build()``, kept per ``key``: the parts of the flex block masks that depend on the length
    bucket alone (built on the first batch of a bucket, reused by every later one). Not kept when
    its tensors are fake (a traced or fake-tensor step) or made under inference mode (flex would
    save them for backward, which inference tensors refuse); the oldest of 64 keys goes first."""
    from torch._subclasses.fake_tensor import is_fake

    hit = _BUCKET_CACHE.get(key)
    if hit is not None:
        return hit
    value = build()
    leaves = value if isinstance(value, (tuple, list)) else (value,)
    tensors = [getattr(x, "kv_num_blocks", x) for x in leaves]
    if torch.is_inference_mode_enabled() or any(isinstance(t, torch.Tensor) and is_fake(t) for t in tensors):
        return value
    if len(_BUCKET_CACHE) >= _BUCKET_CACHE_SIZE:
        _BUCKET_CACHE.pop(next(iter(_BUCKET_CACHE)))
    _BUCKET_CACHE[key] = value
    return value


def tile_block_mask(partial: torch.Tensor, full: torch.Tensor, q_len: int, kv_len: int, mask_mod: Any,
                    block_size: int = FLEX_BLOCK) -> Any:
    """A flex ``BlockMask`` from its tile flags, without evaluating ``mask_mod`` anywhere (the fused
    kernel evaluates it inside the ``partial`` tiles only): what ``create_block_mask`` builds from
    a dense ``(B, Q, KV)`` evaluation of ``mask_mod``, from ``O((Q / bs) * (KV / bs))`` flags that
    the caller derives from the mask's structure (per-position intervals: EAGLE-3's TTT mask,
    DFlash's anchor blocks).

    Args:
        partial / full: ``(B, nq, nk)`` bool, ``nq = ceil(q_len / bs)``, ``nk = ceil(kv_len / bs)``;
            ``full``: every (query, key) pair of the tile is allowed (``mask_mod`` not evaluated);
            ``partial``: some pair may be; disjoint. A tile in neither is skipped. ``B`` may be 1
            (broadcast over the batch; ``mask_mod`` must then not index by ``b``).
        mask_mod: the mask of the pairs (True = attend), as flex calls it ``(b, h, q_idx, kv_idx)``.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` with the key-major tables (forward) and the
        query-major ones (backward), int32 and contiguous, as ``create_block_mask`` returns them.
    """
    from torch.nn.attention.flex_attention import BlockMask

    flags = torch.stack([partial, full]).unsqueeze(2).to(torch.int8)  # (2, B, 1, nq, nk)

    def ordered(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # the set tiles first, ascending
        num = f.sum(-1, dtype=torch.int32)
        return num, torch.argsort(f, dim=-1, descending=True, stable=True).to(torch.int32)

    kv_num, kv_idx = ordered(flags)
    q_num, q_idx = ordered(flags.transpose(-1, -2))
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=kv_num[0], kv_indices=kv_idx[0],
                     full_kv_num_blocks=kv_num[1], full_kv_indices=kv_idx[1], q_num_blocks=q_num[0],
                     q_indices=q_idx[0], full_q_num_blocks=q_num[1], full_q_indices=q_idx[1],
                     BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod)


def tile_bounds(length: int, block_size: int = FLEX_BLOCK, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and last index ``(n,)`` int64 of each of the ``n = ceil(length / bs)`` tiles of
    ``length`` rows (the last tile ends at ``length - 1``)."""
    first = torch.arange(0, length, block_size, device=device)
    return first, (first + block_size - 1).clamp_max(length - 1)


def padded_tiles(x: torch.Tensor, block_size: int, fill: int) -> torch.Tensor:
    """``(..., n)`` -> ``(..., ceil(n / bs), bs)``, the tail padded with ``fill``."""
    n = x.shape[-1]
    pad = -n % block_size
    if pad:
        x = F.pad(x, (0, pad), value=fill)
    return x.view(*x.shape[:-1], -1, block_size)
