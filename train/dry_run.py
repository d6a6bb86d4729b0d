"""Dry run: validate a recipe against its target's config and print what training will cost,
without downloading weights.

    python train/eagle3.py RECIPE.yaml --dry-run [--target-config path/to/config.json]
        [--set launcher=recipes/accelerate/fsdp_8gpu.yaml]

Reports the aux layer ids (vLLM convention), the draft's parameter count, the training memory
of its parameters + gradients + AdamW state, the bytes per token of offline hidden states and
the disk the configured dataset needs in offline mode. When the recipe names a ``launcher``
(accelerate launcher YAML), it is validated against the recipe and the method's draft model
(:func:`draftsmith.train.launchers.validate_launcher`) and the training memory is also given
per GPU, with what ZeRO / FSDP shard divided over the processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data_prep.target import (
    EMBEDDED_PREFIX,
    default_aux_layer_ids,
    num_decoder_layers,
    resolve_target,
    text_config,
    validate_aux_layer_ids,
)
from ..methods import get_method
from ..models.eagle3 import Eagle3Config
from ..recipe import Recipe
from .launchers import LauncherReport, draft_model_class, validate_launcher

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # fp8 scales: +16 B/token


def load_config_only(recipe: Recipe, target_config: Path | None) -> Any:
    """The target's transformers config, from a local ``config.json`` when given, else from the
    target directory / hub (config file only, never weights)."""
    from transformers import AutoConfig

    if target_config is not None:
        if not target_config.is_file():
            raise FileNotFoundError(f"--target-config {target_config} does not exist")
        return AutoConfig.from_pretrained(str(target_config.parent) if target_config.name == "config.json"
                                          else target_config, trust_remote_code=recipe.target.trust_remote_code)
    name = recipe.target.name_or_path
    if name.startswith(EMBEDDED_PREFIX) or Path(name).expanduser().is_dir():
        return AutoConfig.from_pretrained(resolve_target(name), trust_remote_code=recipe.target.trust_remote_code)
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=recipe.target.trust_remote_code)
    except Exception as exc:
        raise FileNotFoundError(
            f"cannot fetch the config of '{name}' ({type(exc).__name__}); pass --target-config path/to/config.json"
        ) from exc


def draft_parameter_count(cfg: Eagle3Config) -> dict[str, int]:
    """Trainable parameters of the EAGLE-3 draft by part, plus the frozen shared embedding."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc": 3 * Ht * H,
        "attention": 2 * H * (q + 2 * kv) + q * H,
        "mlp": 3 * H * I,
        "norms": 4 * H,
        "lm_head": cfg.draft_vocab_size * H,
        "frozen_embedding": cfg.vocab_size * H,
    }


def medusa_parameter_count(recipe: Recipe, hidden_size: int, vocab_size: int) -> dict[str, int]:
    """Trainable parameters of a Medusa draft by part (full target vocab)."""
    H, V, m = hidden_size, vocab_size, recipe.draft
    return {"resblocks": m.num_heads * m.num_layers * (H * H + H), "lm_heads": m.num_heads * V * H}


def mlp_speculator_parameter_count(recipe: Recipe, hidden_size: int, vocab_size: int) -> dict[str, int]:
    """Trainable parameters of an MLP-speculator draft by part (full target vocab)."""
    H, V, m = hidden_size, vocab_size, recipe.draft
    D, P = m.inner_dim or H, m.n_predict
    stages = 1 if m.tie_weights else P  # tied: one emb/head/ln for all stages
    inner_projs = min(P - 1, 1) if m.tie_weights else P - 1  # tied: stages >= 1 share one proj
    return {"emb": stages * V * D, "proj": H * D + inner_projs * D * D, "head": stages * V * D, "ln": stages * 2 * D}


def eagle3_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """EAGLE-3 parameter counts by part and the peak bytes of TTT logits per micro-batch: K steps
    of (B*T, Vd) fp32 logits + their softmax grads, which dominate the activations."""
    logits_bytes = recipe.train.ttt_steps * recipe.train.batch_size * recipe.data.max_length * cfg.draft_vocab_size * 4 * 3
    return draft_parameter_count(cfg), logits_bytes


