"""The MTP layer's tensors under the names the target checkpoint ships them with (and vLLM's
``deepseek_mtp.py`` / ``qwen3_next_mtp.py`` load), to and from :class:`~.model.MTPDraftModel`'s
state dict, and the warm start that reads them from the target checkpoint.

Names: the draft's ``mtp.<name>`` is ``<prefix><name>`` in the checkpoint, ``<prefix>`` the
family's (``model.layers.{num_hidden_layers}.`` / ``mtp.``, :meth:`~.config.MTPFamily.layer_prefix`),
DeepSeek's ``mtp_block.`` dropped (vLLM adds it back when loading); transformers' fused experts
``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` are the checkpoint's per-expert
``mlp.experts.{e}.gate_proj.weight [I, H]`` / ``up_proj.weight`` / ``down_proj.weight [H, I]``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .config import FAMILIES, MTPConfig

_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_prefix(cfg: MTPConfig) -> str:
    """``model.layers.{num_hidden_layers}.`` (DeepSeek-V3) or ``mtp.`` (Qwen3-Next)."""
    return FAMILIES[cfg.family].layer_prefix(cfg.num_hidden_layers, 0)


def _shipped_name(cfg: MTPConfig, name: str) -> str:
    if cfg.family == "deepseek_v3" and name.startswith("mtp_block."):
        name = name[len("mtp_block."):]
    return checkpoint_prefix(cfg) + name


def to_checkpoint(state: dict[str, torch.Tensor], cfg: MTPConfig) -> dict[str, torch.Tensor]:
    """The draft's ``mtp.*`` state (``MTPDraftModel.state_dict()``) under the shipped names,
    experts split per expert (contiguous tensors)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not key.startswith("mtp."):
            continue
        name = key[len("mtp."):]
        fused = _FUSED.match(name)
        if fused is None:
            out[_shipped_name(cfg, name)] = value.contiguous()
            continue
        base, kind = fused.groups()
        for e in range(value.shape[0]):
            stem = _shipped_name(cfg, f"{base}.{e}")
            if kind == "down_proj":
                out[f"{stem}.down_proj.weight"] = value[e].contiguous()
            else:
                gate, up = value[e].chunk(2, dim=0)
                out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = gate.contiguous(), up.contiguous()
    return out


def from_checkpoint(tensors: dict[str, torch.Tensor], cfg: MTPConfig,
                    module_keys: set[str]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_checkpoint`: shipped tensors (names with the prefix) -> the draft's
    ``mtp.*`` state, for the keys in ``module_keys``; experts stacked into the fused tensors.

    Raises:
        KeyError: a module key with no shipped tensor, or an expert missing (names listed).
    """
    prefix = checkpoint_prefix(cfg)
    want = {}
    for key in module_keys:
        name = key[len("mtp."):]
        shipped = name[len("mtp_block."):] if cfg.family == "deepseek_v3" and name.startswith("mtp_block.") else name
        want[shipped] = key
    out, experts = {}, {}
    for full, value in tensors.items():
        if not full.startswith(prefix):
            continue
        name = full[len(prefix):]
        match = _EXPERT.match(name)
        if match is not None:
            base, e, kind = match.groups()
            experts.setdefault(base, {})[(int(e), kind)] = value
        elif name in want:
            out[want.pop(name)] = value
    for base, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        try:
            gate_up = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
            down = torch.stack([parts[(e, "down_proj")] for e in range(n)])
        except KeyError as exc:
            raise KeyError(f"{prefix}{base}: expert tensor {exc} missing") from None
        for kind, value in (("gate_up_proj", gate_up), ("down_proj", down)):
            key = want.pop(f"{base}.{kind}", None)
            if key is not None:
                out[key] = value
    if want:
        raise KeyError(f"no shipped tensor for {', '.join(sorted(prefix + n for n in want))}")
    return out


def dequantize_fp8_blocks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 weights with a ``weight_scale_inv`` (DeepSeek-V3's 128 x 128 block scales) -> float32,
    the scales dropped; other tensors unchanged."""
    out = {}
    for name, value in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv") if name.endswith(".weight") else None
        if scale is not None and value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            rows, cols = value.shape
            br, bc = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
            full = scale.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
            value = value.float() * full
        out[name] = value
    return out


def read_target_mtp(target_dir: Path, cfg: MTPConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the target checkpoint under the MTP layer's prefix (FP8 blocks dequantised),
    read without loading the model.

    Raises:
        KeyError: the checkpoint holds no tensor under the prefix (the MTP weights were left out,
            e.g. a quantised release without them).
    """
    from ...target import checkpoint_weight_map, load_target_tensors

    prefix = checkpoint_prefix(cfg)
    weight_map = checkpoint_weight_map(Path(target_dir))
    names = {n: [n] for n in weight_map if n.startswith(prefix)}
    if not names:
        raise KeyError(f"{target_dir}: no tensor named {prefix}* (the MTP layer's weights are not in this checkpoint)")
    return dequantize_fp8_blocks(load_target_tensors(Path(target_dir), names, weight_map))


def load_mtp_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy shipped-name ``tensors`` into ``model`` (an :class:`~.model.MTPDraftModel`), every
    ``mtp.*`` entry of its state dict (cast to its dtype).

    Raises:
        KeyError: a tensor of the MTP layer missing; ValueError: a shape that differs (named).
    """
    state = model.state_dict()
    keys = {k for k in state if k.startswith("mtp.")}
    loaded = from_checkpoint(tensors, model.config, keys)
    for key, value in loaded.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise ValueError(f"{checkpoint_prefix(model.config)}: {key} has shape {tuple(value.shape)}, the target's "
                             f"config gives {tuple(state[key].shape)}")
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in loaded.items()}, strict=False)
