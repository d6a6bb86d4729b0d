"""The DFlash2 draft's configuration: DFlash's (:class:`~draftsmith.models.dflash.config.DFlashConfig`)
plus the grouped dynamic convolutions and the candidate selector, with the ``config.json`` keys
vLLM 0.32 reads them from (``transformers_utils/configs/speculators/algos.py`` ``update_dflash2``,
``model_executor/models/qwen3_dflash2.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..dflash.config import DFlashConfig

SELECTOR_KEYS: tuple[str, ...] = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The DFlash2 keys of ``config.json`` (top level in Format A, in ``dflash_config`` in Format B)."""


@dataclass
class DFlash2Config(DFlashConfig):
    """Architecture of a DFlash2 draft: a DFlash draft whose every decoder layer wraps attention
    and MLP in a block-local grouped dynamic convolution, plus a low-rank candidate selector that
    re-ranks the ``lm_head``'s top-K candidates of each block slot by the previous token.

    Attributes (besides :class:`DFlashConfig`'s):
        conv_kernel_size: T taps of each convolution (tap 0 is the row itself; taps never cross
            the block start).
        conv_group_size: gs channels sharing one dynamic coefficient; ``H / gs`` groups.
        selector_rank: r, width of the predecessor / successor codebooks ``[V, r]``.
        selector_top_k: K candidates per block slot.

    vLLM 0.32 serves only the full target vocab (its codebooks and walk index target ids; no
    ``d2t``) and ``sample_from_anchor: false``.

    Raises:
        ValueError: as :class:`DFlashConfig`; a draft vocab smaller than the vocab; ``conv_group_size``
            not dividing ``hidden_size`` (vLLM's ``DFlashGroupedConv`` refuses it); a kernel, rank
            or K below 1; K above the vocab (vLLM's top-K over the vocab cannot return it).
    """

    conv_kernel_size: int = 2
    conv_group_size: int = 64
    selector_rank: int = 256
    selector_top_k: int = 16

    speculators_type: ClassVar[str] = "dflash2"
    architecture: ClassVar[str] = "DFlash2DraftModel"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: DFlash2 drafts over the full target vocab "
                             f"({self.vocab_size}; vLLM 0.32 has no d2t for its candidate selector): set "
                             "data.draft_vocab_size to the target's vocab size")
        for key in SELECTOR_KEYS:
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size} "
                             "(vLLM's DFlashGroupedConv refuses it)")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k={self.selector_top_k} exceeds the vocab of {self.vocab_size}")

    @property
    def conv_groups(self) -> int:
        """G = ``hidden_size / conv_group_size``."""
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int], num_layers: int,
                    block_size: int, mask_token_id: int, sliding_window: int | None = None,
                    **selector: int) -> DFlash2Config:
        """:meth:`DFlashConfig.from_target` plus the :data:`SELECTOR_KEYS` given as keywords."""
        base = DFlashConfig.from_target(target_config, draft_vocab_size, aux_layer_ids, num_layers, block_size,
                                        mask_token_id, sliding_window=sliding_window)
        return cls(**base.to_dict(), **selector)

    def selector_fields(self) -> dict[str, int]:
        return {key: int(getattr(self, key)) for key in SELECTOR_KEYS}

    def to_speculators(self, verifier: dict[str, Any], num_speculative_tokens: int, dtype: str, version: str,
                       draftsmith: dict[str, Any]) -> dict[str, Any]:
        """Format A: DFlash's speculators ``config.json`` with ``speculators_model_type: "dflash2"``
        (vLLM serves it as ``method: "dflash"``, architecture ``DFlash2DraftModel``) and the
        :data:`SELECTOR_KEYS` at top level, where ``update_dflash2`` reads them."""
        out = super().to_speculators(verifier, num_speculative_tokens, dtype, version, draftsmith)
        out["architectures"] = ["DFlash2Speculator"]
        out.update(self.selector_fields())
        return out

    def to_native(self, dtype: str) -> dict[str, Any]:
        """Format B: the flat ``DFlash2DraftModel`` config, :data:`SELECTOR_KEYS` in ``dflash_config``."""
        out = super().to_native(dtype)
        out["dflash_config"].update(self.selector_fields())
        return out

    @classmethod
    def export_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The :data:`SELECTOR_KEYS` of Format A (top level) or B (``dflash_config``).

        Raises:
            KeyError: one is missing (vLLM's DFlash2 layers cannot be built without it).
        """
        source = config if config.get("speculators_model_type") == cls.speculators_type else config["dflash_config"]
        missing = [key for key in SELECTOR_KEYS if source.get(key) is None]
        if missing:
            raise KeyError(f"DFlash2 config.json lacks {', '.join(missing)}")
        if config.get("sample_from_anchor", source.get("sample_from_anchor", False)):
            raise ValueError("sample_from_anchor is true: vLLM 0.32's DFlash2 drafts from the mask slots only")
        return {key: int(source[key]) for key in SELECTOR_KEYS}
