"""Export Medusa heads and MLP speculators trained by draftsmith, and load the exports back.

    python -m draftsmith.eval.export RUN_DIR/checkpoints/step-N OUT_DIR   # dispatches on the method

Formats (docs/formats.md, "Medusa and MLP speculator"):

- Medusa, as vLLM <= 0.32 loads it (``speculative_config={"method": "medusa", "model": OUT_DIR,
  "num_speculative_tokens": K}``): ``config.json`` ``{architectures ["MedusaModel"],
  model_type "medusa", hidden_size, vocab_size, num_heads, num_hidden_layers,
  truncated_vocab_size null, medusa_fc_bias true}``; ``model.safetensors`` with
  ``blocks.{k}.layers.{l}.weight|bias`` and ``lm_heads.{k}.weight``. vLLM sizes the model from
  the config and drops weight names it does not know without a word, so every name written
  here is one its ``Medusa`` module has.
- MLP speculator, IBM's ``MLPSpeculatorPreTrainedModel`` layout (fms-extras; vLLM <= 0.32's
  ``MLPSpeculator``): ``config.json`` ``{architectures ["MLPSpeculatorPreTrainedModel"],
  model_type "mlp_speculator", vocab_size, emb_dim, inner_dim, n_predict,
  top_k_tokens_per_head, n_candidates, tie_weights, scale_input}``; ``model.safetensors`` with
  ``speculator.{emb,proj,head,ln}.{i}.weight`` and ``speculator.ln.{i}.bias`` for every stage
  (tied stages repeat the shared tensor, as IBM's checkpoints do).

Export reads only the checkpoint directory (``model.safetensors``, ``draft_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from .. import __version__
from .export import ExportError, export, read_draft_config, require_checkpoint_files
from ..layout import DRAFT_CONFIG_FILE, DraftCheckpointConfig
from ..models.medusa.model import MedusaConfig, MedusaModel
from ..models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig

MLP_PREFIX = "speculator."


def medusa_weight_shapes(cfg: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an exported Medusa draft (vLLM names) with its shape."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    for k in range(cfg.num_heads):
        for layer in range(cfg.num_layers):
            out[f"blocks.{k}.layers.{layer}.weight"] = (H, H)
            out[f"blocks.{k}.layers.{layer}.bias"] = (H,)
        out[f"lm_heads.{k}.weight"] = (V, H)
    return out


def mlp_speculator_weight_shapes(cfg: MLPSpeculatorConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of :class:`MLPSpeculator` (unprefixed module names) with its shape; the
    export adds ``speculator.``."""
    H, D, V = cfg.emb_dim, cfg.inner_dim, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.n_predict):
        out[f"emb.{i}.weight"] = (V, D)
        out[f"proj.{i}.weight"] = (D, H if i == 0 else D)
        out[f"head.{i}.weight"] = (V, D)
        out[f"ln.{i}.weight"] = (D,)
        out[f"ln.{i}.bias"] = (D,)
    return out


def _check_target(meta_path: Path, meta: DraftCheckpointConfig, hidden: int, vocab: int) -> None:
    target = meta.target
    for key, have in (("hidden_size", hidden), ("vocab_size", vocab)):
        if target.get(key) != have:
            raise ExportError(f"{meta_path}: draft {key} is {have} but the target it was trained on has "
                              f"target.{key}={target.get(key)!r}")


def is_medusa_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a Medusa export (vLLM's ``MedusaModel``)."""
    return config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])


