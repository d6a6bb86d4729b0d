"""EAGLE-3's training-time-test attention masks (:mod:`draftsmith.models.eagle3.model`'s module
docstring gives the attention rule): the dense masks of the SDPA / eager backends
(:func:`ttt_attention_mask`, :class:`TTTMask`) and the flex block masks, built from per-position
intervals once per length bucket (:func:`ttt_block_masks`) so that neither documents nor a sliding
window cost a dense mask per step.

Shapes: B batch, T sequence length (tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

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
from ..common import resolve_attention_backend


def same_document(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` document ids -> ``(B, T, T)`` bool, True where query and key share a document."""
    return document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)


def ttt_attention_mask(
    seq_len: int, step: int, device: torch.device | None = None, document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The TTT attention mask for queries of step ``step`` over the step-major concatenated keys.

    Keys are laid out step-major: ``[step-0 keys (T) | step-1 keys (T) | ... | step-k keys (T)]``.
    A query at position t may attend to step-0 keys at positions <= t (causal) and, for
    every later step 1..k, only to that step's key at the same position t (a diagonal).
    With ``document_ids`` (packed rows, see :mod:`draftsmith.train.packing`) the causal part
    is further restricted to keys of the query's own document; the diagonal is the query's
    own position, so it is always in the same document (no row is ever fully masked).
    With ``sliding_window`` W the causal part keeps the step-0 keys j with ``t - j < W - step``
    (the query stands at position t + step, see the module docstring); W > ``step``.

    The mask is bool and has no head dimension: ``(step + 1) * T^2`` bytes per row, shared by
    every head (the attention kernels never expand it to ``B * nh``).

    Args:
        document_ids: optional ``(T,)`` or ``(B, T)`` document index of each position.

    Returns:
        bool tensor ``[T, (step + 1) * T]`` (``[B, T, (step + 1) * T]`` with batched
        ``document_ids``); True = may attend.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if sliding_window is not None:  # drop the keys W - step or more rows back
        causal &= ~torch.ones_like(causal).tril(step - sliding_window)
    diag = torch.eye(seq_len, dtype=torch.bool, device=device)
    if document_ids is not None:
        causal = causal & same_document(document_ids)  # (T, T) or (B, T, T)
        diag = diag.expand_as(causal)
    return torch.cat([causal] + [diag] * step, dim=-1)


@dataclass
class TTTMask:
    """The attention masks of one TTT unroll, built once per forward and shared by its steps.

    ``dense``: bool ``(1 | B, 1, T, K * T)`` (:func:`ttt_attention_mask` for the last step, a head
    dimension of 1); step k reads the first ``(k + 1) * T`` key columns. With a sliding window the
    step-0 part narrows with the step, so ``dense`` is instead one such mask per step, step k's
    ``(1 | B, 1, T, (k + 1) * T)``. ``block_masks``: with the ``flex`` backend, one ``BlockMask`` per
    step (:func:`ttt_block_masks`: tiles that are fully masked are skipped, so the diagonal steps
    cost ``O(T)`` instead of ``O(T^2)``, and a window W ``O(T * W)``; built from per-key intervals,
    the window a bound in them, so it adds no work per step; unpacked rows reuse their length
    bucket's masks).
    """

    seq_len: int
    dense: torch.Tensor | list[torch.Tensor] | None = None
    block_masks: list[Any] | None = None

    @classmethod
    def build(cls, seq_len: int, steps: int, device: torch.device, document_ids: torch.Tensor | None = None,
              backend: str = "sdpa", sliding_window: int | None = None) -> "TTTMask":
        """Masks for ``steps`` TTT steps over ``seq_len`` positions (``document_ids (B, T)``: packed
        rows; ``sliding_window``: W tokens, None for full attention, see :func:`ttt_attention_mask`).

        Raises:
            ValueError: unknown ``backend`` (``auto``, ``sdpa`` or ``flex``); a window shorter than
                ``steps`` tokens (the last step's query would see no step-0 key).
        """
        if sliding_window is not None and sliding_window < steps:
            raise ValueError(f"sliding_window={sliding_window} is shorter than the TTT steps ({steps})")
        backend = resolve_attention_backend(backend, device)
        if backend == "sdpa":
            # 4-D (1|B, 1, T, K*T): a 3-D mask sends CPU SDPA to its math kernel (O(T^2) per head)
            def four_d(mask: torch.Tensor) -> torch.Tensor:
                return mask[:, None] if mask.dim() == 3 else mask[None, None]

            if sliding_window is None:
                return cls(seq_len, dense=four_d(ttt_attention_mask(seq_len, steps - 1, device, document_ids)))
            return cls(seq_len, dense=[four_d(ttt_attention_mask(seq_len, k, device, document_ids, sliding_window))
                                       for k in range(steps)])
        if backend == "flex":
            return cls(seq_len, block_masks=ttt_block_masks(seq_len, steps, device, document_ids, sliding_window))
        raise AssertionError(backend)  # resolve_attention_backend returns one of the two

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Queries ``(B, nh, T, hd)`` of step ``Tk / T - 1`` over the concatenated keys / values
        ``(B, nkv, Tk, hd)`` -> ``(B, nh, T, hd)``."""
        step = k.shape[2] // self.seq_len - 1
        if self.block_masks is not None:
            return flex_attention(q, k, v, self.block_masks[step], scale, enable_gqa=q.shape[1] != k.shape[1])
        mask = self.dense[step] if isinstance(self.dense, list) else self.dense[..., : k.shape[2]]
        return sdpa_with_mask(q, k, v, mask, scale)


def document_last(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` document ids (contiguous runs) -> ``(B, T)`` int64, the last position of each
    position's document (its run)."""
    B, T = document_ids.shape
    end = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (0, 1), value=True)  # (B, T) True at a run's end
    where = torch.where(end, torch.arange(T, device=document_ids.device), T)
    return where.flip(-1).cummin(-1).values.flip(-1)


