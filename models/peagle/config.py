"""The P-EAGLE draft's configuration (an EAGLE-3 geometry plus the parallel-drafting fields)
and its speculators ``peagle`` ``config.json``; the model is :mod:`draftsmith.models.peagle.model`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..eagle3.config import Eagle3Config, refuse_foreign_speculators


@dataclass
class PEagleConfig(Eagle3Config):
    """An :class:`~draftsmith.models.eagle3.config.Eagle3Config` plus the parallel-drafting fields.

    Attributes:
        num_layers: decoder layers (layer 0 reads ``cat(embed, hidden)``, the rest hidden only).
        num_depths: D, parallel depths trained (depth 0 = the bonus slot); serve K <= D.
        mask_token_id: token id of the mask slots (vLLM ``pard_token``); must never occur in the data.
        train_embeddings: whether ``embed_tokens`` is trained (and then exported).
    """

    norm_before_residual: bool = False
    num_layers: int = 2
    num_depths: int = 4
    mask_token_id: int = 0
    train_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        on = [k for k, v in self.eagle31_options().items() if v]
        if on:  # vLLM's peagle config reader keeps norm_before_fc only; this model has none of them
            raise ValueError(f"{', '.join(on)}: EAGLE-3.1 options are for draft.method eagle3 only (vLLM 0.32's "
                             "peagle reader drops fc_norm and norm_output, and the P-EAGLE draft has none of them)")
        if self.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {self.num_depths}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target vocab of {self.vocab_size}")

    @classmethod
    def from_eagle3(cls, base: Eagle3Config, **fields: Any) -> "PEagleConfig":
        """The P-EAGLE config of an EAGLE-3 geometry (e.g. :meth:`Eagle3Config.from_target`)."""
        values = {k: getattr(base, k) for k in Eagle3Config.__dataclass_fields__}
        values.update(fields)
        return cls(**values)

    def to_speculators(self, verifier: dict[str, Any], num_speculative_tokens: int, dtype: str,
                       version: str, draftsmith: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` of the speculators ``peagle`` format (vLLM's ``update_peagle`` hook):
        the EAGLE-3 file with the type switched, ``mask_token_id`` and ``norm_before_fc``, without
        the EAGLE-3.1 keys ``update_peagle`` does not read (``fc_norm``, ``norm_output``); every key
        it reads is written, ``norm_before_residual`` too (absent means False for peagle, True for eagle3).

        Raises:
            ValueError: ``num_speculative_tokens`` outside ``[1, num_depths]``.
        """
        if not 1 <= num_speculative_tokens <= self.num_depths:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be in [1, {self.num_depths}]: "
                             f"the draft was trained with num_depths={self.num_depths}")
        out = super().to_speculators(verifier, num_speculative_tokens, dtype, version, draftsmith)
        out["architectures"] = ["PEagleSpeculator"]
        out["speculators_model_type"] = "peagle"
        out["speculators_config"]["algorithm"] = "peagle"
        out["norm_before_fc"] = False
        for key in ("fc_norm", "norm_output"):
            out.pop(key)
        out["mask_token_id"] = self.mask_token_id
        out["embed_requires_grad"] = self.train_embeddings  # the speculators library's key (its default: True)
        out["tie_word_embeddings"] = False
        return out

    @classmethod
    def from_speculators(cls, config: dict[str, Any]) -> "PEagleConfig":
        """Inverse of :meth:`to_speculators`, and the reader of the speculators library's ``peagle``
        checkpoints (docs/speculators_interop.md). ``norm_before_residual`` defaults to False
        (vLLM's peagle hook); ``num_depths`` is ``draftsmith.num_depths``, else K;
        ``train_embeddings`` is ``draftsmith.train_embeddings``, else the library's
        ``embed_requires_grad`` (a trained embedding, shipped as ``embed_tokens.weight``).
        ``norm_before_fc`` and ``fc_norm`` are read and refused when on (this draft has neither
        norm); ``norm_output`` is not read: vLLM's peagle hook drops it and a parallel draft never
        feeds a hidden state back.

        Raises:
            KeyError: a required key (``transformer_layer_config``, ``draft_vocab_size``,
                ``mask_token_id``, ``eagle_aux_hidden_state_layer_ids``) is missing.
            ValueError: an inconsistent geometry, a ``mask_token_id`` that is no token id, an
                EAGLE-3.1 norm, or a draft of another kind (:func:`refuse_foreign_speculators`).
        """
        refuse_foreign_speculators(config, "peagle")
        layer = config["transformer_layer_config"]
        base = Eagle3Config.from_layer_config(layer, config["draft_vocab_size"],
                                              config["eagle_aux_hidden_state_layer_ids"],
                                              config.get("target_hidden_size"),
                                              bool(config.get("norm_before_residual", False)))
        mask = config["mask_token_id"]
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise ValueError(f"mask_token_id {mask!r}: vLLM's pard_token must be a token id")
        facts = Eagle3Config.export_facts(config)
        extra = config.get("draftsmith") or {}
        depths = extra.get("num_depths") or facts.num_speculative_tokens or 1
        embeddings = extra.get("train_embeddings", config.get("embed_requires_grad", False))
        return cls.from_eagle3(base, num_depths=int(depths),
                               mask_token_id=mask, train_embeddings=bool(embeddings),
                               norm_before_fc=facts.eagle31["norm_before_fc"], fc_norm=facts.eagle31["fc_norm"])