def dflash_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """DFlash counterpart of :func:`eagle3_parameter_estimate` (``cfg`` gives the target's shapes
    and aux ids): ``draft.num_layers`` Qwen3-style layers (q_norm / k_norm per head), ``fc`` over
    every aux state, and the peak bytes of block logits per micro-batch: up to
    ``min(num_anchors, max_length)`` blocks of ``block_size`` fp32 rows per sequence, plus their
    softmax grads."""
    d = recipe.draft
    H, Ht, I, hd = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    counts = {
        "fc": len(cfg.aux_layer_ids) * Ht * H,
        "attention": d.num_layers * (H * (q + 2 * kv) + q * H + 2 * hd),
        "mlp": d.num_layers * 3 * H * I,
        "norms": (2 * d.num_layers + 2) * H,
        "lm_head": cfg.draft_vocab_size * H,
        "frozen_embedding": vocab_size * H,
    }
    blocks = min(d.num_anchors, recipe.data.max_length)
    logits_bytes = recipe.train.batch_size * blocks * d.block_size * cfg.draft_vocab_size * 4 * 3
    return counts, logits_bytes


def peagle_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """P-EAGLE counterpart of :func:`eagle3_parameter_estimate`: ``draft.num_layers`` layers (layer
    0 with 2H q/k/v inputs, the rest H), ``mask_hidden``, and the embedding counted as trainable
    under ``draft.train_embeddings``. Peak logits: COD keeps up to ``sum_d max(r**d, r_min)``
    elements per position over ``draft.num_depths`` depths, each (Vd,) fp32 logits + softmax grads."""
    d = recipe.draft
    counts = draft_parameter_count(cfg)
    H = cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    extra = d.num_layers - 1
    counts["attention"] += extra * (H * (q + 2 * kv) + q * H)
    counts["mlp"] *= d.num_layers
    counts["norms"] += extra * 2 * H
    counts["mask_hidden"] = 3 * cfg.target_hidden_size
    if d.train_embeddings:
        counts["embed_tokens"] = counts.pop("frozen_embedding")
        counts["frozen_embedding"] = 0
    per_position = 1 + sum(max(d.down_sample_ratio**k, d.down_sample_ratio_min) for k in range(1, d.num_depths))
    logits_bytes = int(per_position * recipe.train.batch_size * recipe.data.max_length * cfg.draft_vocab_size * 4 * 3)
    return counts, logits_bytes


def _head_estimate(counts: dict[str, int], heads: int, recipe: Recipe, vocab_size: int) -> tuple[dict[str, int], int]:
    counts["frozen_embedding"] = 0  # heads read the target's states, not its embedding
    # K heads of (B*T, V) logits over the full target vocab + their softmax grads
    return counts, heads * recipe.train.batch_size * recipe.data.max_length * vocab_size * 4 * 3


def medusa_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """Medusa counterpart of :func:`eagle3_parameter_estimate` (``cfg`` gives the hidden size)."""
    counts = medusa_parameter_count(recipe, cfg.hidden_size, vocab_size)
    return _head_estimate(counts, recipe.draft.num_heads, recipe, vocab_size)


def mlp_speculator_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """MLP-speculator counterpart of :func:`eagle3_parameter_estimate`."""
    counts = mlp_speculator_parameter_count(recipe, cfg.hidden_size, vocab_size)
    return _head_estimate(counts, recipe.draft.n_predict, recipe, vocab_size)


