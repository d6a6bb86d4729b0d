"""The DFlash draft's configuration and its two ``config.json`` layouts (Format A, speculators;
Format B, z-lab / ModelOpt); the model is :mod:`draftsmith.models.dflash.model`, the exported
tensor set and the export detector :mod:`draftsmith.models.dflash.format`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from transformers import LlamaConfig

from ...draft_section import sliding_window_problem
from ...target import text_config
from ..common import LlamaLayerConfig, rope_theta_and_scaling

# vLLM's context-length keys of a config (the smallest present wins), the RoPE types whose
# max_position_embeddings already counts the scaling factor, and those whose max_position_embeddings
# only sizes the rotary cache (vLLM 0.33 config/model.py ``_get_and_verify_max_len``,
# config/speculative.py ``_CACHE_ONLY_ROPE_TYPES``)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
_CACHE_ONLY_ROPE = ("default", "linear", "llama3", "ntk", "proportional")


def served_context_length(target_config: Any) -> int | None:
    """The context length (tokens) vLLM serves ``target_config`` with by default: the smallest of
    its context-length keys, times the RoPE ``factor`` unless that length already counts it. None
    where the RoPE type is one whose ``max_position_embeddings`` enters the rotation (YaRN, dynamic
    NTK ...: a draft copying the target's keeps the target's length there) or no key is set.

    A DFlash-family draft shares the target's positions, so its ``max_position_embeddings`` must
    reach this: vLLM 0.33 otherwise raises it at load (``_maybe_override_draft_max_position_embeddings``).
    """
    text = text_config(target_config)
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    lengths = [int(v) for v in (getattr(text, key, None) for key in _CONTEXT_KEYS) if isinstance(v, (int, float))]
    if rope_type not in _CACHE_ONLY_ROPE or not lengths:
        return None
    factor = float(rope.get("factor") or 1.0) if rope_type not in _PRESCALED_ROPE else 1.0
    return int(min(lengths) * factor)


def layer_window(layer: dict[str, Any]) -> int | None:
    """The sliding window of a flat DFlash layer config, resolved as vLLM 0.33's
    ``qwen3_dflash.py`` resolves it: the layers of ``layer_types`` ``sliding_attention`` (every
    layer under ``dflash_config.use_swa``) see ``dflash_config.swa_window_size``, else
    ``sliding_window``, positions; None when no layer is windowed.

    Raises:
        ValueError: windowed and full layers mixed (a draftsmith draft has one window for every
            layer); windowed layers without a size.
    """
    dc = layer.get("dflash_config") or {}
    types = list(layer.get("layer_types") or [])
    sliding = [t == "sliding_attention" for t in types]
    if dc.get("use_swa") and not any(sliding):
        sliding = [True] * int(layer.get("num_hidden_layers", 1))
    if not any(sliding):
        return None
    if not all(sliding):
        raise ValueError(f"layer_types {types}: sliding and full attention layers mixed; draftsmith's "
                         "DFlash-family drafts use one window on every layer")
    window = dc.get("swa_window_size", layer.get("sliding_window"))
    if window is None:
        raise ValueError("layer_types name sliding_attention layers but neither sliding_window nor "
                         "dflash_config.swa_window_size gives the window")
    return int(window)


CANDIDATE_HEAD_ARCHITECTURES: tuple[str, ...] = ("DFlash2DraftModel", "LiLiCorrDraftModel")
"""vLLM 0.32's DFlash architectures with a candidate head (``config/vllm.py``
``_is_dflash_candidate_draft``): a plain DFlash reader refuses them (it would drop the head)."""


@dataclass
class DFlashConfig(LlamaLayerConfig):
    """Architecture of a DFlash draft for one target model.

    Attributes:
        hidden_size: H, equal to the target's (vLLM shares the target embedding of that width).
        intermediate_size: MLP width of each draft layer.
        num_layers: L draft decoder layers.
        num_attention_heads / num_key_value_heads / head_dim: attention geometry (head_dim is
            written explicitly: Qwen3 configs do not derive it).
        vocab_size: V, the target vocabulary (size of ``t2d``, rows of the shared embedding).
        draft_vocab_size: Vd, rows of ``lm_head`` (size of ``d2t``).
        aux_layer_ids: vLLM aux ids (target layer *inputs*, HF ``hidden_states[id]``), strictly
            ascending, in ``[1, num_target_layers - 1]``; ``fc`` reads ``len(aux_layer_ids) * Ht``.
        block_size: Bk = anchor + Bk-1 mask slots; served with ``num_speculative_tokens = Bk-1``.
        mask_token_id: the id embedded in the mask slots; must never occur in the data.
        target_hidden_size: Ht, width of each aux hidden state (default H).
        num_target_layers: decoder layers of the target (validates the aux ids), or None.
        rms_norm_eps, hidden_act, rope_theta, rope_scaling: as the target's (the draft's RoPE
            must rotate as vLLM rotates it).
        max_position_embeddings: positions the draft's RoPE covers, at least the context vLLM
            serves the target with (:func:`served_context_length`).
        attention_bias: q/k/v/o biases (Qwen3's ``attention_bias``).
        sliding_window: W, or None: every layer's block queries see only the keys within W
            positions of their own (query at position i, key at j: ``|i - j| < W``; the block
            lies within W of itself, so W trims the context: docs/formats.md, "DFlash family:
            the sliding window"), as vLLM runs a layer of ``layer_types`` ``sliding_attention``.

    Raises:
        ValueError: aux ids not strictly ascending, 0, or not below ``num_target_layers``; a
            draft vocab larger than the vocab; ``block_size < 2``; a mask id outside the vocab;
            a sliding window below ``block_size``.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    sliding_window: int | None = None

    speculators_type: ClassVar[str] = "dflash"  # Format A's speculators_model_type
    architecture: ClassVar[str] = "DFlashDraftModel"  # Format B's (and vLLM's) architecture name
    # what the anchor slot does (vLLM / speculators sample_from_anchor): here it holds the pending
    # token and drafts nothing; True where it drafts the next token too (DSpark)
    sample_from_anchor: ClassVar[bool] = False
    # vLLM's speculators reader turns sliding_window_non_causal false into causal attention on every
    # layer (update_dflash: dflash_config.causal); False where it ignores the key (update_dspark)
    causal_flag_on_every_layer: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        ids = self.aux_layer_ids
        if not ids:
            raise ValueError("aux_layer_ids is empty: DFlash needs at least one target layer as context")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"aux_layer_ids must be strictly ascending (vLLM concatenates aux states in layer "
                             f"order), got {ids}")
        if ids[0] < 1:
            raise ValueError(f"aux_layer_ids {ids}: aux id 0 is the embedding output, not a decoder layer's "
                             "(z-lab target_layer_ids are aux id - 1: add 1 when converting)")
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers:
            raise ValueError(f"aux_layer_ids {ids}: ids must be < the target's {self.num_target_layers} layers "
                             "(aux id N would be HF's post-norm hidden_states[N], which vLLM never captures)")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (anchor + at least one mask slot)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocab of {self.vocab_size}")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= block_size={self.block_size} "
                             "(a block always sees itself whole)")

    @property
    def target_layer_ids(self) -> list[int]:
        """z-lab / ModelOpt ``dflash_config.target_layer_ids``: vLLM aux id - 1."""
        return [i - 1 for i in self.aux_layer_ids]

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int], num_layers: int,
                    block_size: int, mask_token_id: int, sliding_window: int | None = None) -> DFlashConfig:
        """The draft geometry of a transformers target config (Llama-like, Qwen3 or gpt-oss):
        hidden / MLP / attention sizes, norm eps and RoPE copied from the target;
        ``max_position_embeddings`` raised to :func:`served_context_length` where the target's is
        shorter.

        Raises:
            ValueError: ``sliding_window`` not a positive multiple of 128 or beyond the target's
                ``max_position_embeddings`` (:func:`~draftsmith.draft_section.sliding_window_problem`);
                the class's checks.
        """
        text = text_config(target_config)
        geometry = cls.target_geometry(target_config)
        problem = sliding_window_problem(sliding_window, getattr(text, "max_position_embeddings", None))
        if problem:
            raise ValueError(problem)
        served = served_context_length(target_config)
        if served is not None:
            geometry["max_position_embeddings"] = max(geometry["max_position_embeddings"], served)
        return cls(**geometry, num_layers=num_layers, draft_vocab_size=draft_vocab_size,
                   aux_layer_ids=list(aux_layer_ids), block_size=block_size, mask_token_id=mask_token_id,
                   num_target_layers=text.num_hidden_layers, sliding_window=sliding_window)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def llama_config(self) -> LlamaConfig:
        """A Llama config with this geometry (for the shared RoPE and MLP modules)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope_parameters(), attention_bias=self.attention_bias, mlp_bias=False,
            tie_word_embeddings=False,
        )

    # ----------------------------------------------------------------------------------
    # Export formats (docs/formats.md, "DFlash"): Format A (speculators) and B (z-lab / ModelOpt).

    def to_layer_config(self) -> dict[str, Any]:
        """The flat Qwen3 config vLLM builds the draft stack from. A windowed draft's layers are
        all ``layer_types`` ``sliding_attention`` with ``use_sliding_window`` and
        ``sliding_window`` W (as speculators 0.9 writes them; ``max_window_layers`` 0 for readers
        that derive ``layer_types`` from it); vLLM 0.33's ``qwen3_dflash.py`` builds each such
        layer with that window (docs/formats.md, "DFlash family: the sliding window")."""
        window = self.sliding_window
        return {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            # both spellings: vLLM reads rope_parameters and defaults theta to 1e6 without it
            "rope_theta": self.rope_theta, "rope_parameters": self.rope_parameters(), "rope_scaling": self.rope_scaling,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0,
            "layer_types": ["full_attention" if window is None else "sliding_attention"] * self.num_layers,
            "use_sliding_window": window is not None, "sliding_window": window,
            **({} if window is None else {"max_window_layers": 0}),
            "tie_word_embeddings": False,
        }

    def to_speculators(self, verifier: dict[str, Any], num_speculative_tokens: int, dtype: str, version: str,
                       draftsmith: dict[str, Any]) -> dict[str, Any]:
        """Format A: the speculators ``"dflash"`` ``config.json`` (vLLM's ``algos.py`` hook).

        Every key vLLM 0.33's ``update_dflash`` reads is written, defaults included:
        ``draft_vocab_size``, ``target_hidden_size``, ``aux_hidden_state_layer_ids``,
        ``mask_token_id``, ``sample_from_anchor`` (False) and ``sliding_window_non_causal``,
        True: vLLM sets ``dflash_config.causal = not sliding_window_non_causal``, and the
        speculators library's default False would run every layer causally (vLLM PR #56692),
        windowed or not, a silent mismatch with the bidirectional block this draft was trained on.
        """
        return {
            "architectures": ["DFlashSpeculator"],
            "speculators_model_type": self.speculators_type,
            "speculators_version": version,
            "speculators_config": {
                "algorithm": self.speculators_type,
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": verifier,
            },
            "transformer_layer_config": self.to_layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "block_size": self.block_size,
            "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "mask_token_id": self.mask_token_id,
            "sliding_window_non_causal": True,
            "sample_from_anchor": False,
            "torch_dtype": dtype,
            "draftsmith": dict(draftsmith, num_target_layers=self.num_target_layers),
        }

    def to_native(self, dtype: str) -> dict[str, Any]:
        """Format B: the flat z-lab / ModelOpt ``DFlashDraftModel`` config (``dflash_config``
        with z-lab ``target_layer_ids`` = aux id - 1 and ``causal: false``)."""
        out = self.to_layer_config()
        out.update({
            "architectures": [self.architecture], "draft_vocab_size": self.draft_vocab_size,
            "torch_dtype": dtype, "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids,
                              "causal": False},
        })
        return out

    @classmethod
    def _from_layer(cls, layer: dict[str, Any], **fields: Any) -> DFlashConfig:
        rope_theta, rope_scaling = rope_theta_and_scaling(layer.get("rope_parameters"), layer.get("rope_theta"),
                                                          layer.get("rope_scaling"))
        return cls(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_layers=layer["num_hidden_layers"], num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            hidden_act=layer.get("hidden_act", "silu"), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=layer.get("max_position_embeddings", 4096),
            attention_bias=layer.get("attention_bias", False), sliding_window=layer_window(layer), **fields,
        )

    @classmethod
    def check_sample_from_anchor(cls, value: Any) -> None:
        """Refuse an export whose ``sample_from_anchor`` is not :attr:`sample_from_anchor`.

        Raises:
            ValueError: naming the key, its value and the layout draftsmith trains.
        """
        if bool(value) != cls.sample_from_anchor:
            slot = "drafts the next token" if cls.sample_from_anchor else "holds the pending token and drafts nothing"
            raise ValueError(f"sample_from_anchor is {str(bool(value)).lower()}: draftsmith trains {cls.speculators_type} "
                             f"drafts with sample_from_anchor {str(cls.sample_from_anchor).lower()} (the anchor slot "
                             f"{slot})")

    @classmethod
    def export_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The fields of a subclass read from an export's ``config.json`` (none here)."""
        return {}

    @classmethod
    def from_export(cls, config: dict[str, Any]) -> DFlashConfig:
        """Read Format A (``speculators_model_type``: :attr:`speculators_type`, as draftsmith and
        speculators 0.9's ``save_pretrained`` write it) or Format B (``dflash_config``), plus a
        subclass's :meth:`export_fields`.

        Raises:
            KeyError: a required key is missing.
            ValueError: neither format; another DFlash-family architecture (a DFlash2 export is
                no DFlash export, and back); a causal export (the draft is trained
                bidirectional); ``sample_from_anchor`` other than :attr:`sample_from_anchor`; a
                null ``mask_token_id`` or aux ids; invalid layer ids (see the class).
        """
        archs = config.get("architectures") or []
        family = CANDIDATE_HEAD_ARCHITECTURES + ("DFlashDraftModel",)
        foreign = [a for a in archs if a in family and a != cls.architecture]
        if foreign:
            raise ValueError(f"architectures {archs}: not a {cls.architecture} config")
        if config.get("speculators_model_type") == cls.speculators_type:
            layer = config["transformer_layer_config"]
            if config.get("sliding_window_non_causal", True) is not True and (
                    cls.causal_flag_on_every_layer or layer_window(layer) is not None):
                raise ValueError("sliding_window_non_causal is false: vLLM would run this draft's "
                                 f"{'windowed ' if layer_window(layer) else ''}layers causally; draftsmith trains "
                                 "bidirectional blocks")
            cls.check_sample_from_anchor(config.get("sample_from_anchor", False))  # vLLM's default for Format A
            null = [key for key in ("mask_token_id", "aux_hidden_state_layer_ids") if config.get(key) is None]
            if null:
                raise ValueError(f"{' and '.join(null)} null: vLLM cannot serve the draft without them")
            extra = config.get("draftsmith") or {}
            return cls._from_layer(
                layer, draft_vocab_size=config.get("draft_vocab_size", layer["vocab_size"]),
                aux_layer_ids=config["aux_hidden_state_layer_ids"], block_size=int(config.get(
                    "block_size", config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] + 1)),
                mask_token_id=config["mask_token_id"], target_hidden_size=config.get("target_hidden_size"),
                num_target_layers=extra.get("num_target_layers"), **cls.export_fields(config))
        if "dflash_config" in config:
            dc = config["dflash_config"]
            # vLLM 0.33's order: is_causal, dflash_config.causal, else causal exactly on sliding layers
            if config.get("is_causal", dc.get("causal", layer_window(config) is not None)):
                raise ValueError("dflash_config.causal is true (or unset on sliding_attention layers, is_causal "
                                 "true): vLLM would run this draft causally; draftsmith trains bidirectional blocks")
            cls.check_sample_from_anchor(dc.get("sample_from_anchor", config.get("sample_from_anchor",
                                                                                 cls.sample_from_anchor)))
            aux = [int(i) + 1 for i in dc["target_layer_ids"]]
            explicit = config.get("eagle_aux_hidden_state_layer_ids")
            if explicit is not None and list(explicit) != aux:
                raise ValueError(f"eagle_aux_hidden_state_layer_ids {explicit} != dflash_config.target_layer_ids + 1 "
                                 f"= {aux} (vLLM would capture the former)")
            return cls._from_layer(
                config, draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"], aux_layer_ids=aux,
                block_size=int(config.get("block_size", 16)), mask_token_id=dc["mask_token_id"],
                target_hidden_size=config.get("target_hidden_size"),
                num_target_layers=config.get("num_target_layers"), **cls.export_fields(config))
        raise ValueError(f"not a {cls.speculators_type} config: neither speculators_model_type "
                         f"{cls.speculators_type!r} nor a dflash_config")
