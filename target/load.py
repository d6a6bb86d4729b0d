"""Load the target (verifier): the whole model with its tokenizer (:func:`load_target`, on
:func:`default_device`), or a few tensors of its checkpoint without the model (the decoder
layer a draft layer starts from, the embedding / ``lm_head`` / final norm the drafts share).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

DEVICE_HELP = ("torch device for the target and draft models run with transformers, e.g. cuda:1 or cpu "
               "(default: this process's accelerator: cuda:N by LOCAL_RANK under torchrun / accelerate launch, "
               "else cuda, else cpu; cpu with ACCELERATE_USE_CPU=1)")


def default_device(device: str | torch.device | None = None) -> torch.device:
    """The device a process runs its transformers models on: ``device`` when given, else the
    accelerator of this process as accelerate sees it (``PartialState().device``): one device
    per local rank under torchrun / ``accelerate launch``, CPU with no accelerator or with
    ``ACCELERATE_USE_CPU=1``.

    In a multi-process job whose accelerate state is not yet set up, the same device is
    computed from ``LOCAL_RANK`` without creating the state: ``PartialState()`` would join the
    process-group rendezvous, and the capture engines are built lazily, only on ranks that have
    shards left, so a rank with none would never join and the others would wait forever.

    Raises:
        RuntimeError: an unknown device string (torch's message).
    """
    if device is not None:
        return torch.device(device)
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    use_cpu = parse_flag_from_env("ACCELERATE_USE_CPU")
    if PartialState._shared_state or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return PartialState(cpu=use_cpu).device
    if use_cpu or not torch.accelerator.is_available():
        return torch.device("cpu")
    kind = torch.accelerator.current_accelerator().type
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", "0")) % torch.accelerator.device_count())


def load_target(path: Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                device: str | torch.device | None = None):
    """Load the target model (eval mode, no grad) and its tokenizer from a local dir.

    Args:
        dtype: parameter and compute dtype.
        device: where the parameters are placed (:func:`default_device`: None = this process's
            accelerator). Callers move their inputs to ``model.device``.

    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = weights_missing(path)
    if missing:
        raise FileNotFoundError(missing)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, device_map=default_device(device)
    )
    model.eval().requires_grad_(False)
    return model, tok


WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
                   "*.pt", "*.pth", "*.gguf")


def weights_missing(path: Path | str) -> str | None:
    """The one line refusing a local target folder with a ``config.json`` but no weight files
    (:data:`WEIGHT_PATTERNS`); None when it has weights or is not a local folder."""
    path = Path(path)
    if not path.is_dir() or any(next(path.glob(pat), None) is not None for pat in WEIGHT_PATTERNS):
        return None
    return (f"target {path}: a config.json but no weights (no *.safetensors, pytorch_model*.bin or *.gguf); "
            "copy the model's weight files into it, or name the complete model folder")


def checkpoint_weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a local checkpoint directory (the sharded index's
    ``weight_map``, else the keys of every ``*.safetensors`` file); reads no tensor."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    weight_map = {}
    for f in sorted(p.name for p in path.glob("*.safetensors")):
        with safe_open(path / f, framework="pt") as fh:
            weight_map.update({k: f for k in fh.keys()})
    return weight_map


LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.")  # decoder layers (plain / multimodal wrapper)


def load_target_layer_tensors(path: Path, index: int) -> dict[str, torch.Tensor]:
    """The tensors of decoder layer ``index`` of a target checkpoint, named without their
    ``model.layers.{index}.`` prefix (``self_attn.q_proj.weight``, ...), without loading the model.

    Raises:
        KeyError: the checkpoint holds no tensor of that layer (the prefixes tried are named).
    """
    prefixes = [f"{p}{index}." for p in LAYER_PREFIXES]
    weight_map = checkpoint_weight_map(path)
    names = {name[len(p):]: [name] for name in weight_map for p in prefixes if name.startswith(p)}
    if not names:
        raise KeyError(f"{path}: no tensor of decoder layer {index} ({' or '.join(p + '*' for p in prefixes)})")
    return load_target_tensors(path, names, weight_map)


