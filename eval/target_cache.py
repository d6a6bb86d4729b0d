"""The reference decoder's target cache (transformers ``DynamicCache``) and how a round's rejected
drafts leave it, for every layer kind the target families have.

Each round the target runs one forward pass over ``[x_m, d_1, ..., d_K]`` and then must forget
the rejected suffix ``d_{n+1} .. d_K``:

- Full-attention layers (``DynamicLayer``): the rejected keys / values are cut off (``crop``).
- Sliding-window layers (``DynamicSlidingWindowLayer``: gpt-oss, Gemma, ...): the layer keeps only
  its last ``W - 1`` positions, so once a prompt is longer than the window, the keys the rejected
  tokens pushed out are gone and transformers refuses to crop. The cache is built with those
  layers recording their past (``activate_past_recording``): a forward appends without
  trimming, and the crop after each round drops the rejected keys, then trims back to ``W - 1``.
- Linear-attention layers (``LinearAttentionLayer``: Qwen3-Next and Qwen3.5's Gated DeltaNet):
  the recurrent state ``S_t`` is one ``(heads, d_k, d_v)`` matrix updated by the gated delta
  rule, ``S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``. After the verification pass it
  has absorbed the rejected tokens; the update cannot be undone, and transformers' kernels
  return only the last state, not one per position. So the reference decoder **recomputes**:
  before the verification pass it copies those layers' conv and recurrent states
  (:func:`snapshot_linear_states`, a few KB per layer), and after a round with a rejection it
  puts them back, crops the attention layers to the committed length and runs the kept tokens
  ``[x_m, d_1, ..., d_n]`` through the target once more (:func:`rollback`). vLLM keeps the state
  after every draft position instead and picks the one of the accepted count; both give the
  state of exactly the committed tokens, the recomputation at the cost of one more target
  forward pass over ``n + 1`` tokens per round with a rejection (a round with every draft
  accepted keeps its state as it is).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def new_target_cache(config: Any) -> Any:
    """A ``DynamicCache`` with one layer per decoder layer of ``config`` (sliding, linear or full
    attention, from its ``layer_types``), the sliding-window layers recording their past so that
    :func:`crop_attention` can drop a rejected suffix past the window."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and not _is_linear(layer):
            layer.activate_past_recording()
    return cache


def _is_linear(layer: Any) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _attention_crop(layer: Any) -> Callable[[Any, int], None] | None:
    """The ``crop`` of ``layer``'s attention part (None for a linear-attention-only layer)."""
    from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

    if not _is_linear(layer):
        return type(layer).crop
    if not isinstance(layer, CacheLayerMixin):
        return None
    # a layer with both (linear attention + attention): crop the attention part only
    return DynamicSlidingWindowLayer.crop if isinstance(layer, DynamicSlidingWindowLayer) else DynamicLayer.crop


def crop_attention(cache: Any, length: int) -> None:
    """Drop every attention layer's cached positions past ``length`` (a negative count, as
    transformers 5 ``crop`` expects) and trim the sliding-window layers back to their window;
    linear-attention states are left as they are (see :func:`rollback`)."""
    for layer in cache.layers:
        crop = _attention_crop(layer)
        if crop is not None and getattr(layer, "is_initialized", True):
            crop(layer, -max(layer.get_seq_length() - length, 0))


def snapshot_linear_states(cache: Any) -> dict[int, tuple[dict, dict]] | None:
    """Copies of the conv and recurrent states of ``cache``'s linear-attention layers,
    ``{layer index: (conv states, recurrent states)}`` (each ``{state index: tensor or None}``),
    or None when the cache has no such layer (nothing to restore)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if _is_linear(layer):
            out[i] = tuple({k: None if v is None else v.clone() for k, v in states.items()}
                           for states in (layer.conv_states, layer.recurrent_states))
    return out or None


def restore_linear_states(cache: Any, snapshot: dict[int, tuple[dict, dict]]) -> None:
    """Put :func:`snapshot_linear_states`' copies back (in place: the layers keep their tensors)."""
    for i, (conv, recurrent) in snapshot.items():
        layer = cache.layers[i]
        for live, saved in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
            for k, v in saved.items():
                if v is None or live[k] is None or live[k].shape != v.shape:
                    live[k] = None if v is None else v.clone()
                else:
                    live[k].copy_(v)


def rollback(cache: Any, committed: int, kept: torch.Tensor, snapshot: dict | None,
             extend: Callable[[torch.Tensor, Any], Any]) -> None:
    """Leave ``cache`` holding exactly ``committed + len(kept)`` positions after a verification
    pass that appended more.

    Args:
        cache: the target cache after the verification pass.
        committed: positions cached before it.
        kept: ``(n + 1,)`` the tokens of that pass that stay (the pending token and the accepted
            drafts).
        snapshot: :func:`snapshot_linear_states` taken before the pass (None: no linear-attention
            layer, cropping the attention layers is enough).
        extend: ``extend(token_ids (T,), cache)`` runs the target over ``token_ids`` on ``cache``
            (the recomputation of the kept tokens; its outputs are not used).
    """
    total = cache.get_seq_length()
    if snapshot is None or committed + len(kept) >= total:
        crop_attention(cache, committed + len(kept))
        return
    restore_linear_states(cache, snapshot)
    crop_attention(cache, committed)
    extend(kept, cache)
    crop_attention(cache, committed + len(kept))  # trims the sliding-window layers
