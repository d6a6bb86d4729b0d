"""Dry run: validate a recipe against its target's config and print what training will cost,
without downloading weights.

    python train/eagle3.py RECIPE.yaml --dry-run [--target-config path/to/config.json]
        [--launcher recipes/accelerate/fsdp_8gpu.yaml] [--device-memory-gib 80]

Reports the aux layer ids (vLLM convention), the draft's parameter count, the bytes per token of
offline hidden states, the disk the configured dataset needs in offline mode and the training
memory of one GPU (:func:`memory_estimate`): the trainable state as the launcher shards it
(:func:`state_bytes_per_gpu`), the frozen target embedding and teacher head in the target's
dtype, the batch, and the method's activations at ``train.batch_size x data.max_length`` (per
method, its ``activation_estimator`` (:mod:`draftsmith.methods`, ``models/<name>/training.py``):
e.g. EAGLE-3's K unrolled steps and their attention over the concatenated step keys, DFlash's
anchor blocks, P-EAGLE's COD elements, the heads of Medusa / the MLP speculator; the teacher
distribution; the chunked loss; with or without ``draft.gradient_checkpointing``). The generic
part works on the target's :class:`~draftsmith.models.common.LayerGeometry`; each method's
``parameter_estimator`` counts its draft's parameters from it.
``draftsmith bench memory RECIPE`` measures the same step (its real code under fake tensors)
beside this estimate; the two agree within 20% for every shipped GPU recipe
(``tests/integration/test_bench_memory_measured.py``).

The target's ``config.json`` comes from ``--target-config``, else from the copy shipped under
``recipes/targets/<hub id>/config.json`` (:func:`draftsmith.target.bundled_target_config`:
every shipped GPU recipe's target is there, so the dry run works offline), else from a local
target directory or the hub (the config file only, never weights); the geometry checks and
the target's weight bytes are :mod:`draftsmith.target`'s too.

When the recipe names a ``launcher`` (accelerate launcher YAML), it is validated against the
recipe and the method's draft model (:func:`draftsmith.train.launchers.validate_launcher`).
:func:`check_fits` refuses a recipe whose per-GPU estimate exceeds the device memory, naming
the keys that reduce it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data_prep.plan import Cluster, PlanError, build_plan
from ..data_prep.plan import human_bytes as _human
from ..data_prep.shards import bytes_per_token
from ..methods import get_method
from ..models.common import LayerGeometry
from ..recipe import Recipe
from ..target import (
    DTYPE_BYTES,
    aux_layer_ids,
    config_from_json,
    default_aux_layer_ids,
    num_decoder_layers,
    target_weight_bytes,
    text_config,
)
from ..data_prep.preflight import Preflight, parameter_counts, preflight  # noqa: F401 (re-exported)
from .launchers import LauncherReport, draft_model_class, validate_launcher


def head_estimate(counts: dict[str, int], heads: int, recipe: Recipe, vocab_size: int) -> tuple[dict[str, int], int]:
    """The ``parameter_estimator`` result of K full-vocab heads (Medusa heads, MLP-speculator
    stages) from their parameter ``counts``: no frozen embedding, and K heads of ``(B*T, V)`` fp32
    logits + their softmax grads."""
    counts["frozen_embedding"] = 0  # heads read the target's states, not its embedding
    # K heads of (B*T, V) logits over the full target vocab + their softmax grads
    return counts, heads * recipe.train.batch_size * recipe.data.max_length * vocab_size * 4 * 3


def precision_of(launch: LauncherReport | None) -> str:
    """The precision path a launcher trains the draft on: ``"amp-bf16"`` (fp32 weights, bf16
    autocast: single GPU, DDP, FSDP with ``mixed_precision: bf16``), ``"bf16"`` (DeepSpeed casts
    the weights to bf16 and keeps fp32 masters in its optimizer) or ``"fp32"``."""
    if launch is None or launch.mixed_precision != "bf16":
        return "fp32"
    return "bf16" if launch.distributed_type == "DEEPSPEED" else "amp-bf16"


def state_bytes_per_gpu(trainable: int, launch: LauncherReport | None, precision: str | None = None,
                        optimizer: str = "adamw", weight_average: bool = False) -> dict[str, int]:
    """Bytes of the training state of ``trainable`` parameters one rank holds under ``launch``
    (None: one process), by part: ``weights``, ``gradients``, ``optimizer_state`` (AdamW
    ``exp_avg`` + ``exp_avg_sq``, fp32), ``total``, and ``optimizer_shards`` (the number of
    ranks the optimizer state, and so the update's transients, is divided over).

    What the launcher shards (:attr:`LauncherReport.sharded`) is divided by its
    ``num_processes``. ``amp-bf16`` / ``fp32``: fp32 weights (4 B), gradients (4 B) and AdamW
    state (8 B) per parameter. ``bf16`` (DeepSpeed ZeRO <= 2): bf16 module weights (2 B, whole)
    plus the fp32 master copy (4 B) sharded with the optimizer state, bf16 gradients (2 B;
    sharded under ZeRO-2) plus the fp32 gradient partition the update reads (4 B, sharded with
    the optimizer state), AdamW state (8 B).

    ``optimizer="muon"`` (``train.optimizer``): the Muon group holds its momentum (4 B) plus the
    non-finite guard's device-side copy of weights and momentum (8 B, see
    :class:`~draftsmith.train.components.nonfinite.NonFiniteGuard`); every trainable parameter is counted at
    these 12 B, an upper bound (the embedding, head, norms and biases are AdamW's 8 B).

    ``weight_average`` (``train.ema_decay`` > 0): the main process's fp32 average of the trainable
    weights, 4 B per parameter, whole (:mod:`~draftsmith.train.components.ema`), as ``weight_average``.
    """
    precision = precision or precision_of(launch)
    world = (launch.num_processes or 1) if launch is not None else 1
    sharded = launch.sharded if launch is not None else ()

    def part(nbytes: int, what: str) -> int:
        return nbytes // world if what in sharded else nbytes

    N = trainable
    per_param = 12 if optimizer == "muon" else 8
    if precision == "bf16":
        out = {"weights": 2 * N + part(4 * N, "optimizer state"),
               "gradients": part(2 * N, "gradients") + part(4 * N, "optimizer state"),
               "optimizer_state": part(per_param * N, "optimizer state")}
    else:
        out = {"weights": part(4 * N, "weights"), "gradients": part(4 * N, "gradients"),
               "optimizer_state": part(per_param * N, "optimizer state")}
    if weight_average:
        out["weight_average"] = 4 * N
    out["total"] = sum(out.values())
    out["optimizer_shards"] = world if "optimizer state" in sharded else 1
    return out


# ---------------------------------------------------------------------------------------------
# activations: bytes per token of the layers' tensors, by precision path
#
# The coefficients are bytes per token per unit of each width (H: hidden size, I: MLP width,
# Q = nh * hd: query width, KV = nkv * hd: key/value width) of the tensors a layer pass keeps for
# backward or holds at the step's peak; they are the inventory of the methods' code as
# ``draftsmith bench memory`` measures it (storages live at the peak, grouped by shape and dtype:
# e.g. EAGLE-3 under bf16 autocast keeps per step four (T, I) bf16 MLP tensors, 8 B/token per
# unit of I, three bf16 casts of the (T, 2H) layer input, 12 B per unit of H, and about five fp32
# (T, H) RMSNorm / residual tensors). The global terms (teacher distribution, loss chunks,
# attention masks, weight copies, input casts) are counted explicitly. ``tests/integration/test_bench_memory_measured.py``
# holds the estimate to the measurement within 20% for every shipped GPU recipe: when a method's
# code changes what it keeps, its coefficients here are re-read from the bench (``--json``
# lists the largest groups at the peak).


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per token per unit of H, I, Q and KV (see above)."""

    H: float = 0.0
    I: float = 0.0
    Q: float = 0.0
    KV: float = 0.0

    def __call__(self, s: "Shapes", tokens: int) -> int:
        return int(tokens * (self.H * s.H + self.I * s.I + self.Q * s.Q + self.KV * s.KV))


@dataclass(frozen=True)
class Shapes:
    """What the activation estimates read: micro-batch and geometry of the draft's layers."""

    B: int
    T: int
    H: int  # draft hidden size (= the target's)
    Ht: int  # target hidden size
    I: int
    nh: int
    nkv: int
    hd: int
    Vd: int
    V: int
    n_aux: int
    precision: str  # amp-bf16 | bf16 | fp32
    param_bytes: int  # bytes of a trainable weight in the module (4 under autocast, 2 under DeepSpeed bf16)
    act_bytes: int  # bytes of a matmul output (2 under bf16, 4 in fp32)
    hidden_state_bytes: int  # bytes of an aux / final hidden state element on the device
    target_bytes: int  # bytes of the target's dtype (frozen embedding, teacher head)
    checkpointing: bool
    packing: bool

    @property
    def E(self) -> int:
        return self.B * self.T

    @property
    def Q(self) -> int:
        return self.nh * self.hd

    @property
    def KV(self) -> int:
        return self.nkv * self.hd


def shapes_of(recipe: Recipe, geometry: LayerGeometry, vocab_size: int, precision: str) -> Shapes:
    """The :class:`Shapes` of ``recipe``'s micro-batch on the target's ``geometry``."""
    bf16 = precision in ("amp-bf16", "bf16")
    hs = recipe.data.hidden_states_dtype
    g = geometry
    nkv, hd = g.num_key_value_heads, g.head_dim
    if getattr(recipe.draft, "layer", None) == "mla" and g.mla:  # a key and a (padded) value per head, hd_qk wide
        nkv, hd = g.num_attention_heads, (g.mla["qk_nope_head_dim"] or 0) + (g.mla["qk_rope_head_dim"] or 0)
    return Shapes(B=recipe.train.batch_size, T=recipe.data.max_length, H=g.hidden_size, Ht=g.target_hidden_size,
                  I=g.intermediate_size, nh=g.num_attention_heads, nkv=nkv, hd=hd,
                  Vd=g.draft_vocab_size, V=vocab_size, n_aux=len(g.aux_layer_ids), precision=precision,
                  param_bytes=2 if precision == "bf16" else 4, act_bytes=2 if bf16 else 4,
                  hidden_state_bytes=4 if hs == "float8_e4m3fn" else DTYPE_BYTES[hs],  # fp8 shards decode to fp32
                  target_bytes=DTYPE_BYTES[recipe.target.dtype],
                  checkpointing=_checkpointing(recipe), packing=bool(recipe.train.packing))


def _checkpointing(recipe: Recipe) -> bool:
    """``draft.gradient_checkpointing``; the methods without the key (the heads) have none."""
    return bool(getattr(recipe.draft, "gradient_checkpointing", False))


def loss_chunk_bytes(recipe: Recipe, rows_total: int, vocab: int) -> int:
    """The chunked loss at its peak: one chunk of ``chunk_rows`` rows recomputed in backward,
    about six fp32 ``(C, V)`` tensors (logits, log-softmaxes, their product and gradients)."""
    from .losses import chunk_rows

    C = min(chunk_rows(vocab, recipe.train.loss_chunk_rows), max(1, rows_total))
    return 6 * C * vocab * 4


def fused_loss_on(recipe: Recipe, s: Shapes, labels: bool = False) -> bool:
    """Whether the step's :func:`~draftsmith.train.losses.chunked_distill` calls take the fused loss on
    the recipe's GPU: :func:`~draftsmith.train.losses.uses_fused_loss`, the predicate the training
    step applies (``train.fused_loss`` on a CUDA device, the rows' dtype, ``draft.loss``; ``labels``:
    the heads' cross-entropy), at the kernel's coverage rather than this machine's Triton (the dry run
    estimates a GPU step from any machine)."""
    import torch

    from .losses import LossSpec, uses_fused_loss

    dtype = torch.bfloat16 if s.act_bytes == 2 else torch.float32
    spec = None if labels or not hasattr(recipe.draft, "loss") else LossSpec.from_recipe(recipe.draft)
    return uses_fused_loss(getattr(recipe.train, "fused_loss", "auto"), "cuda", dtype, spec, labels, runtime=False)[0]


def runs_loss_of(recipe: Recipe, training_method: type) -> bool:
    """Whether the recipe's method computes its loss with ``training_method``'s ``compute_loss`` (its
    own or inherited, not overridden): a method's estimate of its loss then applies to the methods
    built on it that keep that loss (DFlash2 keeps DFlash's; DSpark and XPress have their own)."""
    method = get_method(recipe.draft.method).training_method
    return getattr(method, "compute_loss", None) is getattr(training_method, "compute_loss", None)


def fused_loss_bytes(recipe: Recipe, s: Shapes, rows_total: int, calls: int,
                     vocab: int | None = None, labels: bool = False) -> dict[str, int] | None:
    """The fused loss on a GPU (train/fused_loss.py) when the step takes it (:func:`fused_loss_on`):
    one ``(C, Vd)`` logits buffer in the matmul dtype, and per call (EAGLE-3: one per TTT step; the
    heads: one per head; DFlash, P-EAGLE: one; P-EAGLE with accept weighting or OPD: one per depth,
    counted by its own estimate) the gradients it computes in forward and holds to backward,
    ``(Vd, H)`` for ``lm_head`` and ``(M, H)`` for the rows (``draft.opd``'s reverse-KL term
    is computed in the same call, train/opd_loss.py: nothing more). None when the step takes the
    chunked loss. Every method whose loss runs through ``chunked_distill`` counts its loss with this."""
    if not fused_loss_on(recipe, s, labels):
        return None
    import torch

    from .fused_loss import fused_chunk_rows

    V = vocab or s.Vd
    dtype = torch.bfloat16 if s.act_bytes == 2 else torch.float32
    C = min(fused_chunk_rows(V, dtype, recipe.train.loss_chunk_rows), max(1, rows_total))
    # several chunks: the lm_head gradient accumulates in fp32 (beside each chunk's bf16 product)
    accumulate = V * s.H * (4 + (s.act_bytes if s.act_bytes != 4 else 0)) if rows_total > C else 0
    return {"loss_chunk": C * V * s.act_bytes + accumulate,
            "fused_loss_gradients": calls * (V * s.H + rows_total * s.H) * s.act_bytes}


def input_cast(s: Shapes, n_aux: int) -> int:
    """``aux.to(param.dtype)``: a copy of the ``(B, T, n*Ht)`` aux states when their dtype differs."""
    want = s.param_bytes
    return s.E * n_aux * s.Ht * want if want != s.hidden_state_bytes else 0


def weight_copies(s: Shapes, trainable: int) -> int:
    """Under bf16 autocast every weight a matmul reads is cast to bf16 once per forward and kept
    for backward (under FSDP2 the gathered bf16 weights, the same bytes)."""
    return 2 * trainable if s.precision == "amp-bf16" else 0


def gqa_expanded_kv(s: Shapes, key_rows: int) -> int:
    """Bytes of the key / value head copies for ``key_rows`` keys (batch included) that a GPU's SDPA
    keeps: with a mask, CUDA's fused kernels take no grouped heads, so the ``nkv`` heads are
    expanded to ``nh`` (``models/attention.py`` ``sdpa_with_mask``); the extra ``nh - nkv`` heads."""
    return 2 * key_rows * (s.nh - s.nkv) * s.hd * s.act_bytes


def loss_chunk_rows(recipe: Recipe, rows_total: int, vocab: int) -> int:
    """Rows of one loss chunk over ``rows_total`` rows of ``vocab`` logits (``train.loss_chunk_rows``
    or :func:`~draftsmith.train.losses.chunk_rows`'s default)."""
    from .losses import chunk_rows

    return min(chunk_rows(vocab, recipe.train.loss_chunk_rows), max(1, rows_total))


def trainable_parameters(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if not k.startswith("frozen_"))


def frozen_bytes(recipe: Recipe, s: Shapes, counts: dict[str, int]) -> dict[str, int]:
    """The frozen tensors on every GPU of a draft-vocab method (its training method a
    :class:`~draftsmith.train.method_base.DraftVocabMethod`; a full-vocab method only its counted
    ``frozen_embedding``, e.g. the MTP layer's target embedding and ``lm_head``): the
    target embedding (drafts that read it) and the teacher head over the draft vocab, both in the
    target's dtype, a frozen ``lm_head`` (a parameter: fp32, bf16 under DeepSpeed) and the vocab maps."""
    from .method_base import DraftVocabMethod

    if not issubclass(get_method(recipe.draft.method).training_method, DraftVocabMethod):
        # a full-vocab method holds only what its estimator counts (MTP: the target's embedding and lm_head)
        held = counts.get("frozen_embedding", 0)
        return {"frozen_embedding": held * s.target_bytes} if held else {}
    return {"frozen_embedding": counts.get("frozen_embedding", 0) * s.target_bytes,
            "frozen_lm_head": counts.get("frozen_lm_head", 0) * s.param_bytes,
            "teacher_head": s.Vd * s.Ht * s.target_bytes, "vocab_maps": s.Vd * 8 + s.V}


def memory_estimate(recipe: Recipe, geometry: LayerGeometry, counts: dict[str, int], vocab_size: int,
                    launch: LauncherReport | None, precision: str | None = None) -> dict[str, Any]:
    """The training memory of one GPU at ``train.batch_size x data.max_length`` (bytes).

    ``per_gpu_bytes`` is the larger of the forward / backward peak (state + frozen + batch +
    activations) and the optimizer step (state + frozen + batch; the trainer's fused AdamW keeps
    no per-parameter temporaries). ``state``: :func:`state_bytes_per_gpu`; ``frozen``:
    :func:`frozen_bytes`; ``batch``: the hidden states and token tensors of one micro-batch;
    ``activations``: the method's terms (its ``activation_estimator``, e.g. EAGLE-3's
    :func:`~draftsmith.models.eagle3.training.activation_estimate`).
    """
    precision = precision or precision_of(launch)
    trainable = trainable_parameters(counts)
    s = shapes_of(recipe, geometry, vocab_size, precision)
    state = state_bytes_per_gpu(trainable, launch, precision, recipe.train.optimizer, recipe.train.ema_decay > 0)
    frozen = frozen_bytes(recipe, s, counts)
    batch = s.E * (s.n_aux + 1) * s.Ht * s.hidden_state_bytes + 3 * s.E * 8  # aux + final states, ids / masks
    method = get_method(recipe.draft.method)
    estimator = method.activation_estimator
    if estimator is None:  # a method without its own terms: the registry's logits estimate
        acts = {"logits": method.parameter_estimator(recipe, geometry, vocab_size)[1]}
    else:
        acts = estimator(recipe, s, trainable)
    update = 0  # the trainer's fused AdamW (CUDA) updates in place: no per-parameter temporaries
    fixed = state["total"] + sum(frozen.values()) + batch
    forward_backward = fixed + sum(acts.values())
    optimizer = fixed + update
    return {"precision": precision, "batch_size": s.B, "max_length": s.T, "trainable_parameters": trainable,
            "state": state, "frozen": frozen, "batch": batch, "activations": acts,
            # the loss the estimate counts: an estimator that counts the fused loss names its held
            # gradients (0 when they are gone at its peak), fused_loss_bytes deciding (fused_loss_on)
            "loss_path": "fused" if "fused_loss_gradients" in acts else "chunked",
            "optimizer_transients": update, "forward_backward_bytes": forward_backward, "optimizer_bytes": optimizer,
            "per_gpu_bytes": max(forward_backward, optimizer),
            "peak_phase": "forward_backward" if forward_backward >= optimizer else "optimizer"}


def estimate_inputs(recipe: Recipe, config_json: dict[str, Any]) -> tuple[LayerGeometry, dict[str, int], int]:
    """``(geometry, parameter counts, V)`` of :func:`memory_estimate` from the target's ``config.json``."""
    config = config_from_json(config_json, recipe.target.trust_remote_code)
    n = num_decoder_layers(config)
    ids = aux_layer_ids(recipe.data.aux_layer_ids, n)
    V = int(text_config(config).vocab_size)
    geometry = LayerGeometry.from_target(config, min(recipe.data.draft_vocab_size, V), ids)
    return geometry, parameter_counts(recipe, geometry, V), V


class MemoryBudgetError(ValueError):
    """The per-GPU estimate exceeds the device memory; the message is one line naming the keys
    that reduce it."""


def check_online_fits(report: dict[str, Any], device_memory_gib: float) -> None:
    """Refuse ``data.hidden_states_mode: online`` when the target (as transformers loads it:
    MXFP4 experts dequantised) and the draft's training do not fit one GPU together.

    Raises:
        MemoryBudgetError: one line with both figures and the device memory.
    """
    if report.get("hidden_states_mode") != "online":
        return
    est = report["estimate"]
    target = report["target_weights"]["online_bytes"]
    if target + est["per_gpu_bytes"] > device_memory_gib * 1024**3:
        raise MemoryBudgetError(
            f"data.hidden_states_mode: online needs the target beside the draft on every GPU: "
            f"{target / 1024**3:.1f} GiB of target weights (as transformers loads them) + "
            f"{est['per_gpu_bytes'] / 1024**3:.1f} GiB of training exceed the device's {device_memory_gib:g} GiB "
            f"(--device-memory-gib): use data.hidden_states_mode: offline (the data stage captures with vLLM "
            f"at tensor parallel)")


def check_fits(report: dict[str, Any], device_memory_gib: float) -> None:
    """Refuse a recipe whose per-GPU estimate (``report["estimate"]``) exceeds ``device_memory_gib``.

    Raises:
        MemoryBudgetError: one line with the estimate, the budget and the keys to change
            (``train.batch_size``, ``data.max_length``, ``draft.gradient_checkpointing``).
    """
    check_online_fits(report, device_memory_gib)
    est = report["estimate"]
    budget = device_memory_gib * 1024**3
    if est["per_gpu_bytes"] <= budget:
        return
    ckpt = "on" if report.get("gradient_checkpointing") else "off"
    raise MemoryBudgetError(
        f"estimated {est['per_gpu_bytes'] / 1024**3:.1f} GiB per GPU exceeds the device's {device_memory_gib:g} GiB "
        f"(--device-memory-gib) at train.batch_size={est['batch_size']} x data.max_length={est['max_length']}: "
        f"lower train.batch_size or data.max_length, or set draft.gradient_checkpointing: true (now {ckpt})")


def dry_run(recipe: Recipe, target_config: Path | None = None, launcher: str | Path | None = None,
            device_memory_gib: float = 80.0) -> dict[str, Any]:
    """Everything the dry run reports, as a dict (see module docstring).

    ``launcher`` (an accelerate launcher YAML) overrides the recipe's ``launcher``; with neither,
    ``launcher`` is None and the estimate is for one process in fp32. Relative paths: see
    :func:`~draftsmith.train.launchers.resolve_launcher_path`. ``estimate`` /
    ``memory_bytes_per_gpu``: :func:`memory_estimate`. ``target_weights``: the target's weight
    bytes as vLLM holds them and, for online mode, as transformers loads them (MXFP4 experts
    dequantised to ``target.dtype``). ``data_plan``: the data stage's plan
    (:func:`draftsmith.data_prep.plan.build_plan`) on the launcher's nodes x GPUs of
    ``device_memory_gib`` each (one GPU without a launcher).

    Raises:
        LauncherError (a ValueError): the launcher file is missing or does not fit the recipe
            or the method's draft model (message names file and key).
        ValueError: aux layer ids invalid for the target; draft vocab larger than the target's; the
            target config lacks a geometry key; ``data.max_length`` or ``draft.sliding_window`` beyond
            the target's ``max_position_embeddings``.
        FileNotFoundError: the target config cannot be read.
    """
    launcher = launcher or recipe.launcher
    launch = validate_launcher(recipe, launcher, draft_model_class(recipe.draft.method)) if launcher else None
    checked = preflight(recipe, target_config)
    config_json, source, config = checked.config_json, checked.source, checked.config
    n, ids, V, geometry, counts = checked.num_layers, checked.aux_layer_ids, checked.vocab_size, checked.geometry, \
        checked.counts
    T = recipe.data.max_length
    trainable = trainable_parameters(counts)
    hs_bytes = bytes_per_token(geometry.hidden_size, recipe.data.hidden_states_dtype)  # a shard's bytes per token
    tokens = recipe.data.expected_tokens
    estimate = memory_estimate(recipe, geometry, counts, V, launch)
    gpu = {**{k: v for k, v in estimate["state"].items() if k not in ("total", "optimizer_shards")},
           **estimate["frozen"], "batch": estimate["batch"],
           "activations": sum(estimate["activations"].values()), "total": estimate["per_gpu_bytes"]}
    weights = target_weight_bytes(config_json, recipe.target.dtype)
    dense = dict(config_json, quantization_config=None)  # transformers without MXFP4 kernels dequantises
    online_bytes = target_weight_bytes(dense, recipe.target.dtype)["bytes"]
    nodes = launch.num_machines if launch is not None else 1
    gpus = max(1, (launch.num_processes or 8 * nodes) // nodes) if launch is not None else 1
    try:  # the draft trains without the target; a data stage these GPUs cannot run is reported, not fatal
        plan = build_plan(recipe, config_json, Cluster(nodes, gpus, device_memory_gib),
                          regenerate_engine=_gpu_engine(recipe.data.regenerate.engine),
                          capture_engine="vllm" if recipe.data.hidden_states_engine == "auto"
                          else recipe.data.hidden_states_engine)
    except PlanError as err:
        plan = PlanRefusal(str(err))
    return {
        "target": recipe.target.name_or_path,
        "target_config": source,
        "target_weights": {**weights, "online_bytes": online_bytes},
        "hidden_states_mode": recipe.data.hidden_states_mode,
        "data_plan": plan,
        "method": recipe.draft.method,
        "architectures": list(getattr(config, "architectures", None) or []),
        "target_layers": n,
        "hidden_size": geometry.hidden_size,
        "vocab_size": V,
        "draft_vocab_size": geometry.draft_vocab_size,
        "aux_layer_ids": ids,
        "aux_layer_ids_are_vllm_default": ids == default_aux_layer_ids(n),
        "rope": {"rope_theta": geometry.rope_theta, "rope_scaling": geometry.rope_scaling},
        "draft_parameters": counts,
        "draft_trainable_parameters": trainable,
        "launcher": None if launch is None else dict(vars(launch), path=str(launch.path)),
        "estimate": estimate,
        "memory_bytes_per_gpu": gpu,
        "gradient_checkpointing": _checkpointing(recipe),
        "optimizer": recipe.train.optimizer,
        "hidden_state_bytes_per_token": hs_bytes,
        "expected_tokens": tokens,
        "offline_disk_bytes": hs_bytes * tokens if tokens else None,
        "ttt_steps": getattr(recipe.draft, "ttt_steps", None),  # eagle3 only
        "max_length": T,
    }


@dataclass(frozen=True)
class PlanRefusal:
    """The data plan's one-line refusal on the GPUs the dry run assumes (``--device-memory-gib``),
    in place of a :class:`~draftsmith.data_prep.plan.DataPlan`."""

    reason: str

    def format(self) -> str:
        return f"data plan        refused on these GPUs (prepare refuses the same): {self.reason}"


def _gpu_engine(engine: str) -> str:
    """``data.regenerate.engine`` as it resolves on a GPU node with vLLM installed."""
    return "vllm-server" if engine == "auto" else engine


def format_report(r: dict[str, Any]) -> str:
    est = r["estimate"]
    state, frozen = est["state"], est["frozen"]
    acts = ", ".join(f"{k.replace('_', ' ')} {_human(v)}" for k, v in est["activations"].items() if v)
    lines = [
        f"target           {r['target']} {r['architectures']}: {r['target_layers']} layers, H={r['hidden_size']}, "
        f"V={r['vocab_size']} (config: {r['target_config']})",
        f"aux layer ids    {r['aux_layer_ids']}" + (" (vLLM default)" if r["aux_layer_ids_are_vllm_default"] else " (differs from vLLM default: written into the export)"),
        f"draft            {r['method']}: {r['draft_trainable_parameters'] / 1e6:.1f}M trainable params "
        f"({', '.join(f'{k} {v / 1e6:.1f}M' for k, v in r['draft_parameters'].items())}); draft vocab {r['draft_vocab_size']}",
        f"hidden states    {_human(r['hidden_state_bytes_per_token'])} per token (3 aux + 1 final states, fp8 scales, id, mask); "
        f"{_human(r['hidden_state_bytes_per_token'] * 1e9)} per billion tokens",
        f"offline disk     {_human(r['offline_disk_bytes'])} for {r['expected_tokens'] or 'unknown'} expected tokens"
        + ("" if r["expected_tokens"] else " (set data.expected_tokens)"),
        f"rope             {json.dumps(r['rope'])}",
    ]
    w = r["target_weights"]
    lines.append(f"target weights   {_gib(w['bytes'])} as vLLM holds them"
                 + (f" ({w['quantization']} {'experts' if w['quantization'] == 'mxfp4' else 'linears'}); {_gib(w['online_bytes'])} dequantised (online mode)"
                    if w["quantization"] else ""))
    lines += _launcher_lines(r)
    lines.append(
        f"per-GPU memory   {_gib(est['per_gpu_bytes'])} at train.batch_size={est['batch_size']} x "
        f"data.max_length={est['max_length']} ({est['precision']}, gradient checkpointing "
        f"{'on' if r['gradient_checkpointing'] else 'off'}; peak in {est['peak_phase'].replace('_', '/')}): "
        f"weights {_human(state['weights'])} + grads {_human(state['gradients'])} + "
        f"{'Muon+AdamW' if r.get('optimizer') == 'muon' else 'AdamW'} {_human(state['optimizer_state'])} + frozen {_human(sum(frozen.values()))} + batch {_human(est['batch'])} + "
        f"activations {_human(sum(est['activations'].values()))} ({acts})")
    lines.append(r["data_plan"].format())
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _launcher_lines(r: dict[str, Any]) -> list[str]:
    launch = r["launcher"]
    if launch is None:
        return ["launcher         none (set launcher: recipes/accelerate/<name>.yaml to validate it; "
                "the estimate is for one fp32 process)"]
    kind = launch["distributed_type"]
    if launch["zero_stage"] is not None:
        kind += f" ZeRO-{launch['zero_stage']}"
    if launch["wrap_classes"] is not None:
        units = ", ".join(launch["wrap_classes"] + ["root"])
        kind += f" (FSDP2 units: {units}; from {launch['wrap_source']})"
    procs = launch["num_processes"] or "all GPUs"
    world = launch["num_processes"] or 1
    sharded = f"1/{world} of {', '.join(launch['sharded'])}" if launch["sharded"] else "nothing sharded"
    return [
        f"launcher         {launch['path']}: {kind}; {procs} processes on {launch['num_machines']} machine(s); "
        f"mixed precision {launch['mixed_precision']}; {sharded}; "
        f"clip grad norm {launch['gradient_clipping']} (train.max_grad_norm)",
    ]