def is_mlp_speculator_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of an ``MLPSpeculatorPreTrainedModel`` export."""
    return config.get("model_type") == "mlp_speculator"


def _build_medusa(config: dict[str, Any]) -> tuple[MedusaModel, dict[str, tuple[int, ...]], int, int]:
    cfg = MedusaConfig(**config)
    return MedusaModel(cfg), medusa_weight_shapes(cfg), cfg.hidden_size, cfg.vocab_size


def _build_mlp_speculator(config: dict[str, Any]) -> tuple[MLPSpeculator, dict[str, tuple[int, ...]], int, int]:
    cfg = MLPSpeculatorConfig(**config)
    return MLPSpeculator(cfg), mlp_speculator_weight_shapes(cfg), cfg.emb_dim, cfg.vocab_size


def _load_model(ckpt: Path, method: str, build: Callable[[dict[str, Any]], tuple[torch.nn.Module, dict[str, tuple[int, ...]], int, int]]
                ) -> tuple[DraftCheckpointConfig, torch.nn.Module]:
    """Checkpoint ``ckpt`` of ``method`` as a model; ``build(meta.config)`` returns the model,
    its tensor shapes, and its hidden and vocab sizes (checked against the recorded target)."""
    meta_path, weights_path = ckpt / DRAFT_CONFIG_FILE, ckpt / "model.safetensors"
    require_checkpoint_files(ckpt)
    meta = read_draft_config(ckpt)
    if meta.method != method:
        raise ExportError(f"{meta_path}: method is {meta.method!r}, expected {method!r}")
    try:
        model, want, hidden, vocab = build(meta.config)
        _check_target(meta_path, meta, hidden, vocab)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ExportError):
            raise
        raise ExportError(f"{meta_path}: invalid draft config ({exc})") from exc
    state = {k.removeprefix("module."): v for k, v in load_file(str(weights_path)).items()}
    for k, v in state.items():
        if k not in want:
            raise ExportError(f"{weights_path}: unexpected tensor {k}")
        if tuple(v.shape) != want[k]:
            raise ExportError(f"{weights_path}: {k} has shape {tuple(v.shape)}, expected {want[k]}")
    # Checkpoints store a tied tensor once (safetensors refuses shared storage): a name may be
    # absent only if the model ties it to one that is present.
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    present = {p.data_ptr() for k, p in model.state_dict().items() if k in state}
    untied = sorted(k for k in missing if model.state_dict()[k].data_ptr() not in present)
    if untied:
        raise ExportError(f"{weights_path}: missing tensors {untied}")
    return meta, model


def export_medusa(ckpt: Path, out: Path, dtype: str = "float32") -> Path:
    """Write the vLLM (<= 0.32) Medusa draft of checkpoint ``ckpt`` to ``out``; returns ``out``.

    Raises:
        ExportError: missing files, another method, a draft config that disagrees with the
            recorded target (hidden size, vocab), or missing / mis-shaped tensors.
    """
    meta, model = _load_model(ckpt, "medusa", _build_medusa)
    cfg: MedusaConfig = model.config
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": None,
        "medusa_fc_bias": True,
        "torch_dtype": dtype,
        "draftsmith": {"version": __version__, "verifier": meta.verifier, "head_decay": meta.head_decay},
    }
    return _write(out, config, model.state_dict(), "", dtype)


def export_mlp_speculator(ckpt: Path, out: Path, dtype: str = "float32") -> Path:
    """Write the ``MLPSpeculatorPreTrainedModel`` export of checkpoint ``ckpt`` to ``out``.

    Raises:
        ExportError: as :func:`export_medusa`.
    """
    meta, model = _load_model(ckpt, "mlp_speculator", _build_mlp_speculator)
    cfg: MLPSpeculatorConfig = model.config
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": cfg.vocab_size,
        "emb_dim": cfg.emb_dim,
        "inner_dim": cfg.inner_dim,
        "n_predict": cfg.n_predict,
        # tree width per stage for engines that build candidate trees (IBM's default shape)
        "top_k_tokens_per_head": [max(1, 5 - i) for i in range(cfg.n_predict)],
        "n_candidates": 5,
        "tie_weights": cfg.tie_weights,
        "scale_input": cfg.scale_input,
        "torch_dtype": dtype,
        "draftsmith": {"version": __version__, "verifier": meta.verifier, "head_decay": meta.head_decay},
    }
    return _write(out, config, model.state_dict(), MLP_PREFIX, dtype)


def _write(out: Path, config: dict[str, Any], state: dict[str, torch.Tensor], prefix: str, dtype: str) -> Path:
    torch_dtype = getattr(torch, dtype)
    # clone: tied stages share storage, which safetensors refuses; every name gets its copy
    tensors = {prefix + k: v.detach().to(torch_dtype).clone().contiguous() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def export_head_draft(ckpt: Path, out: Path, dtype: str = "auto") -> Path:
    """Export a Medusa or MLP-speculator checkpoint with the exporter :mod:`draftsmith.methods`
    registers for its ``draft_config.json`` ``method`` (:func:`draftsmith.eval.export.export`,
    which resolves ``dtype="auto"``).

    Raises:
        ExportError: see :func:`export_medusa`; an unknown method.
    """
    return export(ckpt, out, dtype=dtype)


def load_medusa(directory: Path) -> MedusaModel:
    """Rebuild :class:`MedusaModel` from a Medusa export (float32).

    Raises:
        ExportError: not a Medusa export, or its tensors do not match its config.
    """
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if cfg.get("model_type") != "medusa":
        raise ExportError(f"{directory}/config.json: model_type {cfg.get('model_type')!r}, expected 'medusa'")
    model = MedusaModel(MedusaConfig(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                                     num_heads=cfg["num_heads"], num_layers=cfg["num_hidden_layers"]))
    return _load_export(Path(directory), model, "")


def load_mlp_speculator(directory: Path) -> MLPSpeculator:
    """Rebuild :class:`MLPSpeculator` from an ``MLPSpeculatorPreTrainedModel`` export (float32).

    Raises:
        ExportError: not an MLP-speculator export, or its tensors do not match its config.
    """
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if cfg.get("model_type") != "mlp_speculator":
        raise ExportError(f"{directory}/config.json: model_type {cfg.get('model_type')!r}, expected 'mlp_speculator'")
    model = MLPSpeculator(MLPSpeculatorConfig(
        emb_dim=cfg["emb_dim"], inner_dim=cfg["inner_dim"], vocab_size=cfg["vocab_size"], n_predict=cfg["n_predict"],
        tie_weights=cfg["tie_weights"], scale_input=cfg["scale_input"]))
    return _load_export(Path(directory), model, MLP_PREFIX)


def _load_export(directory: Path, model: torch.nn.Module, prefix: str) -> Any:
    weights = load_file(str(directory / "model.safetensors"))
    state = {k.removeprefix(prefix): v.float() for k, v in weights.items()}
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys or set(state) != set(model.state_dict()):
        raise ExportError(f"{directory}/model.safetensors: missing {sorted(result.missing_keys)}, "
                          f"unexpected {sorted(result.unexpected_keys)}")
    return model.eval()