def per_gpu_memory(memory: dict[str, int], counts: dict[str, int], method: str,
                   launcher: LauncherReport) -> dict[str, int]:
    """Training memory of one GPU (bytes) under ``launcher``: what it shards (ZeRO-1: optimizer
    state; ZeRO-2: + gradients; FSDP: + weights) is divided by ``num_processes`` (unset: 1);
    the frozen target embedding and lm_head rows stay whole on every rank. Under FSDP the root
    unit (all weights outside the model's ``_no_split_modules`` blocks) is gathered whole for
    the step, in bf16 under ``mixed_precision: bf16``: ``fsdp_gathered_root``. Activations
    (``ttt_logits_activations_per_microbatch``) are per process already and not included."""
    world = launcher.num_processes or 1
    out = {
        "draft_weights_fp32": memory["draft_weights_fp32"] // (world if "weights" in launcher.sharded else 1),
        "gradients_fp32": memory["gradients_fp32"] // (world if "gradients" in launcher.sharded else 1),
        "adamw_state_fp32": memory["adamw_state_fp32"] // (world if "optimizer state" in launcher.sharded else 1),
        "frozen_embedding_bf16": memory["frozen_embedding_bf16"],
        "target_lm_head_draft_rows_bf16": memory["target_lm_head_draft_rows_bf16"],
    }
    if launcher.distributed_type == "FSDP":
        trainable = sum(v for k, v in counts.items() if k != "frozen_embedding")
        # parts inside the model's _no_split_modules blocks are FSDP units of their own
        in_blocks = sum(counts[k] for k in get_method(method).fsdp_block_parts) if launcher.wrap_classes else 0
        out["fsdp_gathered_root"] = (trainable - in_blocks) * (2 if launcher.mixed_precision == "bf16" else 4)
    out["total"] = sum(out.values())
    return out


def dry_run(recipe: Recipe, target_config: Path | None = None, launcher: str | Path | None = None) -> dict[str, Any]:
    """Everything the dry run reports, as a dict (see module docstring).

    ``launcher`` (an accelerate launcher YAML) overrides the recipe's ``launcher``; with neither,
    ``launcher`` and ``memory_bytes_per_gpu`` are None. Relative paths: see
    :func:`~draftsmith.train.launchers.resolve_launcher_path`.

    Raises:
        LauncherError (a ValueError): the launcher file is missing or does not fit the recipe
            or the method's draft model (message names file and key).
        ValueError: aux layer ids invalid for the target; draft vocab larger than the target's.
        FileNotFoundError: the target config cannot be read.
    """
    launcher = launcher or recipe.launcher
    launch = validate_launcher(recipe, launcher, draft_model_class(recipe.draft.method)) if launcher else None
    config = load_config_only(recipe, target_config)
    text = text_config(config)
    n = num_decoder_layers(config)
    ids = validate_aux_layer_ids(recipe.data.aux_layer_ids or default_aux_layer_ids(n), n)
    V = int(text.vocab_size)
    if recipe.data.draft_vocab_size > V:
        raise ValueError(f"data.draft_vocab_size={recipe.data.draft_vocab_size} exceeds the target vocab of {V}")
    # the target's shapes for every method's estimator (norm_before_residual changes no count)
    cfg = Eagle3Config.from_target(config, recipe.data.draft_vocab_size, ids)
    T = recipe.data.max_length
    counts, logits_bytes = get_method(recipe.draft.method).parameter_estimator(recipe, cfg, V)
    trainable = sum(v for k, v in counts.items() if k != "frozen_embedding")
    hs_bytes = 4 * cfg.hidden_size * DTYPE_BYTES[recipe.data.hidden_states_dtype]  # 3 aux + 1 final
    tokens = recipe.data.expected_tokens
    memory = {
        "draft_weights_fp32": 4 * trainable,
        "gradients_fp32": 4 * trainable,
        "adamw_state_fp32": 8 * trainable,
        "frozen_embedding_bf16": 2 * counts["frozen_embedding"],
        "target_lm_head_draft_rows_bf16": 2 * cfg.draft_vocab_size * cfg.hidden_size,
        "ttt_logits_activations_per_microbatch": logits_bytes,
    }
    return {
        "target": recipe.target.name_or_path,
        "method": recipe.draft.method,
        "architectures": list(getattr(config, "architectures", None) or []),
        "target_layers": n,
        "hidden_size": cfg.hidden_size,
        "vocab_size": V,
        "draft_vocab_size": cfg.draft_vocab_size,
        "aux_layer_ids": ids,
        "aux_layer_ids_are_vllm_default": ids == default_aux_layer_ids(n),
        "rope": {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling},
        "draft_parameters": counts,
        "draft_trainable_parameters": trainable,
        "memory_bytes": memory,
        "launcher": None if launch is None else dict(vars(launch), path=str(launch.path)),
        "memory_bytes_per_gpu": None if launch is None else per_gpu_memory(memory, counts, recipe.draft.method, launch),
        "hidden_state_bytes_per_token": hs_bytes,
        "expected_tokens": tokens,
        "offline_disk_bytes": hs_bytes * tokens if tokens else None,
        "ttt_steps": recipe.train.ttt_steps,
        "max_length": T,
    }


