"""The EAGLE-3 draft's configuration (:class:`Eagle3Config`) and what an export's
``config.json`` says about it (:class:`Eagle3ExportFacts`); the model is
:mod:`draftsmith.models.eagle3.model`, the on-disk layouts :mod:`draftsmith.models.eagle3.format`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from transformers import LlamaConfig

from ...target import text_config
from ...target.families import MLA_KEYS
from ..common import LlamaLayerConfig, rope_theta_and_scaling
from .recipe import DRAFT_LAYERS, layer_option_problem

#: The EAGLE-3.1 options: top-level ``config.json`` keys that vLLM 0.32's ``llama_eagle3`` reads
#: (``norm_before_fc`` also from ``eagle_config``) and the speculators library writes.
EAGLE31_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")

#: ``layer`` -> (``model_type``, ``architectures``) of the layer config an export writes. The MLA
#: layer's is DeepSeek-V2's: vLLM 0.32 turns a draft config of ``model_type`` ``deepseek_v3`` into its
#: MTP draft (``SpeculativeConfig.hf_config_override``), never into ``deepseek_eagle3``.
LAYER_CONFIGS = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                 "mla": ("deepseek_v2", "DeepseekV2ForCausalLM")}

#: ``layer`` -> ``architectures`` of a legacy export, the draft class vLLM's registry maps to the
#: layer's module (``llama_eagle3`` / ``qwen3_eagle3`` / ``deepseek_eagle3``).
LEGACY_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM",
                        "mla": "Eagle3DeepseekV2ForCausalLM"}

#: Why an MLA draft needs ``q_lora_rank``: vLLM 0.32's ``deepseek_eagle3`` maps ``kv_a_proj_with_mqa``
#: into ``fused_qkv_a_proj`` (``q_a_proj`` and it, stacked) whatever the config says, so a draft with a
#: full-rank ``q_proj`` (``q_lora_rank`` null, DeepSeek-V2-Lite's layout) does not load.
MLA_FULL_RANK_QUERY = ("vLLM 0.32's deepseek_eagle3 loads an MLA draft only with a low-rank query (it fuses "
                       "kv_a_proj_with_mqa with q_a_proj); set draft.mla.q_lora_rank (e.g. the target's kv_lora_rank)")

#: Layer config ``model_type`` values read as the MLA layer (the DeepSeek-V2 / V3 family, Kimi K2).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def layer_of(layer: dict[str, Any]) -> str:
    """The draft layer (``llama`` / ``qwen3`` / ``mla``) of a layer config: ``qwen3`` for ``model_type``
    ``qwen3``, ``mla`` for a DeepSeek-family config (:data:`MLA_MODEL_TYPES`) or one with a
    ``kv_lora_rank``, else ``llama`` (vLLM's default for a speculators layer config without ``model_type``)."""
    model_type = layer.get("model_type", "llama")
    if model_type in MLA_MODEL_TYPES or layer.get("kv_lora_rank"):
        return "mla"
    return "qwen3" if model_type == "qwen3" else "llama"


@dataclass
class Eagle3Config(LlamaLayerConfig):
    """Architecture of an EAGLE-3 draft for one target model.

    Attributes:
        hidden_size: H, equal to the target's hidden size (the draft shares its embedding).
        intermediate_size: width of the draft decoder layer's MLP.
        num_attention_heads / num_key_value_heads / head_dim: attention geometry.
        vocab_size: V, the target vocabulary size (size of ``t2d``).
        draft_vocab_size: Vd, rows of the draft ``lm_head`` (size of ``d2t``).
        aux_layer_ids: the three target layer ids whose *inputs* (residual stream after
            L layers, vLLM's convention) are fused by ``fc``; ascending.
        target_hidden_size: width of each aux hidden state (``fc`` reads 3x this).
        norm_before_residual: whether the residual branch carries ``hidden_norm(g)``.
        norm_before_fc / fc_norm / norm_output: the EAGLE-3.1 options (all False: EAGLE-3), as
            vLLM's ``llama_eagle3`` and the speculators library read them (top-level keys of the
            export's ``config.json``): one RMSNorm ``input_norm`` over ``cat(aux)`` (width 3 * Ht)
            before ``fc``; one RMSNorm ``fc_norm.{i}`` per aux hidden state (width Ht) before
            ``fc``; the next draft step (TTT step, chained proposal) reads the post-norm hidden
            ``norm(h)`` instead of the pre-norm ``h``. See docs/formats.md, "EAGLE-3.1".
        rms_norm_eps, hidden_act, rope_theta, rope_scaling, max_position_embeddings:
            as in a Llama config; copied from the target so draft RoPE matches serving
            (``max_position_embeddings`` at least the target's, so vLLM never has to raise it).
        sliding_window: W tokens, or None (full attention): the draft layer's query at position
            p attends to keys at positions p' with ``p - p' < W`` only (vLLM's window, W keys
            counting its own); written and read as the layer config's ``sliding_window`` /
            ``layer_types`` / ``use_sliding_window`` (docs/formats.md, "EAGLE-3 sliding window").
        num_layers: decoder layers (``draft.num_layers``; 1, the paper's draft): layer 0 reads
            ``cat(embed, hidden)``, each later one the hidden state only (vLLM's ``llama_eagle3``
            builds ``transformer_layer_config.num_hidden_layers`` of them).
        layer: the decoder layer (``draft.layer``, :data:`~draftsmith.models.eagle3.recipe.DRAFT_LAYERS`):
            ``llama``, ``qwen3`` (per-head ``q_norm`` / ``k_norm`` RMSNorms of width ``head_dim`` on q and k
            before RoPE; q/k/v biases with ``attention_bias``, no ``o_proj`` bias) or ``mla`` (multi-head
            latent attention, :mod:`draftsmith.models.eagle3.mla`).
        q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: the ``mla``
            layer's geometry (DeepSeek-V2 config keys, all required: :data:`MLA_FULL_RANK_QUERY` says
            why ``q_lora_rank`` is); None for the other layers. With ``mla``, ``head_dim`` is the
            query/key head width ``qk_nope_head_dim + qk_rope_head_dim`` and ``num_key_value_heads``
            equals ``num_attention_heads`` (every head has its own keys and values, decompressed from
            the latent).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int | None = None
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    num_layers: int = 1
    layer: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if len(self.aux_layer_ids) != 3:
            raise ValueError(
                f"aux_layer_ids must name exactly 3 target layers, got {self.aux_layer_ids}"
            )
        if list(self.aux_layer_ids) != sorted(self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be ascending, got {self.aux_layer_ids}")
        for key in EAGLE31_OPTIONS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false (an EAGLE-3.1 option), got {getattr(self, key)!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"sliding_window must be a positive number of tokens or null, got {window!r}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be a whole number of decoder layers >= 1, got {self.num_layers!r}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]"
            )
        self._check_layer()

    def _check_layer(self) -> None:
        """Raise ValueError (one line naming the key) for a layer draftsmith does not build or vLLM
        does not serve with these options, or an inconsistent MLA geometry."""
        if self.layer not in DRAFT_LAYERS:
            raise ValueError(f"layer {self.layer!r}: no EAGLE-3 draft layer vLLM serves (known: {', '.join(DRAFT_LAYERS)})")
        problem = layer_option_problem(self.layer, "", norm_before_fc=self.norm_before_fc,
                                       sliding_window=self.sliding_window, attention_bias=self.attention_bias,
                                       mlp_bias=self.mlp_bias, hidden_act=self.hidden_act)
        if problem:
            raise ValueError(problem)
        mla = {k: getattr(self, k) for k in MLA_KEYS}
        if self.layer != "mla":
            if any(v is not None for v in mla.values()):
                raise ValueError(f"layer {self.layer!r} has no MLA geometry, got {mla}")
            return
        if not mla["q_lora_rank"]:
            raise ValueError(f"q_lora_rank {mla['q_lora_rank']!r}: {MLA_FULL_RANK_QUERY}")
        missing = [k for k in MLA_KEYS[1:] if not mla[k]]
        if missing:
            raise ValueError(f"layer 'mla' needs {', '.join(missing)} (positive)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates channel pairs, it must be even")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim != qk or self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"layer 'mla': head_dim must be qk_nope_head_dim + qk_rope_head_dim = {qk} (got "
                             f"{self.head_dim}) and num_key_value_heads num_attention_heads = {self.num_attention_heads} "
                             f"(got {self.num_key_value_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_scaling.rope_type {rope_type!r}: vLLM's deepseek_eagle3 (layer mla) rotates with "
                             "DeepSeek's YaRN or no scaling")

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        norm_before_residual: bool = True,
        sliding_window: int | None = None,
        layer: str = "llama",
        mla: dict[str, int | None] | None = None,
        num_layers: int = 1,
        **eagle31: bool,
    ) -> "Eagle3Config":
        """Build the draft geometry from a transformers target config (Llama-like or gpt-oss).

        ``sliding_window``: the draft's attention window (tokens; None: full attention).
        ``layer``: the decoder layer (``draft.layer``); ``mla``: with ``layer="mla"``, the recipe's
        ``draft.mla`` (:data:`~draftsmith.target.families.MLA_KEYS`, None = the target's).
        ``num_layers``: decoder layers (``draft.num_layers``).
        ``eagle31``: the EAGLE-3.1 options (:data:`EAGLE31_OPTIONS`) to set.

        Raises:
            ValueError: ``layer="mla"`` on a target without multi-head latent attention, or an option
                vLLM does not serve with that layer (one line naming the key, the value and what works).
        """
        geometry = cls.target_geometry(target_config)
        if layer == "mla":
            geometry.update(cls.mla_geometry(target_config, mla or {}))
        return cls(**geometry, draft_vocab_size=draft_vocab_size, aux_layer_ids=list(aux_layer_ids),
                   norm_before_residual=norm_before_residual, sliding_window=sliding_window, layer=layer,
                   num_layers=num_layers, **eagle31)

    @staticmethod
    def mla_geometry(target_config: Any, overrides: dict[str, int | None]) -> dict[str, Any]:
        """The ``mla`` layer's fields from the target's MLA config keys, each overridden where
        ``overrides`` (the recipe's ``draft.mla``) is not None; ``head_dim`` the query/key head width,
        ``num_key_value_heads`` the query heads.

        Raises:
            ValueError: the target has no multi-head latent attention (no ``kv_lora_rank``): vLLM's
                ``deepseek_eagle3`` is served next to a DeepSeek-V2/V3-style target only; or no query
                LoRA rank in the target nor the overrides (:data:`MLA_FULL_RANK_QUERY`).
        """
        text = text_config(target_config)
        if not getattr(text, "kv_lora_rank", None):
            kind = getattr(text, "model_type", None) or type(text).__name__
            raise ValueError(f"draft.layer=mla: the target ({kind}) has no multi-head latent attention (no "
                             "kv_lora_rank in its config), and vLLM's deepseek_eagle3 drafts for DeepSeek-V2/V3-style "
                             "targets; use draft.layer llama or qwen3")
        fields = {k: overrides.get(k) if overrides.get(k) is not None else getattr(text, k, None) for k in MLA_KEYS}
        if not fields["q_lora_rank"]:
            raise ValueError(f"draft.mla.q_lora_rank: the target has none (a full-rank q_proj) and {MLA_FULL_RANK_QUERY}")
        fields["head_dim"] = (fields["qk_nope_head_dim"] or 0) + (fields["qk_rope_head_dim"] or 0)
        fields["num_key_value_heads"] = text.num_attention_heads
        return fields

    def eagle31_options(self) -> dict[str, bool]:
        """``{option: value}`` of the EAGLE-3.1 options (:data:`EAGLE31_OPTIONS`), in that order."""
        return {k: getattr(self, k) for k in EAGLE31_OPTIONS}

    def eagle31_keys(self) -> dict[str, bool]:
        """The EAGLE-3.1 keys a legacy export's ``config.json`` carries at its top level: all three
        when any option is on, none for a plain EAGLE-3 draft (vLLM reads an absent key as False).
        The speculators export writes all three always (:meth:`to_speculators`)."""
        options = self.eagle31_options()
        return options if any(options.values()) else {}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def llama_config(self) -> LlamaConfig:
        """The Llama config of one draft layer (vLLM's view of each; the layer count is ``num_layers``)."""
        cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope_parameters(),
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            tie_word_embeddings=False,
        )
        return cfg

    # ----------------------------------------------------------------------------------
    # Export formats (docs/formats.md, "EAGLE-3"): the writer and the reader of each live here.

    def to_layer_config(self) -> dict[str, Any]:
        """The layer config vLLM builds the ``num_hidden_layers`` draft layers from
        (``transformer_layer_config`` of the speculators format; the top level of the legacy
        format): a Llama config, a Qwen3 config
        (``model_type`` ``qwen3``: vLLM's speculators reader then builds ``Eagle3Qwen3ForCausalLM``;
        no ``mlp_bias``, which Qwen3 has not) or, for ``mla``, a DeepSeek-V2 config carrying the
        latent attention geometry (:data:`LAYER_CONFIGS`)."""
        model_type, architecture = LAYER_CONFIGS[self.layer]
        out = {
            "model_type": model_type,
            "architectures": [architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta/rope_scaling.
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": self.rope_parameters(),
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": False,
            **self.sliding_window_keys(self.num_layers),
        }
        if self.layer == "qwen3":
            del out["mlp_bias"]
        if self.layer == "mla":  # transformers' DeepSeek config sets head_dim (its RoPE width) itself
            for key in ("head_dim", "mlp_bias", "layer_types", "use_sliding_window", "sliding_window"):
                del out[key]
            out.update({k: getattr(self, k) for k in MLA_KEYS})
        return out

    def sliding_window_keys(self, num_layers: int) -> dict[str, Any]:
        """The layer-config keys of :attr:`sliding_window` for ``num_layers`` draft layers, as the
        speculators library writes them and vLLM's Llama / Qwen3 attention reads them (a layer is
        windowed when its ``layer_types`` entry is ``sliding_attention``; it then takes
        ``sliding_window``): ``layer_types``, ``use_sliding_window`` and ``sliding_window``; all
        layers ``full_attention`` and ``sliding_window`` null without a window."""
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return {"layer_types": [kind] * num_layers, "use_sliding_window": self.sliding_window is not None,
                "sliding_window": self.sliding_window}

    @staticmethod
    def sliding_window_of(layer: dict[str, Any]) -> int | None:
        """Inverse of :meth:`sliding_window_keys`: the window of a layer config as vLLM's Llama
        attention reads it (``sliding_window`` when ``layer_types`` names ``sliding_attention``,
        else None: a ``sliding_window`` without ``layer_types`` is not applied by vLLM).

        Raises:
            ValueError: ``layer_types`` mixes windowed and full layers (draftsmith drafts use one window).
        """
        kinds = set(layer.get("layer_types") or [])
        if len(kinds) > 1:
            raise ValueError(f"transformer_layer_config.layer_types mixes {sorted(kinds)}: draftsmith drafts use "
                             "one attention window for every layer")
        return layer.get("sliding_window") if kinds == {"sliding_attention"} else None

    def to_speculators(self, verifier: dict[str, Any], num_speculative_tokens: int, dtype: str,
                       version: str, draftsmith: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` of the speculators format (vLLM detects it by ``speculators_config``).

        Args:
            verifier: ``{"name_or_path", "architectures"}`` of the target.
            num_speculative_tokens: K of the default (greedy) proposal method.
            dtype: ``torch_dtype`` of the exported weights.
            version: ``speculators_version`` (the speculators config schema followed).
            draftsmith: provenance written under the ``draftsmith`` key (ignored by readers).
        """
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": version,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                     "verifier_accept_k": 1, "accept_tolerance": 0.0}
                ],
                "verifier": verifier,
            },
            # every key vLLM's speculators reader (update_eagle3) reads, written even at its default
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "norm_before_residual": self.norm_before_residual,
            **self.eagle31_options(),
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "transformer_layer_config": self.to_layer_config(),
            "draftsmith": draftsmith,
        }

    def to_legacy(self, dtype: str, draftsmith: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` of the legacy format (weights ``midlayer.*``): the layer config at the top
        level, ``architectures`` the vLLM draft class (:data:`LEGACY_ARCHITECTURES`:
        ``LlamaForCausalLMEagle3``, ``Eagle3Qwen3ForCausalLM``, ``Eagle3DeepseekV2ForCausalLM``)."""
        out = self.to_layer_config()
        out.update({
            "architectures": [LEGACY_ARCHITECTURES[self.layer]],
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual,
            **self.eagle31_keys(),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
            "torch_dtype": dtype,
            "draftsmith": draftsmith,
        })
        return out

    @classmethod
    def from_layer_config(cls, layer: dict[str, Any], draft_vocab_size: int, aux_layer_ids: list[int],
                          target_hidden_size: int | None, norm_before_residual: bool,
                          **eagle31: bool) -> Eagle3Config:
        """The config of a layer config (Llama, Qwen3 or DeepSeek-V2 MLA: :func:`layer_of`) plus the
        EAGLE-3 fields (either format); ``eagle31``: the EAGLE-3.1 options (:data:`EAGLE31_OPTIONS`)."""
        rope_theta, rope_scaling = rope_theta_and_scaling(layer.get("rope_parameters"), layer.get("rope_theta"),
                                                          layer.get("rope_scaling"))
        kind = layer_of(layer)
        heads = layer["num_attention_heads"]
        if kind == "mla":
            attention = {k: layer.get(k) for k in MLA_KEYS} | {
                "num_key_value_heads": heads, "head_dim": layer["qk_nope_head_dim"] + layer["qk_rope_head_dim"]}
        else:
            attention = {"num_key_value_heads": layer["num_key_value_heads"],
                         "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads}
        return cls(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads, layer=kind, **attention,
            vocab_size=layer["vocab_size"], draft_vocab_size=draft_vocab_size, aux_layer_ids=list(aux_layer_ids),
            target_hidden_size=target_hidden_size, norm_before_residual=norm_before_residual,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-5), hidden_act=layer.get("hidden_act", "silu"),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=layer.get("max_position_embeddings", 4096),
            attention_bias=layer.get("attention_bias", False), mlp_bias=layer.get("mlp_bias", False),
            sliding_window=cls.sliding_window_of(layer), num_layers=int(layer.get("num_hidden_layers", 1)), **eagle31,
        )

    @classmethod
    def from_speculators(cls, config: dict[str, Any]) -> Eagle3Config:
        """Inverse of :meth:`to_speculators`. ``norm_before_residual`` defaults to True when
        absent, as in vLLM.

        Raises:
            KeyError: a required key is missing.
            ValueError: no aux layer ids, an inconsistent geometry, or a draft draftsmith's
                EAGLE-3 layer cannot hold (:func:`refuse_foreign_speculators`).
        """
        refuse_foreign_speculators(config, "eagle3", layer_types=("llama", "qwen3"))
        facts = Eagle3ExportFacts.read(config, "speculators")
        if not facts.aux_layer_ids:
            raise ValueError("no eagle_aux_hidden_state_layer_ids")
        return cls.from_layer_config(config["transformer_layer_config"], config["draft_vocab_size"],
                                     facts.aux_layer_ids, facts.target_hidden_size, facts.norm_before_residual,
                                     **facts.eagle31)

    @classmethod
    def from_legacy(cls, config: dict[str, Any]) -> Eagle3Config:
        """Inverse of :meth:`to_legacy`. ``norm_before_residual`` defaults to False when absent,
        as in vLLM's legacy loader.

        Raises:
            KeyError / ValueError: as :meth:`from_speculators`.
        """
        facts = Eagle3ExportFacts.read(config, "legacy")
        if not facts.aux_layer_ids:
            raise ValueError("no eagle_aux_hidden_state_layer_ids")
        return cls.from_layer_config(config, config["draft_vocab_size"], facts.aux_layer_ids,
                                     facts.target_hidden_size, facts.norm_before_residual, **facts.eagle31)

    @classmethod
    def from_export(cls, config: dict[str, Any]) -> Eagle3Config:
        """The config of an exported draft's ``config.json``, speculators or legacy format.

        Raises:
            KeyError / ValueError: as :meth:`from_speculators`.
        """
        if Eagle3ExportFacts.export_format(config) == "speculators":
            return cls.from_speculators(config)
        return cls.from_legacy(config)

    @staticmethod
    def export_facts(config: dict[str, Any]) -> Eagle3ExportFacts:
        """The EAGLE-3 facts of an exported draft's ``config.json`` (either format) that tools
        report or check against a target, read as :meth:`from_export` and vLLM read them but
        without requiring the full layer geometry (see :class:`Eagle3ExportFacts`). Never raises
        for a missing key: absent facts are None."""
        return Eagle3ExportFacts.read(config)


@dataclass(frozen=True)
class Eagle3ExportFacts:
    """What an EAGLE-3 export's ``config.json`` says about the draft, in either format.

    The one reader of these keys (:meth:`Eagle3Config.from_speculators` / ``from_legacy`` and the
    tools that check or describe an export, ``eval/acceptance.py`` and ``eval/hub.py``, all go
    through it), with vLLM's defaults: ``norm_before_residual`` True when absent in the
    speculators format, False in the legacy one. Other facts are None when absent.

    Attributes:
        format: ``"speculators"`` (vLLM's rule: a ``speculators_config`` is present; or
            ``speculators_model_type`` is ``eagle3``) or ``"legacy"`` (``LlamaForCausalLMEagle3``).
        aux_layer_ids: ``eagle_aux_hidden_state_layer_ids`` (legacy: under ``eagle_config``).
        draft_vocab_size: Vd. vocab_size, hidden_size: of the layer config (V, H).
        target_hidden_size: as written (vLLM uses ``hidden_size`` when absent).
        num_speculative_tokens: K of the first proposal method (speculators format only).
        verifier: ``speculators_config.verifier`` (``{}`` when absent).
        eagle31: ``{option: value}`` of the EAGLE-3.1 options (:data:`EAGLE31_OPTIONS`), top-level
            keys in both formats, as written (:class:`Eagle3Config` refuses a non-bool), False
            when absent, as vLLM reads them (in the legacy format vLLM reads
            ``eagle_config.norm_before_fc`` first, so that spelling wins here too).
    """

    format: str
    aux_layer_ids: list[int] | None
    draft_vocab_size: int | None
    vocab_size: int | None
    hidden_size: int | None
    target_hidden_size: int | None
    norm_before_residual: bool
    num_speculative_tokens: int | None
    verifier: dict[str, Any]
    eagle31: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(EAGLE31_OPTIONS, False))

    @staticmethod
    def export_format(config: dict[str, Any]) -> str:
        """``"speculators"`` or ``"legacy"`` (see :attr:`format`)."""
        speculators = config.get("speculators_config") is not None or config.get("speculators_model_type") == "eagle3"
        return "speculators" if speculators else "legacy"

    @classmethod
    def read(cls, config: dict[str, Any], fmt: str | None = None) -> Eagle3ExportFacts:
        """The facts of ``config`` read as format ``fmt`` (default: :meth:`export_format`)."""
        fmt = fmt or cls.export_format(config)
        if fmt == "speculators":
            layer = config.get("transformer_layer_config") or {}
            aux = config.get("eagle_aux_hidden_state_layer_ids")
        else:
            layer = config
            aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        spec = config.get("speculators_config") or {}
        k = next((m.get("speculative_tokens") for m in spec.get("proposal_methods") or []), None)
        eagle31 = {key: config.get(key, False) for key in EAGLE31_OPTIONS}
        if fmt == "legacy" and "norm_before_fc" in (config.get("eagle_config") or {}):
            eagle31["norm_before_fc"] = config["eagle_config"]["norm_before_fc"]
        return cls(format=fmt, aux_layer_ids=list(aux) if aux is not None else None,
                   draft_vocab_size=config.get("draft_vocab_size"), vocab_size=layer.get("vocab_size"),
                   hidden_size=layer.get("hidden_size"), target_hidden_size=config.get("target_hidden_size"),
                   norm_before_residual=config.get("norm_before_residual", fmt == "speculators"),
                   num_speculative_tokens=k, verifier=dict(spec.get("verifier") or {}), eagle31=eagle31)




def refuse_foreign_speculators(config: dict[str, Any], model_type: str, num_layers: int | None = None,
                               layer_types: tuple[str, ...] = ("llama",)) -> None:
    """Refuse a speculators ``config.json`` (a speculators 0.9 checkpoint or a draftsmith export)
    whose draft the ``model_type`` reader would read as something else: another
    ``speculators_model_type``, a ``transformer_layer_config`` of a layer kind not in ``layer_types``
    (``model_type``: the speculators library and vLLM build ``llama`` and ``qwen3`` layers), another
    number of decoder layers (``num_layers``; None: any), or a partial rotary embedding
    (``partial_rotary_factor`` below 1). docs/speculators_interop.md lists what is read and what is refused.

    Raises:
        ValueError: one line naming the key and its value.
    """
    kind = config.get("speculators_model_type")
    if kind != model_type:
        raise ValueError(f"speculators_model_type {kind!r}: not a speculators {model_type!r} draft")
    layer = config.get("transformer_layer_config") or {}
    layer_type = layer.get("model_type", "llama")  # vLLM's default when absent
    if layer_type not in layer_types:
        raise ValueError(f"transformer_layer_config.model_type {layer_type!r}: draftsmith's {model_type} draft "
                         f"is built from {' or '.join(t.capitalize() for t in layer_types)} decoder layers")
    layers = layer.get("num_hidden_layers", 1)
    if num_layers is not None and layers != num_layers:
        raise ValueError(f"transformer_layer_config.num_hidden_layers {layers!r}: draftsmith's {model_type} draft "
                         f"has {num_layers} decoder layer{'s' if num_layers > 1 else ''}")
    for where, values in (("", layer), ("rope_parameters.", layer.get("rope_parameters") or {})):
        factor = values.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            raise ValueError(f"transformer_layer_config.{where}partial_rotary_factor {factor!r}: draftsmith's "
                             f"{model_type} draft rotates every channel of a head")
