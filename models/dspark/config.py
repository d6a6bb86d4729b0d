"""The DSpark draft's configuration and the ``config.json`` vLLM 0.32 reads for
``Qwen3DSparkModel`` (``model_executor/models/qwen3_dspark.py``); the model is
:mod:`draftsmith.models.dspark.model`, the tensor set and the exporter
:mod:`draftsmith.models.dspark.format` (docs/dspark.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..dflash.config import DFlashConfig

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
"""The ``architectures`` entry vLLM 0.32 maps to ``Qwen3DSparkForCausalLM`` (and detects method
``dspark`` by)."""


@dataclass
class DSparkConfig(DFlashConfig):
    """Architecture of a DSpark draft: a DFlash block drafter (every field of
    :class:`~draftsmith.models.dflash.config.DFlashConfig`) plus a low-rank Markov head and an
    optional confidence head.

    The block differs from DFlash's in its layout (vLLM's ``sample_from_anchor``): the
    ``block_size`` query slots are the anchor + ``block_size - 1`` mask slots and *every* slot is a
    prediction, slot k predicting the token after its own position (``x_{a+k+1}``), so a block
    proposes ``block_size`` tokens and is served with ``num_speculative_tokens = block_size``
    (vLLM's default for DSpark: ``num_speculative_tokens`` = the config's ``block_size``).

    Attributes (besides DFlash's):
        markov_rank: r, the rank of the Markov transition bias ``W2 @ W1[prev]`` (``markov_w1
            [V, r]`` over the target vocab, ``markov_w2 [Vd, r]`` over the draft vocab).
        confidence_head: ship ``confidence_head.proj`` (vLLM's ``enable_confidence_head``): a
            per-slot acceptance-probability estimate, used by vLLM only under
            ``enable_adaptive_verification``.
        confidence_head_with_markov: the confidence head reads ``cat(hidden, W1[prev])``
            (``[1, H + r]``) instead of the hidden state alone (``[1, H]``).

    Raises:
        ValueError: DFlash's checks; ``markov_rank < 1``.
    """

    markov_rank: int = 32
    confidence_head: bool = True
    confidence_head_with_markov: bool = True

    speculators_type: ClassVar[str] = "dspark"  # the speculators layout's speculators_model_type
    sample_from_anchor: ClassVar[bool] = True
    causal_flag_on_every_layer: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank} must be >= 1 (vLLM's Qwen3DSparkModel always builds "
                             "the Markov head)")

    @property
    def confidence_input_size(self) -> int:
        """Width of the confidence head's input: H, or H + r with the Markov embedding."""
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int], num_layers: int,
                    block_size: int, mask_token_id: int, markov_rank: int = 32, confidence_head: bool = True,
                    confidence_head_with_markov: bool = True, sliding_window: int | None = None) -> DSparkConfig:
        """As :meth:`DFlashConfig.from_target`, with the DSpark heads."""
        base = DFlashConfig.from_target(target_config, draft_vocab_size, aux_layer_ids, num_layers, block_size,
                                        mask_token_id, sliding_window=sliding_window)
        return cls(**base.to_dict(), markov_rank=markov_rank, confidence_head=confidence_head,
                   confidence_head_with_markov=confidence_head_with_markov)

    def to_dspark(self, dtype: str, draftsmith: dict[str, Any]) -> dict[str, Any]:
        """The ``config.json`` of an export: the flat Qwen3 layer config (its sliding window
        included, :meth:`to_layer_config`) with ``architectures: ["Qwen3DSparkModel"]``,
        ``dflash_config`` (mask id, z-lab ``target_layer_ids`` = aux id - 1, ``causal: false``)
        and, explicitly at defaults too, every DSpark key vLLM 0.33 reads, natively or through
        its speculators bridge (``update_dspark``): ``block_size``, ``markov_rank``,
        ``markov_head_type: "vanilla"``, ``enable_confidence_head``,
        ``confidence_head_with_markov``, ``sample_from_anchor: true`` (it decides vLLM's query
        layout), ``draft_vocab_size``, ``target_hidden_size``, ``mask_token_id``,
        ``aux_hidden_state_layer_ids`` / ``eagle_aux_hidden_state_layer_ids`` (aux ids) and
        ``target_layer_ids`` (aux id - 1), ``use_aux_hidden_state: true``."""
        out = self.to_native(dtype)
        out.update({
            "architectures": [DSPARK_ARCHITECTURE], "markov_rank": self.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": self.confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sample_from_anchor": True, "mask_token_id": self.mask_token_id,
            "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "target_layer_ids": self.target_layer_ids, "use_aux_hidden_state": True,
            "draftsmith": dict(draftsmith),
        })
        return out

    @classmethod
    def from_export(cls, config: dict[str, Any]) -> DSparkConfig:
        """Read a DSpark ``config.json``: draftsmith's flat ``Qwen3DSparkModel`` layout
        (:meth:`to_dspark`) or the speculators layout (``speculators_model_type: "dspark"``, as
        speculators 0.9's ``save_pretrained`` writes it), through :meth:`DFlashConfig.from_export`
        with the heads of :meth:`export_fields`.

        Raises:
            KeyError: a required key is missing.
            ValueError: neither layout; ``sample_from_anchor`` false (vLLM's 1+N fill-in layout,
                which this draft is not trained for; the speculators layout's default, as vLLM
                reads it); a Markov head type other than ``vanilla``; ``markov_rank`` 0 (no Markov
                head); DFlash's checks.
        """
        if (config.get("speculators_model_type") != cls.speculators_type
                and DSPARK_ARCHITECTURE not in (config.get("architectures") or [])):
            raise ValueError(f"not a DSpark config: neither speculators_model_type {cls.speculators_type!r} nor "
                             f"{DSPARK_ARCHITECTURE!r} in architectures {config.get('architectures')}")
        if config.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"markov_head_type {config.get('markov_head_type')!r}: only 'vanilla' (bias from the "
                             "previous token) is supported")
        return super().from_export(config)

    @classmethod
    def export_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The heads of either layout: ``markov_rank``, ``enable_confidence_head`` and
        ``confidence_head_with_markov`` (absent: false, as vLLM reads them)."""
        return {"markov_rank": int(config["markov_rank"]),
                "confidence_head": bool(config.get("enable_confidence_head", False)),
                "confidence_head_with_markov": bool(config.get("confidence_head_with_markov", False))}
