"""The XPress draft's configuration: DFlash's
(:class:`~draftsmith.models.dflash.config.DFlashConfig`) plus the causal refiner, with the two
``config.json`` layouts that carry it (docs/xpress.md):

- Format B, what vLLM 0.33 serves (``model_executor/models/qwen3_xpress.py``): the flat Qwen3
  config of DFlash's Format B with ``architectures: ["Qwen3XPressModel"]`` and the refiner's keys
  at top level, under the names vLLM reads (:data:`VLLM_KEYS`);
- Format A, what speculators 0.9 reads (``speculators_model_type: "xpress"``,
  ``XPressSpeculatorConfig``), written beside it as ``speculators_config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..dflash.config import DFlashConfig

XPRESS_ARCHITECTURES: tuple[str, ...] = ("Qwen3XPressModel", "DFlashQwen3XPressModel")
"""vLLM 0.33's XPress architectures (``config/speculative.py`` ``XPRESS_ARCHITECTURES``; its dflash
config rewrites the first into the second)."""

VLLM_KEYS: tuple[str, ...] = ("xpress_rank", "xpress_mlp_hidden", "xpress_block_size", "xpress_num_passes",
                              "xpress_topc")
"""The refiner's top-level ``config.json`` keys vLLM 0.33 reads, with its defaults 256, 512,
``num_speculative_steps + 1`` (16: vLLM never sets that attribute), 6 and 512."""

VLLM_DEFAULTS: dict[str, int] = {"xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_block_size": 16,
                                 "xpress_num_passes": 6, "xpress_topc": 512}

REFINER_FIELDS: tuple[str, ...] = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes", "xpress_topc")
"""The refiner's fields of :class:`XPressConfig` (and of the recipe's ``draft`` section)."""

SPECULATORS_KEYS: tuple[str, ...] = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")
"""The refiner's keys of speculators 0.9's ``XPressSpeculatorConfig`` (defaults 256, 2, 6)."""


@dataclass
class XPressConfig(DFlashConfig):
    """Architecture of an XPress draft: a DFlash draft plus the causal refiner head.

    Attributes (besides :class:`DFlashConfig`'s):
        xpress_rank: r, the refiner's width (token embedding ``[V, r]``, readout ``[V, r]``).
        xpress_mlp_ratio: the refiner's SwiGLU width is ``r * xpress_mlp_ratio``.
        num_jacobi_passes: K refine passes at inference (vLLM ``xpress_num_passes``).
        xpress_topc: C, each pass re-ranks the drafter's top-C tokens of a slot (0: the whole vocab).

    Raises:
        ValueError: as :class:`DFlashConfig`; a draft vocab smaller than the vocab (vLLM 0.33's
            refiner is defined over the target vocab and raises ``NotImplementedError``); a rank or
            ratio below 1; negative passes; ``xpress_topc`` outside ``[0, vocab_size]`` (vLLM refuses it).
    """

    xpress_rank: int = 256
    xpress_mlp_ratio: int = 2
    num_jacobi_passes: int = 6
    xpress_topc: int = 512

    speculators_type: ClassVar[str] = "xpress"
    architecture: ClassVar[str] = "Qwen3XPressModel"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: XPress drafts over the full target vocab "
                             f"({self.vocab_size}; vLLM 0.33's refiner has no d2t): set data.draft_vocab_size to "
                             "the target's vocab size")
        for key in ("xpress_rank", "xpress_mlp_ratio"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.num_jacobi_passes < 0:
            raise ValueError(f"num_jacobi_passes={self.num_jacobi_passes} must be >= 0")
        if not 0 <= self.xpress_topc <= self.vocab_size:
            raise ValueError(f"xpress_topc={self.xpress_topc} must be in [0, vocab_size={self.vocab_size}] "
                             "(vLLM 0.33 refuses it)")

    @property
    def mlp_hidden(self) -> int:
        """The refiner's SwiGLU width ``r * xpress_mlp_ratio`` (vLLM ``xpress_mlp_hidden``)."""
        return self.xpress_rank * self.xpress_mlp_ratio

    @classmethod
    def from_target(cls, target_config: Any, *args: Any, **kwargs: Any) -> XPressConfig:
        """:meth:`DFlashConfig.from_target` (its arguments) plus the refiner's fields
        (:data:`REFINER_FIELDS`) given as keywords."""
        refiner = {key: kwargs.pop(key) for key in REFINER_FIELDS if key in kwargs}
        return cls(**DFlashConfig.from_target(target_config, *args, **kwargs).to_dict(), **refiner)

    def vllm_fields(self) -> dict[str, int]:
        """:data:`VLLM_KEYS` with this draft's values."""
        return {"xpress_rank": self.xpress_rank, "xpress_mlp_hidden": self.mlp_hidden,
                "xpress_block_size": self.block_size, "xpress_num_passes": self.num_jacobi_passes,
                "xpress_topc": self.xpress_topc}

    def to_speculators(self, verifier: dict[str, Any], num_speculative_tokens: int, dtype: str, version: str,
                       draftsmith: dict[str, Any]) -> dict[str, Any]:
        """Format A: DFlash's speculators ``config.json`` as ``XPressSpeculatorConfig``
        (``speculators_model_type: "xpress"``, ``architectures: ["XPressSpeculator"]``) with
        :data:`SPECULATORS_KEYS`; ``xpress_topc`` (no speculators key) goes under ``draftsmith``."""
        out = super().to_speculators(verifier, num_speculative_tokens, dtype, version,
                                     dict(draftsmith, xpress_topc=self.xpress_topc))
        out["architectures"] = ["XPressSpeculator"]
        out.update(xpress_rank=self.xpress_rank, xpress_mlp_ratio=self.xpress_mlp_ratio,
                   num_jacobi_passes=self.num_jacobi_passes)
        return out

    def to_native(self, dtype: str) -> dict[str, Any]:
        """Format B, what vLLM 0.33 serves: DFlash's flat config with ``architectures:
        ["Qwen3XPressModel"]``, :data:`VLLM_KEYS` and ``sample_from_anchor: false`` at top level."""
        out = super().to_native(dtype)
        out.update(self.vllm_fields(), sample_from_anchor=False)
        return out

    @classmethod
    def export_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The refiner's fields of Format A (:data:`SPECULATORS_KEYS`, speculators' defaults) or B
        (:data:`VLLM_KEYS`, vLLM 0.33's defaults where a key is absent, as vLLM reads them).

        Raises:
            ValueError: ``sample_from_anchor`` true (vLLM 0.33's XPress refuses it); Format B:
                ``xpress_mlp_hidden`` not a multiple of ``xpress_rank``, or an ``xpress_block_size``
                (default 16) other than the config's ``block_size`` (vLLM's mixer would not fit).
        """
        if config.get("sample_from_anchor", False):
            raise ValueError("sample_from_anchor is true: XPress drafts in the fill-in layout (vLLM 0.33 refuses it)")
        if config.get("speculators_model_type") == cls.speculators_type:
            extra = config.get("draftsmith") or {}
            return {"xpress_rank": int(config.get("xpress_rank", 256)),
                    "xpress_mlp_ratio": int(config.get("xpress_mlp_ratio", 2)),
                    "num_jacobi_passes": int(config.get("num_jacobi_passes", 6)),
                    "xpress_topc": int(extra.get("xpress_topc", VLLM_DEFAULTS["xpress_topc"]))}
        got = {key: int(config.get(key, default)) for key, default in VLLM_DEFAULTS.items()}
        rank, hidden = got["xpress_rank"], got["xpress_mlp_hidden"]
        if rank < 1 or hidden % rank:
            raise ValueError(f"xpress_mlp_hidden={hidden} is not a multiple of xpress_rank={rank}")
        block = int(config.get("block_size", 16))
        if got["xpress_block_size"] != block:
            raise ValueError(f"xpress_block_size={got['xpress_block_size']} != block_size={block}: vLLM would build "
                             "the refiner's mixer for another block")
        return {"xpress_rank": rank, "xpress_mlp_ratio": hidden // rank,
                "num_jacobi_passes": got["xpress_num_passes"], "xpress_topc": got["xpress_topc"]}