def _human(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def format_report(r: dict[str, Any]) -> str:
    mem = r["memory_bytes"]
    lines = [
        f"target           {r['target']} {r['architectures']}: {r['target_layers']} layers, H={r['hidden_size']}, V={r['vocab_size']}",
        f"aux layer ids    {r['aux_layer_ids']}" + (" (vLLM default)" if r["aux_layer_ids_are_vllm_default"] else " (differs from vLLM default: written into the export)"),
        f"draft            {r['method']}: {r['draft_trainable_parameters'] / 1e6:.1f}M trainable params "
        f"({', '.join(f'{k} {v / 1e6:.1f}M' for k, v in r['draft_parameters'].items())}); draft vocab {r['draft_vocab_size']}",
        f"train memory     weights {_human(mem['draft_weights_fp32'])} + grads {_human(mem['gradients_fp32'])} + "
        f"AdamW {_human(mem['adamw_state_fp32'])} (fp32) + frozen embedding {_human(mem['frozen_embedding_bf16'])} + "
        f"target lm_head rows {_human(mem['target_lm_head_draft_rows_bf16'])}; "
        f"TTT logits <= {_human(mem['ttt_logits_activations_per_microbatch'])} per micro-batch (all positions at max_length)",
        f"hidden states    {_human(r['hidden_state_bytes_per_token'])} per token (3 aux + 1 final); "
        f"{_human(r['hidden_state_bytes_per_token'] * 1e9)} per billion tokens",
        f"offline disk     {_human(r['offline_disk_bytes'])} for {r['expected_tokens'] or 'unknown'} expected tokens"
        + ("" if r["expected_tokens"] else " (set data.expected_tokens)"),
        f"rope             {json.dumps(r['rope'])}",
    ]
    return "\n".join(lines + _launcher_lines(r))


def _launcher_lines(r: dict[str, Any]) -> list[str]:
    launch, gpu = r["launcher"], r["memory_bytes_per_gpu"]
    if launch is None:
        return ["launcher         none (set launcher: recipes/accelerate/<name>.yaml to validate it)"]
    kind = launch["distributed_type"]
    if launch["zero_stage"] is not None:
        kind += f" ZeRO-{launch['zero_stage']}"
    if launch["wrap_classes"] is not None:
        units = ", ".join(launch["wrap_classes"] + ["root"])
        kind += f" (FSDP2 units: {units}; from {launch['wrap_source']})"
    procs = launch["num_processes"] or "all GPUs"
    world = launch["num_processes"] or 1
    sharded = f"1/{world} of {', '.join(launch['sharded'])}" if launch["sharded"] else "nothing sharded"
    gathered = (f" + FSDP root unit gathered {_human(gpu['fsdp_gathered_root'])}"
                if "fsdp_gathered_root" in gpu else "")
    return [
        f"launcher         {launch['path']}: {kind}; {procs} processes on {launch['num_machines']} machine(s); "
        f"mixed precision {launch['mixed_precision']}; "
        f"clip grad norm {launch['gradient_clipping']} (train.max_grad_norm)",
        f"per-GPU memory   {_human(gpu['total'])}: weights {_human(gpu['draft_weights_fp32'])} + grads "
        f"{_human(gpu['gradients_fp32'])} + AdamW {_human(gpu['adamw_state_fp32'])} ({sharded}) + frozen embedding "
        f"and target lm_head rows {_human(gpu['frozen_embedding_bf16'] + gpu['target_lm_head_draft_rows_bf16'])} "
        f"(whole on every rank){gathered}; plus activations",
    ]

