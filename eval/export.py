"""Export a trained EAGLE-3 checkpoint into a directory vLLM loads (``method: eagle3``).

    draftsmith export RUN_DIR/checkpoints/step-N --out RUN_DIR/export/eagle3 [--legacy] [--dtype bfloat16]
    python -m draftsmith.eval.export CKPT OUT_DIR   # any method: its exporter in draftsmith.methods

``--dtype auto`` (the default) writes bfloat16 weights on a machine with a CUDA GPU and
float32 on a CPU-only one; ``--dtype float32`` / ``bfloat16`` / ``float16`` choose explicitly.

Formats (docs/formats.md, "EAGLE-3"):

- speculators (default; vLLM detects it by ``speculators_config``): ``config.json`` with
  ``architectures ["Eagle3DraftModel"]``, ``speculators_model_type "eagle3"``, the verifier,
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``,
  ``norm_before_residual`` (always written: vLLM assumes True when absent) and a one-layer
  ``transformer_layer_config``; weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``
  (with ``attention_bias`` / ``mlp_bias`` also the ``{q,k,v,o}_proj`` / ``{gate,up,down}_proj`` biases,
  which vLLM's ``llama_eagle3`` loads when the layer config sets those keys).
- legacy (``--legacy``): a Llama config with ``architectures ["LlamaForCausalLMEagle3"]``,
  ``eagle_config``, weights under ``midlayer.*``.

Export reads only the checkpoint directory (weights, ``draft_config.json``,
``vocab.safetensors``, ``recipe.yaml``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .. import __version__
from ..layout import DRAFT_CONFIG_FILE, DraftCheckpointConfig, DraftConfigError, RunLayout
from ..methods import UnknownMethodError, get_method
from ..models.eagle3.config import Eagle3Config
from ..runtime import DTYPE_CHOICES, resolve_dtype

SPECULATORS_VERSION = "0.3.0"  # the speculators config schema this export follows


class ExportError(ValueError):
    """The checkpoint is incomplete or inconsistent; the message names the file / key."""


def expected_weight_shapes(cfg: Eagle3Config, prefix: str = "layers.0.") -> dict[str, tuple[int, ...]]:
    """Every tensor an exported EAGLE-3 draft holds, with its shape.

    With ``attention_bias`` the draft layer has ``{q,k,v,o}_proj.bias`` and with ``mlp_bias``
    ``{gate,up,down}_proj.bias``: vLLM's ``llama_eagle3`` reads both keys from the layer config
    (``attention_bias`` -> ``qkv_proj`` and ``o_proj`` bias, ``mlp_bias`` -> ``gate_up_proj`` and
    ``down_proj`` bias) and loads the biases under these names, so they are exported too.
    """
    H, Ht, nh, nkv, hd, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    biases: dict[str, tuple[int, ...]] = {}
    if cfg.attention_bias:
        biases.update({f"{prefix}self_attn.q_proj.bias": (nh * hd,), f"{prefix}self_attn.k_proj.bias": (nkv * hd,),
                       f"{prefix}self_attn.v_proj.bias": (nkv * hd,), f"{prefix}self_attn.o_proj.bias": (H,)})
    if cfg.mlp_bias:
        biases.update({f"{prefix}mlp.gate_proj.bias": (I,), f"{prefix}mlp.up_proj.bias": (I,),
                       f"{prefix}mlp.down_proj.bias": (H,)})
    return biases | {
        "fc.weight": (H, 3 * Ht),
        f"{prefix}self_attn.q_proj.weight": (nh * hd, 2 * H),
        f"{prefix}self_attn.k_proj.weight": (nkv * hd, 2 * H),
        f"{prefix}self_attn.v_proj.weight": (nkv * hd, 2 * H),
        f"{prefix}self_attn.o_proj.weight": (H, nh * hd),
        f"{prefix}mlp.gate_proj.weight": (I, H),
        f"{prefix}mlp.up_proj.weight": (I, H),
        f"{prefix}mlp.down_proj.weight": (H, I),
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}hidden_norm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def checkpoint_method(ckpt: Path) -> str:
    """The draft method (``eagle3``, ``medusa``, ``mlp_speculator``) a checkpoint was trained with.

    Raises:
        ExportError: ``draft_config.json`` or ``model.safetensors`` missing, or the draft config invalid.
    """
    if not (ckpt / "model.safetensors").is_file():
        sharded = [d for d in ("pytorch_model_fsdp_0", "pytorch_model") if (ckpt / d).exists()]
        if sharded:
            raise ExportError(
                f"{ckpt / 'model.safetensors'} missing: {ckpt} holds only the launcher's sharded state ({sharded[0]}/), "
                "which export does not read; checkpoints written by this draftsmith version always carry the "
                "consolidated model.safetensors (resume the run for one more checkpoint to get it)")
    require_checkpoint_files(ckpt)
    return read_draft_config(ckpt).method


def require_checkpoint_files(ckpt: Path) -> None:
    """Raises ExportError naming ``draft_config.json`` or ``model.safetensors`` when missing."""
    for f in (ckpt / DRAFT_CONFIG_FILE, ckpt / "model.safetensors"):
        if not f.is_file():
            raise ExportError(f"{f} missing: not a draftsmith training checkpoint")


def read_draft_config(ckpt: Path) -> DraftCheckpointConfig:
    """``ckpt/draft_config.json``.

    Raises:
        ExportError: the file is missing or invalid (the message names it).
    """
    try:
        return DraftCheckpointConfig.read(ckpt)
    except DraftConfigError as exc:
        raise ExportError(str(exc)) from None


def check_tensor_set(tensors: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]], where: str,
                     layout: str) -> None:
    """Refuse any difference between ``tensors`` and the names / shapes ``want`` of the layout
    vLLM reads. vLLM's draft loaders are not strict (a missing tensor stays uninitialised, an
    extra one may be ignored or assert), so the exporters check the exact set.

    Raises:
        ExportError: naming the missing, unexpected and mis-shaped tensors of ``where``
            (``layout``: e.g. "DFlash", for the message).
    """
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    shaped = sorted(f"{k} {tuple(tensors[k].shape)} != {want[k]}" for k in set(want) & set(tensors)
                    if tuple(tensors[k].shape) != want[k])
    if missing or extra or shaped:
        raise ExportError(f"{where}: the tensors do not match the {layout} layout vLLM loads (vLLM would not "
                          f"complain): missing {missing}, unexpected {extra}, mis-shaped {shaped}")


def read_method_checkpoint(ckpt: Path, method: str, config_cls: type) -> tuple[DraftCheckpointConfig, Any,
                                                                               dict[str, torch.Tensor]]:
    """``(draft_config.json, config_cls(**its config), weights)`` of a ``method`` training
    checkpoint; weight names lose a ``module.`` prefix (a wrapped model's state dict).

    Raises:
        ExportError: missing files, a checkpoint of another method, an invalid config.
    """
    require_checkpoint_files(ckpt)
    meta = read_draft_config(ckpt)
    if meta.method != method:
        raise ExportError(f"{ckpt / DRAFT_CONFIG_FILE}: method is {meta.method!r}, this exporter writes {method}")
    try:
        cfg = config_cls(**meta.config)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{ckpt / DRAFT_CONFIG_FILE}: invalid {method} config ({exc})") from None
    state = {k.removeprefix("module."): v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    return meta, cfg, state


def read_checkpoint(ckpt: Path) -> tuple[DraftCheckpointConfig, Eagle3Config, dict[str, torch.Tensor]]:
    """Load ``draft_config.json`` and the model weights of a training checkpoint.

    Raises:
        ExportError: missing files, a non-EAGLE-3 checkpoint, or missing / mis-shaped tensors.
    """
    weights_path = ckpt / "model.safetensors"
    meta, cfg, state = read_method_checkpoint(ckpt, "eagle3", Eagle3Config)
    want = expected_weight_shapes(cfg)
    missing = sorted(set(want) - set(state))
    if missing:
        raise ExportError(f"{weights_path}: missing tensors {missing}")
    for k, shape in want.items():
        if tuple(state[k].shape) != shape:
            raise ExportError(f"{weights_path}: {k} has shape {tuple(state[k].shape)}, expected {shape}")
    return meta, cfg, {k: state[k] for k in want}


def speculators_config(meta: DraftCheckpointConfig, cfg: Eagle3Config, num_speculative_tokens: int,
                       dtype: str) -> dict[str, Any]:
    """The speculators-format ``config.json`` of checkpoint ``meta`` (:meth:`Eagle3Config.to_speculators`)."""
    target = meta.target
    verifier = {"name_or_path": target.get("verifier", target["name_or_path"]),
                "architectures": target.get("architectures", [])}
    return cfg.to_speculators(verifier, num_speculative_tokens, dtype, SPECULATORS_VERSION,
                              {"version": __version__, "ttt_steps": meta.ttt_steps, "target_path": target.get("path")})


def legacy_config(meta: DraftCheckpointConfig, cfg: Eagle3Config, dtype: str) -> dict[str, Any]:
    """The legacy-format ``config.json`` of checkpoint ``meta`` (:meth:`Eagle3Config.to_legacy`)."""
    return cfg.to_legacy(dtype, {"version": __version__,
                                 "verifier": meta.target.get("verifier", meta.target["name_or_path"])})


def is_eagle3_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of an EAGLE-3 export (speculators or legacy layout)."""
    return (config.get("speculators_model_type") == "eagle3"
            or "LlamaForCausalLMEagle3" in (config.get("architectures") or []))


def export(ckpt: Path, out: Path, legacy: bool = False, num_speculative_tokens: int = 3,
           dtype: str = "auto", embed_tokens: torch.Tensor | None = None) -> Path:
    """Write the vLLM-loadable draft of checkpoint ``ckpt`` to ``out`` (created) with the
    exporter :mod:`draftsmith.methods` registers for its method; returns ``out``.
    ``legacy``, ``num_speculative_tokens`` and ``embed_tokens`` reach exporters that take them
    (EAGLE-3, :func:`export_eagle3`) only. ``dtype`` is the storage dtype of the floating-point
    weights; ``"auto"`` is bfloat16 when this process sees a CUDA GPU and float32 otherwise
    (:func:`draftsmith.runtime.resolve_dtype`), resolved here so every exporter gets a name.

    Raises:
        ExportError: see :func:`read_checkpoint`; a method no registered one has; an unknown dtype.
    """
    try:
        dtype = resolve_dtype(dtype)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    try:
        spec = get_method(checkpoint_method(ckpt))
    except UnknownMethodError as exc:
        raise ExportError(f"{ckpt / 'draft_config.json'}: {exc}") from None
    options = {"legacy": legacy, "num_speculative_tokens": num_speculative_tokens, "embed_tokens": embed_tokens}
    return spec.exporter(ckpt, out, dtype=dtype, **{k: options[k] for k in spec.export_options})


def export_eagle3(ckpt: Path, out: Path, legacy: bool = False, num_speculative_tokens: int = 3,
                  dtype: str = "float32", embed_tokens: torch.Tensor | None = None) -> Path:
    """Write the vLLM-loadable EAGLE-3 draft of checkpoint ``ckpt`` to ``out`` (created);
    returns ``out``.

    Args:
        ckpt: training checkpoint directory (``checkpoints/step-N``).
        legacy: write the legacy ``LlamaForCausalLMEagle3`` layout instead of speculators.
        num_speculative_tokens: K written as the default proposal length.
        dtype: storage dtype of the floating-point weights.
        embed_tokens: optionally include the target embedding ``[V, H]`` (vLLM otherwise
            shares the target's).

    Raises:
        ExportError: see :func:`read_checkpoint`.
    """
    meta, cfg, state = read_checkpoint(ckpt)
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for k, v in state.items():
        name = k.replace("layers.0.", "midlayer.") if legacy else k
        tensors[name] = v.to(torch_dtype) if v.is_floating_point() else v
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens.to(torch_dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = legacy_config(meta, cfg, dtype) if legacy else speculators_config(meta, cfg, num_speculative_tokens, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``eval/export.py`` (``draftsmith export``)."""
    from ..cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path, help="RUN_DIR/checkpoints/step-N, or RUN_DIR (latest checkpoint)")
    p.add_argument("out_dir", type=Path, nargs="?", help="output directory (or --out)")
    p.add_argument("--out", type=Path, help="output directory (or OUT_DIR)")
    p.add_argument("--legacy", action="store_true", help="EAGLE-3: legacy LlamaForCausalLMEagle3 layout")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="EAGLE-3: K written as the default proposal length (default: eval.num_speculative_tokens "
                        "of the recipe saved with the checkpoint, else 3)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="storage dtype of the floating-point weights; auto: bfloat16 when this machine has a "
                   "CUDA GPU, float32 otherwise (vLLM casts the weights to its own --dtype when it loads the draft)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if (args.out_dir is None) == (args.out is None):
        p.error("give the output directory once: OUT_DIR or --out OUT_DIR")
    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        k = args.num_speculative_tokens or saved_num_speculative_tokens(ckpt)
        out = export(ckpt, args.out or args.out_dir, args.legacy, k, args.dtype)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {ckpt} -> {out}")
    return 0


def saved_num_speculative_tokens(ckpt: Path, default: int = 3) -> int:
    """``eval.num_speculative_tokens`` of the recipe saved in checkpoint ``ckpt``
    (``recipe.yaml``), the K the draft was trained and measured for; ``default`` without one.

    Raises:
        ExportError: the saved recipe does not load (names the file).
    """
    from ..recipe import RecipeError, load_recipe

    path = ckpt / "recipe.yaml"
    if not path.is_file():
        return default
    try:
        return load_recipe(path).eval.num_speculative_tokens
    except (RecipeError, ValueError, OSError) as exc:
        raise ExportError(f"{path}: the checkpoint's recipe does not load ({exc}); pass --num-speculative-tokens")


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint dir as is, or the latest ``checkpoints/step-N`` of a run dir."""
    from ..train.checkpoint import find_checkpoints

    if (path / DRAFT_CONFIG_FILE).is_file():
        return path
    ckpts = find_checkpoints(RunLayout(path).checkpoints)
    if not ckpts:
        raise ExportError(f"{path}: neither a checkpoint nor a run directory with checkpoints")
    return ckpts[-1]


if __name__ == "__main__":
    sys.exit(main())