def load_target_tensors(path: Path, names: dict[str, list[str]],
                        weight_map: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Read a few tensors from a target checkpoint without loading the model.

    Args:
        path: local checkpoint directory (``model.safetensors`` or a sharded index).
        names: wanted key -> candidate tensor names, tried in order (e.g. a tied
            ``lm_head.weight`` falls back to ``model.embed_tokens.weight``).
        weight_map: the checkpoint's :func:`checkpoint_weight_map`, when the caller has read it.

    Raises:
        KeyError: naming the wanted key and the candidates when none is in the checkpoint.
    """
    from safetensors import safe_open

    weight_map = checkpoint_weight_map(path) if weight_map is None else weight_map
    out = {}
    for key, candidates in names.items():
        found = next((c for c in candidates if c in weight_map), None)
        if found is None:
            raise KeyError(f"{path}: none of {candidates} (for '{key}') is in the checkpoint")
        with safe_open(path / weight_map[found], framework="pt") as fh:
            out[key] = fh.get_tensor(found)
    return out


EMBED_NAMES = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight"]
LM_HEAD_NAMES = ["lm_head.weight"]
FINAL_NORM_NAMES = ["model.norm.weight", "model.language_model.norm.weight", "norm.weight"]


def load_target_head_tensors(path: Path) -> dict[str, torch.Tensor]:
    """``embed_tokens [V, H]``, ``lm_head [V, H]`` (tied falls back to the embedding) and
    ``final_norm [H]`` of a target checkpoint, the final norm as the scale it multiplies by
    (``1 + w`` of a zero-centred norm, :func:`final_norm_offset`), the Llama ``w`` a draft's
    norm holds."""
    heads = load_target_tensors(
        path,
        {
            "embed_tokens": EMBED_NAMES,
            "lm_head": LM_HEAD_NAMES + EMBED_NAMES,
            "final_norm": FINAL_NORM_NAMES,
        },
    )
    if (Path(path) / "config.json").is_file():
        from transformers import AutoConfig

        offset = final_norm_offset(AutoConfig.from_pretrained(path))
        if offset:
            heads["final_norm"] = heads["final_norm"] + offset
    return heads


def final_logit_softcap(path: Path) -> float | None:
    """The target's ``final_logit_softcapping`` (Gemma 2-4: logits ``c * tanh(z / c)`` before
    sampling) from its ``config.json`` (a multimodal config's ``text_config``), None without one."""
    from .facts import text_json

    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    cap = text_json(json.loads(config.read_text())).get("final_logit_softcapping")
    return float(cap) if cap else None


def final_norm_offset(config: Any) -> float:
    """What the target's final RMSNorm adds to its weight before scaling: 1.0 for a zero-centred
    norm, ``x_hat * (1 + w)`` (Gemma 1-3, Qwen3-Next, Qwen3.5), 0.0 for Llama's ``x_hat * w``
    (Llama, Qwen3, DeepSeek-V3, Gemma 4, gpt-oss, ...).

    Read off the model's own norm class rather than a list of families: the text model is built
    on the meta device (no memory), and its ``norm``'s class, instantiated at width 4 with a zero
    weight, is run on ones (1.0 out: zero-centred).

    Raises:
        ValueError: the norm of the config's text model has no ``weight`` to probe, or gives
            neither 0 nor 1.
    """
    from transformers import AutoModelForCausalLM

    from .facts import text_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config(config))
    norm_cls = type(model.get_decoder().norm)
    norm = norm_cls(4)
    if not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ValueError(f"{norm_cls.__name__} has no weight: cannot tell its final-norm form")
    with torch.no_grad():
        norm.weight.zero_()
        out = float(norm(torch.ones(1, 4)).mean())
    if abs(out) < 1e-3:
        return 0.0
    if abs(out - 1.0) < 1e-3:
        return 1.0
    raise ValueError(f"{norm_cls.__name__}: ones through a zero-weight norm give {out}, neither 0 nor 1")