def _ttt_tiles(T: int, step: int, device: torch.device, block_size: int) -> tuple[torch.Tensor, ...]:
    """Step ``step``'s tile constants of a length bucket (what :func:`ttt_block_masks` reads): per
    (query tile, key tile) whether some key's position is not after the tile's last query
    (``touch``) and whether every key's is at or before its first (``full``), ``(nq, nk)`` bool; the
    first / last query of each tile ``(nq, 1)`` (the last: beyond reach in a tile with padding queries,
    which is then never full); and the reach of the keys after the step-0 ones
    (``(nk * bs - T,)``: the diagonal keys reach only their own position; padding keys nothing)."""
    kv = (step + 1) * T
    pos = torch.arange(kv, device=device) % T  # each key's position (the first query that may see it)
    lo = padded_tiles(pos, block_size, BIG)  # (nk, bs); padding keys: never full
    first, last = tile_bounds(T, block_size, device)
    touch = lo.amin(-1)[None, :] <= last[:, None]  # (nq, nk)
    full = lo.amax(-1)[None, :] <= first[:, None]
    if T % block_size:  # a tile with padding queries is never full (as create_block_mask counts it)
        last = last.clone()
        last[-1] = BIG
    tail = F.pad(pos[T:], (0, -kv % block_size), value=-BIG)
    return touch, full, first[:, None], last[:, None], tail


def ttt_block_masks(seq_len: int, steps: int, device: torch.device, document_ids: torch.Tensor | None = None,
                    sliding_window: int | None = None, block_size: int | None = None) -> list[Any]:
    """The flex-attention ``BlockMask`` of every TTT step (:func:`ttt_attention_mask`'s rule), built
    from per-key intervals, without evaluating the mask anywhere but inside the kernel's partial
    tiles: the step-0 key at position j is seen by the queries ``j .. hi(j)``, ``hi(j)`` the last
    position of j's document (packed rows) and, with a sliding window W, at most ``j + W - 1 - k``
    at step k (the query of step k stands at position t + k); a step-s key (s >= 1) at j by query j
    alone. The ``mask_mod`` is that interval test, one load of ``hi`` per pair; the tile flags come
    from each key tile's least / greatest position and reach (``O(T^2 / bs^2)`` per step, no
    ``T x (k + 1) T`` evaluation). The window is only a bound in ``hi``: for every step at once, one
    ``minimum`` per forward on packed rows, nothing on unpacked ones (their masks depend on the
    length bucket alone and are built once per bucket).

    Args:
        document_ids: optional ``(B, T)`` document of each position, contiguous runs (packed rows;
            padding is one more run).
        block_size: the flex tile (default 128; tests use small tiles on short rows).

    Returns:
        ``steps`` ``BlockMask``s, step k's over ``(k + 1) * T`` keys; batch 1 (broadcast) without
        ``document_ids``.
    """
    T, bs, W = seq_len, block_size or FLEX_BLOCK, sliding_window
    dev = torch.device(device)
    if document_ids is None:  # the whole mask is the bucket's: built once
        return bucket_cached(("ttt masks", T, steps, W, str(dev), bs),
                             lambda: _build_ttt_block_masks(T, steps, dev, None, W, bs))
    return _build_ttt_block_masks(T, steps, dev, document_ids, W, bs)


def _build_ttt_block_masks(T: int, steps: int, device: torch.device, document_ids: torch.Tensor | None,
                           W: int | None, bs: int) -> list[Any]:
    if document_ids is None:
        last = torch.full((1, T), T - 1, dtype=torch.long, device=device)
    else:
        last = document_last(document_ids)  # (B, T)
    if W is None:
        reach = [last] * steps
    else:  # step k: at most W - 1 - k positions on; one minimum for every step
        def window_bound() -> torch.Tensor:  # (steps, T): j + W - 1 - k
            return torch.arange(T, device=device) + (W - 1 - torch.arange(steps, device=device))[:, None]

        bound = bucket_cached(("ttt window", T, steps, W, str(device)), window_bound)
        reach = torch.minimum(last[:, None, :], bound).unbind(1)  # steps x (B, T)
    masks = []
    for k in range(steps):
        touch0, full0, first, last_q, tail = bucket_cached(("ttt tiles", T, k, str(device), bs),
                                                           lambda: _ttt_tiles(T, k, device, bs))
        B = reach[k].shape[0]
        hi = torch.cat([reach[k], tail.expand(B, -1)], dim=1)  # (B, nk * bs): the last query each key may meet
        tiles = hi.view(B, -1, bs)
        touch = touch0 & (first <= tiles.amax(-1)[:, None, :])  # (B, nq, nk)
        full = full0 & (last_q <= tiles.amin(-1)[:, None, :])
        masks.append(tile_block_mask(touch ^ full, full, T, (k + 1) * T, _ttt_mask_mod(T, hi), bs))
    return masks


def _ttt_mask_mod(T: int, hi: torch.Tensor) -> Callable:
    """The pair test of :func:`ttt_block_masks`: key ``kv`` (position ``kv % T``) is seen by query
    ``q`` iff ``kv % T <= q <= hi[b, kv]`` (``hi`` of batch 1: every row alike)."""
    if hi.shape[0] == 1:
        row = hi[0]

        def shared(b, h, q_idx, kv_idx):
            return (kv_idx % T <= q_idx) & (q_idx <= row[kv_idx])

        return shared

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx % T <= q_idx) & (q_idx <= hi[b, kv_idx])

    return mask_mod
