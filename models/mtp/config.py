"""The MTP draft's config: which target family's multi-token-prediction layer it is, and the
target's own ``config.json`` the layer is built from (torch-free).

A target that ships MTP layers names their count in its ``config.json`` and stores their
weights next to its decoder layers; :data:`FAMILIES` lists the families draftsmith trains, as
vLLM (0.32) serves them with ``speculative_config={"method": "mtp"}``:

- ``deepseek_v3`` (DeepSeek-V3 / R1, Kimi-K2 with ``model_type: deepseek_v3``; vLLM
  ``deepseek_mtp.py``): ``num_nextn_predict_layers`` layers, layer i stored as
  ``model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, shared_head.norm,
  shared_head.head, embed_tokens}`` plus a whole decoder layer (MLA attention, MoE) under the
  same prefix;
- ``qwen3_next`` (Qwen3-Next; vLLM ``qwen3_next_mtp.py``): ``mtp_num_hidden_layers`` (vLLM reads
  ``num_nextn_predict_layers``, default 1) layers stored as ``mtp.{fc, pre_fc_norm_embedding,
  pre_fc_norm_hidden, norm}`` and ``mtp.layers.{i}.*`` (a full-attention Qwen3-Next decoder
  layer with its sparse MoE).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MTPFamily:
    """One target family's MTP layout.

    Attributes:
        name: the family (``MTPConfig.family``).
        model_types: the target ``model_type`` values of the family.
        count_keys: the ``config.json`` keys that give the number of shipped MTP layers, the first
            present wins.
        vllm_architecture: the architecture vLLM's ``SpeculativeConfig.hf_config_override`` gives the
            draft (what the serve check looks up in vLLM's model registry).
    """

    name: str
    model_types: tuple[str, ...]
    count_keys: tuple[str, ...]
    vllm_architecture: str

    def layer_prefix(self, num_hidden_layers: int, i: int) -> str:
        """The checkpoint prefix of MTP layer ``i`` (``model.layers.61.`` / ``mtp.``)."""
        if self.name == "deepseek_v3":
            return f"model.layers.{num_hidden_layers + i}."
        return "mtp."


FAMILIES: dict[str, MTPFamily] = {
    "deepseek_v3": MTPFamily("deepseek_v3", ("deepseek_v3",), ("num_nextn_predict_layers",), "DeepSeekMTPModel"),
    "qwen3_next": MTPFamily("qwen3_next", ("qwen3_next",), ("mtp_num_hidden_layers", "num_nextn_predict_layers"),
                            "Qwen3NextMTP"),
}


class MTPTargetError(ValueError):
    """``draft.method: mtp`` on a target without MTP layers (or of a family draftsmith does not
    train): one line naming the key, the family and what would work."""


def family_of(target_config: dict[str, Any]) -> MTPFamily | None:
    """The :class:`MTPFamily` of a target ``config.json`` (by ``model_type``), or None."""
    model_type = target_config.get("model_type")
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def shipped_layer_count(target_config: dict[str, Any], family: MTPFamily) -> int:
    """The number of MTP layers the target's ``config.json`` declares (0 when no count key is set)."""
    for key in family.count_keys:
        if target_config.get(key):
            return int(target_config[key])
    return 0


def check_mtp_target(target_config: dict[str, Any], where: str) -> tuple[MTPFamily, int]:
    """``(family, number of MTP layers)`` of a target config that ships MTP layers.

    Raises:
        MTPTargetError: one line: the family is not one draftsmith trains, or its config declares
            no MTP layer (the key named).
    """
    model_type = target_config.get("model_type")
    family = family_of(target_config)
    others = "draft.method eagle3, dflash, medusa or mlp_speculator train a new draft for any target"
    if family is None:
        known = ", ".join(t for f in FAMILIES.values() for t in f.model_types)
        raise MTPTargetError(f"draft.method mtp: {where} is model_type {model_type!r}, not a family whose MTP layers "
                             f"draftsmith fine-tunes ({known}); {others}")
    n = shipped_layer_count(target_config, family)
    if n < 1:
        raise MTPTargetError(f"draft.method mtp: {where} ({family.name}) sets no {' / '.join(family.count_keys)}: "
                             f"this checkpoint ships no MTP layer to fine-tune; use the family's release that "
                             f"ships them, or {others}")
    return family, n


@dataclass
class MTPConfig:
    """Architecture of an MTP draft: the target's MTP layer(s), as shipped.

    Attributes:
        family: :data:`FAMILIES` key.
        target_config: the target's ``config.json`` (text config), from which the decoder layer
            of the MTP layer is built and which the export writes back as its ``config.json``.
        num_layers: N, the MTP layers shipped (vLLM step k runs layer ``k % N``); draftsmith
            trains N = 1 (every family above ships one).
    """

    family: str
    target_config: dict[str, Any] = field(repr=False)
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"MTP family {self.family!r}: one of {', '.join(FAMILIES)}")
        if self.num_layers != 1:
            raise ValueError(f"{self.family}: {self.num_layers} MTP layers; draftsmith trains targets that ship one "
                             "(vLLM runs step k on layer k % N, whose KV cache of the prompt only layer 0 fills)")

    @property
    def hidden_size(self) -> int:
        return int(self.target_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target_config["vocab_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.target_config["num_hidden_layers"])

    @property
    def rms_norm_eps(self) -> float:
        return float(self.target_config.get("rms_norm_eps", 1e-6))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
