"""Dry run: validate a recipe against its target's config and print what training will cost,
without downloading weights.

    python train/eagle3.py RECIPE.yaml --dry-run [--target-config path/to/config.json]
        [--launcher recipes/accelerate/fsdp_8gpu.yaml] [--device-memory-gib 80]

Reports the aux layer ids (vLLM convention), the draft's parameter count, the bytes per token of
offline hidden states, the disk the configured dataset needs in offline mode and the training
memory of one GPU (:func:`memory_estimate`): the trainable state as the launcher shards it
(:func:`state_bytes_per_gpu`), the frozen target embedding and teacher head in the target's
dtype, the batch, and the method's activations at ``train.batch_size x data.max_length`` (per
method: EAGLE-3's K unrolled steps and their attention over the concatenated step keys,
DFlash's anchor blocks, P-EAGLE's COD elements, the heads of Medusa / the MLP speculator; the
teacher distribution; the chunked loss; with or without ``draft.gradient_checkpointing``).
``draftsmith bench memory RECIPE`` measures the same step (its real code under fake tensors)
beside this estimate; the two agree within 20% for every shipped GPU recipe
(``tests/integration/test_bench_memory_measured.py``).

The target's ``config.json`` comes from ``--target-config``, else from the copy shipped under
``recipes/targets/<hub id>/config.json`` (:func:`bundled_target_config`: every shipped GPU
recipe's target is there, so the dry run works offline), else from a local target directory
or the hub (the config file only, never weights).

When the recipe names a ``launcher`` (accelerate launcher YAML), it is validated against the
recipe and the method's draft model (:func:`draftsmith.train.launchers.validate_launcher`).
:func:`check_fits` refuses a recipe whose per-GPU estimate exceeds the device memory, naming
the keys that reduce it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..data_prep.target import (  # the config loaders live with the target; imported from here too
    TARGETS_DIR,
    text_json,
    bundled_target_config,
    default_aux_layer_ids,
    load_config_json,
    num_decoder_layers,
    validate_aux_layer_ids,
)
from ..data_prep.plan import Cluster, build_plan, target_weight_bytes
from ..models.common import text_config
from ..data_prep.plan import human_bytes as _human
from ..data_prep.shards import bytes_per_token
from ..methods import get_method
from ..models.eagle3.config import EAGLE31_OPTIONS, Eagle3Config
from ..recipe import Recipe
from .launchers import LauncherReport, draft_model_class, validate_launcher

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # fp8 scales: +16 B/token


# keys of the target's (text) config the estimates read; a config without one is refused
GEOMETRY_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                 "max_position_embeddings")


def validate_geometry(config_json: dict[str, Any], source: str) -> None:
    """Refuse a target config without a key the estimates read (:data:`GEOMETRY_KEYS`).

    Raises:
        ValueError: one line naming the first missing / non-positive key and the file.
    """
    text = text_json(config_json)
    for key in GEOMETRY_KEYS:
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            what = "missing" if value is None else f"{value!r} is not a positive integer"
            raise ValueError(f"{source}: target config key {key} {what} (needed for the memory estimate)")


def check_lengths(config_json: dict[str, Any], lengths: list[int], source: str, key: str = "data.max_length") -> None:
    """Refuse a sequence length beyond the target's ``max_position_embeddings`` (or below 2).

    Raises:
        ValueError: one line naming ``key``, the length and the target's limit.
    """
    limit = text_json(config_json).get("max_position_embeddings")
    for T in lengths:
        if T < 2:
            raise ValueError(f"{key}={T}: must be >= 2")
        if isinstance(limit, int) and T > limit:
            raise ValueError(f"{key}={T} exceeds the target's max_position_embeddings={limit} ({source})")


def config_from_json(config_json: dict[str, Any], trust_remote_code: bool = False) -> Any:
    """A transformers config object of ``config_json`` (through a temporary directory)."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="draftsmith-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_json))
        return AutoConfig.from_pretrained(tmp, trust_remote_code=trust_remote_code)


def load_config_only(recipe: Recipe, target_config: Path | None) -> Any:
    """The target's transformers config (see :func:`load_config_json`; config file only, never weights)."""
    config_json, _ = load_config_json(recipe, target_config)
    return config_from_json(config_json, recipe.target.trust_remote_code)


def draft_parameter_count(cfg: Eagle3Config) -> dict[str, int]:
    """Trainable parameters of the EAGLE-3 draft by part, plus the frozen shared embedding
    (the EAGLE-3.1 norms before ``fc``, 3 * Ht each for ``norm_before_fc`` and ``fc_norm``, under "norms")."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc": 3 * Ht * H,
        "attention": 2 * H * (q + 2 * kv) + q * H,
        "mlp": 3 * H * I,
        "norms": 4 * H + 3 * Ht * (int(cfg.norm_before_fc) + int(cfg.fc_norm)),
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
    """EAGLE-3 parameter counts by part, and (the registry's second value) an upper bound of
    unchunked TTT logits per micro-batch, K steps of (B*T, Vd) fp32 logits + their softmax grads;
    :func:`memory_estimate` uses the method's own terms (:func:`eagle3_activations`) instead."""
    logits_bytes = recipe.draft.ttt_steps * recipe.train.batch_size * recipe.data.max_length * cfg.draft_vocab_size * 4 * 3
    cfg = replace(cfg, **{k: getattr(recipe.draft, k) for k in EAGLE31_OPTIONS})
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


def dspark_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """DSpark: DFlash's counts (:func:`dflash_parameter_estimate`) plus the Markov head
    (``markov_w1 [V, r]``, ``markov_w2 [Vd, r]``) and the confidence head (``H (+ r) + 1``); its
    logits are DFlash's block logits."""
    counts, logits_bytes = dflash_parameter_estimate(recipe, cfg, vocab_size)
    d, r = recipe.draft, recipe.draft.markov_rank
    counts["markov_head"] = (vocab_size + cfg.draft_vocab_size) * r
    if d.confidence_head:
        counts["confidence_head"] = cfg.hidden_size + (r if d.confidence_head_with_markov else 0) + 1
    return counts, logits_bytes


def dflash2_parameter_estimate(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> tuple[dict[str, int], int]:
    """DFlash2 counterpart of :func:`dflash_parameter_estimate`: DFlash's counts plus per layer two
    grouped convolutions (``base_kernel [2, T, H]``, ``kernel_projection [2*T*H/gs, H]``) and the
    candidate selector (two ``[V, r]`` codebooks, ``[r, H]``). The selector's cross-entropy adds one
    more fp32 ``(rows, V)`` logits chunk per block row (the unary top-K), counted with the rest."""
    counts, logits_bytes = dflash_parameter_estimate(recipe, cfg, vocab_size)
    d, H = recipe.draft, cfg.hidden_size
    T = d.conv_kernel_size
    counts["convolutions"] = d.num_layers * 2 * (2 * T * H + 2 * T * (H // d.conv_group_size) * H)
    counts["candidate_selector"] = 2 * vocab_size * d.selector_rank + d.selector_rank * H
    return counts, logits_bytes * 4 // 3


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


def precision_of(launch: LauncherReport | None) -> str:
    """The precision path a launcher trains the draft on: ``"amp-bf16"`` (fp32 weights, bf16
    autocast: single GPU, DDP, FSDP with ``mixed_precision: bf16``), ``"bf16"`` (DeepSpeed casts
    the weights to bf16 and keeps fp32 masters in its optimizer) or ``"fp32"``."""
    if launch is None or launch.mixed_precision != "bf16":
        return "fp32"
    return "bf16" if launch.distributed_type == "DEEPSPEED" else "amp-bf16"


def state_bytes_per_gpu(trainable: int, launch: LauncherReport | None, precision: str | None = None,
                        optimizer: str = "adamw") -> dict[str, int]:
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
    :class:`~draftsmith.train.trainer.NonFiniteGuard`); every trainable parameter is counted at
    these 12 B, an upper bound (the embedding, head, norms and biases are AdamW's 8 B).
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


def shapes_of(recipe: Recipe, cfg: Eagle3Config, vocab_size: int, precision: str) -> Shapes:
    bf16 = precision in ("amp-bf16", "bf16")
    hs = recipe.data.hidden_states_dtype
    return Shapes(B=recipe.train.batch_size, T=recipe.data.max_length, H=cfg.hidden_size, Ht=cfg.target_hidden_size,
                  I=cfg.intermediate_size, nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim,
                  Vd=cfg.draft_vocab_size, V=vocab_size, n_aux=len(cfg.aux_layer_ids), precision=precision,
                  param_bytes=2 if precision == "bf16" else 4, act_bytes=2 if bf16 else 4,
                  hidden_state_bytes=4 if hs == "float8_e4m3fn" else DTYPE_BYTES[hs],  # fp8 shards decode to fp32
                  target_bytes=DTYPE_BYTES[recipe.target.dtype],
                  checkpointing=_checkpointing(recipe), packing=bool(recipe.train.packing))



def _checkpointing(recipe: Recipe) -> bool:
    """``draft.gradient_checkpointing``; the methods without the key (medusa, mlp_speculator) have none."""
    return bool(getattr(recipe.draft, "gradient_checkpointing", False))


def loss_chunk_bytes(recipe: Recipe, rows_total: int, vocab: int) -> int:
    """The chunked loss at its peak: one chunk of ``chunk_rows`` rows recomputed in backward,
    about six fp32 ``(C, V)`` tensors (logits, log-softmaxes, their product and gradients)."""
    from .losses import chunk_rows

    C = min(chunk_rows(vocab, recipe.train.loss_chunk_rows), max(1, rows_total))
    return 6 * C * vocab * 4


def fused_loss_bytes(recipe: Recipe, s: Shapes, rows_total: int, calls: int,
                     vocab: int | None = None) -> dict[str, int] | None:
    """The fused loss on a GPU (``train.fused_loss`` auto or true; train/fused_loss.py): one
    ``(C, Vd)`` logits buffer in the matmul dtype, and per call (EAGLE-3: one per TTT step) the
    gradients it computes in forward and holds to backward, ``(Vd, H)`` for ``lm_head`` and
    ``(M, H)`` for the rows. None when ``train.fused_loss`` is false (the chunked loss)."""
    if recipe.train.fused_loss is False:
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


def _input_cast(s: Shapes, n_aux: int) -> int:
    """``aux.to(param.dtype)``: a copy of the ``(B, T, n*Ht)`` aux states when their dtype differs."""
    want = s.param_bytes
    return s.E * n_aux * s.Ht * want if want != s.hidden_state_bytes else 0


def _weight_copies(s: Shapes, trainable: int) -> int:
    """Under bf16 autocast every weight a matmul reads is cast to bf16 once per forward and kept
    for backward (under FSDP2 the gathered bf16 weights, the same bytes)."""
    return 2 * trainable if s.precision == "amp-bf16" else 0


# EAGLE-3, per TTT step: the layer's tensors kept for backward (no checkpointing). Under bf16
# autocast (fp32 weights) the RMSNorm / residual stream stays fp32 and the (T, 2H) layer input is
# cast to bf16 once per projection; under DeepSpeed's bf16 weights they are bf16 throughout.
EAGLE3_STEP = {"amp-bf16": LayerBytes(H=45.2, I=8.4, Q=3.9, KV=14.9),
               "bf16": LayerBytes(H=24.6, I=8.7, Q=4.3, KV=11.2),
               "fp32": LayerBytes(H=49.2, I=16.3, Q=11.3, KV=16.3)}
# ... with draft.gradient_checkpointing: what each step keeps (its inputs and keys / values) and
# the one step recomputed in backward
EAGLE3_CKPT_KEPT = {"amp-bf16": LayerBytes(H=9.2, KV=10.2), "bf16": LayerBytes(H=1.2, KV=10.4),
                    "fp32": LayerBytes(H=12.0, KV=16.0)}
EAGLE3_CKPT_STEP = {"amp-bf16": LayerBytes(H=40.1, I=10.7, Q=1.2), "bf16": LayerBytes(H=35.3, I=13.0),
                    "fp32": LayerBytes(H=49.2, I=16.3, Q=11.3, KV=16.3)}


def eagle3_activations(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """EAGLE-3: K unrolled steps of the decoder layer over ``B x T`` tokens, attention over the
    concatenated step keys (SDPA with a bool mask: memory linear in T; the mask's float bias,
    ``(k + 1) T^2`` elements at step k, is kept for backward), the teacher's distribution over
    the draft vocab once per batch (``(B*T, Vd)`` in the target's dtype on a GPU) and the chunked loss."""
    K = recipe.draft.ttt_steps
    if s.checkpointing:
        layers = K * EAGLE3_CKPT_KEPT[s.precision](s, s.E) + EAGLE3_CKPT_STEP[s.precision](s, s.E)
    else:
        layers = K * EAGLE3_STEP[s.precision](s, s.E)
    flex = getattr(recipe.train, "attention_backend", "sdpa") == "flex"
    masks = 0 if flex else K * (K + 1) // 2 * s.T * s.T * s.act_bytes * (s.B if s.packing else 1)
    # SDPA keeps step k's concatenated keys / values, (k + 1) T rows, expanded to nh heads on a GPU
    steps_kept = 1 if s.checkpointing else K
    expanded = 0 if flex else _gqa_expanded_kv(s, s.E * sum(k + 1 for k in range(K - steps_kept, K)))
    out = {"layers": layers, "attention_masks": masks, "gqa_expanded_kv": expanded, "teacher": s.E * s.Vd * s.target_bytes,
           "loss_chunk": loss_chunk_bytes(recipe, s.E, s.Vd), "input_cast": _input_cast(s, s.n_aux),
           "weight_copies": _weight_copies(s, trainable)}
    return {**out, **(fused_loss_bytes(recipe, s, s.E, K) or {})}


# DFlash, per layer over the B*A*Bk block tokens (A anchors of Bk slots): the layer recomputed in
# backward (draft.gradient_checkpointing; without it every layer keeps these). Under bf16 autocast
# the block's residual stream is fp32.
DFLASH_LAYER = {"amp-bf16": LayerBytes(H=30, I=8, Q=8), "bf16": LayerBytes(H=27, I=10, Q=8),
                "fp32": LayerBytes(H=40, I=16, Q=16)}
DFLASH_CONTEXT = {"amp-bf16": 10, "bf16": 10, "fp32": 20}  # B / token / unit of H: the fused aux context


def dflash_activations(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """DFlash: ``draft.num_layers`` layers over the fused context (``B x T``) and ``A =
    min(draft.num_anchors, T - 1)`` anchor blocks of ``Bk = draft.block_size`` tokens that attend
    to the context before their anchor and to their own block (SDPA over ``[context | blocks]``
    with a bool mask; its float bias and the bool mask, 3 B per ``(A*Bk) x (T + A*Bk)`` element,
    are kept for backward). The peak is the larger of the loss at the end of forward (the
    teacher's fp32 distribution at the ``B x T`` positions, the chunked loss, and under bf16
    autocast every weight's bf16 copy) and a layer's backward (recomputed under
    ``draft.gradient_checkpointing``, with its weights' bf16 copies)."""
    d = recipe.draft
    L, Bk = d.num_layers, d.block_size
    A = max(1, min(d.num_anchors, s.T - 1))
    Eb = s.B * A * Bk
    layer = DFLASH_LAYER[s.precision](s, Eb)
    kept_bytes = s.act_bytes if s.precision == "bf16" else 4
    copies = _weight_copies(s, trainable)
    kv_rows = s.B * (s.T + A * Bk)  # [context | blocks] keys of one layer
    saved = {"attention_masks": 3 * s.B * A * Bk * (s.T + A * Bk),
             "gqa_expanded_kv": (1 if s.checkpointing else L) * _gqa_expanded_kv(s, kv_rows),
             "context": DFLASH_CONTEXT[s.precision] * s.E * s.H,
             "input_cast": _input_cast(s, s.n_aux)}
    if s.checkpointing:
        saved["layer_inputs"] = L * Eb * s.H * kept_bytes
        backward = {"layer_backward": layer, "weight_copies": copies // L}
    else:
        backward = {"layers": L * layer, "weight_copies": copies}
    loss = {"teacher": s.E * s.Vd * s.target_bytes, "loss_chunk": 7 * _chunk(recipe, Eb, s.Vd) * s.Vd * 4, "weight_copies": copies}
    return {**saved, **(backward if sum(backward.values()) >= sum(loss.values()) else loss)}


def dflash2_activations(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """DFlash2: :func:`dflash_activations` plus, per layer kept for backward, the four grouped
    convolutions' inputs and ``(T+1)`` fp32 coefficient copies of the ``Eb x H`` block rows, and
    the selector's loss chunk (one more fp32 ``(rows, V)`` logits chunk with its top-K)."""
    out = dflash_activations(recipe, s, trainable)
    d = recipe.draft
    Eb = s.B * max(1, min(d.num_anchors, s.T - 1)) * d.block_size
    kept = 1 if s.checkpointing else d.num_layers
    out["convolutions"] = kept * 4 * (d.conv_kernel_size + 1) * Eb * s.H * 4
    out["selector_chunk"] = 3 * _chunk(recipe, Eb, s.V) * s.V * 4
    return out


# P-EAGLE, per layer over the B*S COD elements (S = T + the depths' budgets): layer 0 reads the
# (S, 2H) concatenation of embedding and hidden state (cast once per projection under autocast).
PEAGLE_LAYER = {"amp-bf16": LayerBytes(H=26.5, I=8, Q=4, KV=4), "bf16": LayerBytes(H=22.5, I=6.5, Q=4.5, KV=4),
                "fp32": LayerBytes(H=53, I=16, Q=8, KV=8)}
PEAGLE_LAYER0_INPUT = {"amp-bf16": 12, "bf16": 4, "fp32": 8}


def cod_elements(recipe: Recipe, T: int) -> int:
    """S, the COD elements of a row of T positions (every position trained: the upper bound)."""
    from .labels import cod_budget

    d = recipe.draft
    return T + sum(cod_budget(T, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min, d.max_anchors))


def peagle_activations(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """P-EAGLE: ``draft.num_layers`` layers over the ``B x S`` COD elements of one forward
    (:func:`cod_elements`), attention with a ``(B, S, S)`` mask (its bf16 bias kept for backward),
    the teacher's fp32 distribution at the ``B x T`` positions, the chunked loss over the
    trained elements and their gathered rows."""
    d = recipe.draft
    S = cod_elements(recipe, s.T)
    Es = s.B * S
    L = d.num_layers
    embed = s.V * s.H if d.train_embeddings else 0  # a lookup, never cast by autocast
    layers = L * PEAGLE_LAYER[s.precision](s, Es) + PEAGLE_LAYER0_INPUT[s.precision] * Es * s.H
    if s.checkpointing:  # each layer keeps its input; one layer recomputed in backward
        layers = L * Es * s.H * (4 if s.precision != "bf16" else 2) + PEAGLE_LAYER[s.precision](s, Es)
    kept = 1 if s.checkpointing else L
    expanded = 0 if getattr(recipe.train, "attention_backend", "sdpa") == "flex" else kept * _gqa_expanded_kv(s, Es)
    return {"layers": layers, "attention_masks": s.act_bytes * s.B * S * S, "gqa_expanded_kv": expanded,
            "teacher": s.E * s.Vd * s.target_bytes,
            "loss_chunk": 7 * _chunk(recipe, Es, s.Vd) * s.Vd * 4, "loss_rows": 4 * Es * s.H,
            "input_cast": _input_cast(s, s.n_aux), "weight_copies": _weight_copies(s, trainable - embed)}


def _gqa_expanded_kv(s: Shapes, key_rows: int) -> int:
    """Bytes of the key / value head copies for ``key_rows`` keys (batch included) that a GPU's SDPA
    keeps: with a mask, CUDA's fused kernels take no grouped heads, so the ``nkv`` heads are
    expanded to ``nh`` (``models/eagle3/model.py`` ``sdpa_with_mask``); the extra ``nh - nkv`` heads."""
    return 2 * key_rows * (s.nh - s.nkv) * s.hd * s.act_bytes


def _chunk(recipe: Recipe, rows_total: int, vocab: int) -> int:
    from .losses import chunk_rows

    return min(chunk_rows(vocab, recipe.train.loss_chunk_rows), max(1, rows_total))


def medusa_activations(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """Medusa: K heads over the M = B*T gathered rows, each ``draft.num_layers`` ResBlocks and a
    full-vocab ``lm_head`` trained with chunked cross-entropy. The peak is the larger of the end
    of forward (under bf16 autocast every head's bf16 ``lm_head`` copy, K x V x H x 2 B, and the
    rows' ResBlock tensors, ``4 + 8 * K * layers`` B per unit of H) and the backward of a head
    (its bf16 ``lm_head`` weight and gradients, 3 x V x H x 2 B, and its rows)."""
    K, L, V, M = recipe.draft.num_heads, recipe.draft.num_layers, s.V, s.E
    cast = s.act_bytes if s.precision == "amp-bf16" else 0
    forward = {"head_weight_copies": K * V * s.H * cast, "block_weight_copies": K * L * s.H * s.H * cast,
               "rows": M * s.H * (4 + 8 * K * L), "loss_chunk": 2 * _chunk(recipe, M, V) * V * 4}
    fused = fused_loss_bytes(recipe, s, M, K, V)
    if fused is not None:  # every head's gradients held from forward; its bf16 weight copy freed after its call
        forward = {**forward, **fused, "head_weight_copies": 0}
    backward = {"head_weight_and_gradients": 3 * V * s.H * s.act_bytes, "rows": M * s.H * (4 + 8 * L)}
    return forward if sum(forward.values()) >= sum(backward.values()) else backward


def mlp_speculator_activations(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """MLP speculator: P stages over the M = B*T gathered rows (inner width D), each with a
    token embedding and a full-vocab head. The peak is in backward at the embeddings: their
    dense fp32 ``(V, D)`` gradients (tied weights: every stage's, summed: about 3.5 fp32 tables),
    plus the rows' stage tensors (about 22 B per unit of D)."""
    D = recipe.draft.inner_dim or s.H
    tables = 14 * s.V * D if recipe.draft.tie_weights else 6 * s.V * D
    # the fused loss (GPU): the heads' gradients, computed in forward, are held into backward
    fused = fused_loss_bytes(recipe, replace(s, H=D), s.E, recipe.draft.n_predict, s.V) or {}
    held = {"fused_loss_gradients": fused["fused_loss_gradients"]} if fused else {}
    backward = {"embedding_gradients": tables, "rows": 22 * s.E * D, "input_cast": 0, **held}
    forward = {"rows": 22 * s.E * D, "input_cast": 0, **fused}
    return forward if sum(forward.values()) > sum(backward.values()) else backward


ACTIVATIONS = {"eagle3": eagle3_activations, "dflash": dflash_activations, "peagle": peagle_activations,
               "medusa": medusa_activations, "mlp_speculator": mlp_speculator_activations,
               "dspark": dflash_activations,  # DSpark's block activations are DFlash's
               "dflash2": dflash2_activations}


def parameter_counts(recipe: Recipe, cfg: Eagle3Config, vocab_size: int) -> dict[str, int]:
    """The method's parameter counts by part (``methods`` registry estimator), with the draft's
    ``lm_head`` as ``frozen_lm_head`` under ``draft.freeze_lm_head``. Parts named ``frozen_*``
    are not trained (:func:`trainable_parameters`)."""
    counts, _ = get_method(recipe.draft.method).parameter_estimator(recipe, cfg, vocab_size)
    if getattr(recipe.draft, "freeze_lm_head", False) and "lm_head" in counts:
        counts["frozen_lm_head"] = counts.pop("lm_head")
    return counts


def trainable_parameters(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if not k.startswith("frozen_"))


def frozen_bytes(recipe: Recipe, s: Shapes, counts: dict[str, int]) -> dict[str, int]:
    """The frozen tensors on every GPU: the target embedding (drafts that read it) and the
    teacher head over the draft vocab, both in the target's dtype, a frozen ``lm_head`` (a
    parameter: fp32, bf16 under DeepSpeed) and the vocab maps."""
    if recipe.draft.method in ("medusa", "mlp_speculator"):
        return {}
    return {"frozen_embedding": counts.get("frozen_embedding", 0) * s.target_bytes,
            "frozen_lm_head": counts.get("frozen_lm_head", 0) * s.param_bytes,
            "teacher_head": s.Vd * s.Ht * s.target_bytes, "vocab_maps": s.Vd * 8 + s.V}


def memory_estimate(recipe: Recipe, cfg: Eagle3Config, counts: dict[str, int], vocab_size: int,
                    launch: LauncherReport | None, precision: str | None = None) -> dict[str, Any]:
    """The training memory of one GPU at ``train.batch_size x data.max_length`` (bytes).

    ``per_gpu_bytes`` is the larger of the forward / backward peak (state + frozen + batch +
    activations) and the optimizer step (state + frozen + batch; the trainer's fused AdamW keeps
    no per-parameter temporaries). ``state``: :func:`state_bytes_per_gpu`; ``frozen``:
    :func:`frozen_bytes`; ``batch``: the hidden states and token tensors of one micro-batch;
    ``activations``: the method's terms (e.g. :func:`eagle3_activations`).
    """
    precision = precision or precision_of(launch)
    trainable = trainable_parameters(counts)
    s = shapes_of(recipe, cfg, vocab_size, precision)
    state = state_bytes_per_gpu(trainable, launch, precision, recipe.train.optimizer)
    frozen = frozen_bytes(recipe, s, counts)
    batch = s.E * (s.n_aux + 1) * s.Ht * s.hidden_state_bytes + 3 * s.E * 8  # aux + final states, ids / masks
    estimator = ACTIVATIONS.get(recipe.draft.method)
    if estimator is None:  # a method without its own terms: the registry's logits estimate
        acts = {"logits": get_method(recipe.draft.method).parameter_estimator(recipe, cfg, vocab_size)[1]}
    else:
        acts = estimator(recipe, s, trainable)
    update = 0  # the trainer's fused AdamW (CUDA) updates in place: no per-parameter temporaries
    fixed = state["total"] + sum(frozen.values()) + batch
    forward_backward = fixed + sum(acts.values())
    optimizer = fixed + update
    return {"precision": precision, "batch_size": s.B, "max_length": s.T, "trainable_parameters": trainable,
            "state": state, "frozen": frozen, "batch": batch, "activations": acts,
            "optimizer_transients": update, "forward_backward_bytes": forward_backward, "optimizer_bytes": optimizer,
            "per_gpu_bytes": max(forward_backward, optimizer),
            "peak_phase": "forward_backward" if forward_backward >= optimizer else "optimizer"}


def estimate_inputs(recipe: Recipe, config_json: dict[str, Any]) -> tuple[Eagle3Config, dict[str, int], int]:
    """``(cfg, parameter counts, V)`` of :func:`memory_estimate` from the target's ``config.json``."""
    config = config_from_json(config_json, recipe.target.trust_remote_code)
    n = num_decoder_layers(config)
    ids = validate_aux_layer_ids(recipe.data.aux_layer_ids or default_aux_layer_ids(n), n)
    V = int(text_config(config).vocab_size)
    cfg = Eagle3Config.from_target(config, min(recipe.data.draft_vocab_size, V), ids)
    return cfg, parameter_counts(recipe, cfg, V), V


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
            target config lacks a geometry key; ``data.max_length`` beyond the target's
            ``max_position_embeddings``.
        FileNotFoundError: the target config cannot be read.
    """
    launcher = launcher or recipe.launcher
    launch = validate_launcher(recipe, launcher, draft_model_class(recipe.draft.method)) if launcher else None
    config_json, source = load_config_json(recipe, target_config)
    validate_geometry(config_json, source)
    check_lengths(config_json, [recipe.data.max_length], source)
    config = config_from_json(config_json, recipe.target.trust_remote_code)
    text = text_config(config)
    n = num_decoder_layers(config)
    ids = validate_aux_layer_ids(recipe.data.aux_layer_ids or default_aux_layer_ids(n), n)
    V = int(text.vocab_size)
    if recipe.data.draft_vocab_size > V:
        raise ValueError(f"data.draft_vocab_size={recipe.data.draft_vocab_size} exceeds the target vocab of {V}")
    # the target's shapes for every method's estimator (norm_before_residual changes no count; the
    # EAGLE-3.1 norms are added by eagle3_parameter_estimate)
    cfg = Eagle3Config.from_target(config, recipe.data.draft_vocab_size, ids)
    T = recipe.data.max_length
    counts = parameter_counts(recipe, cfg, V)
    trainable = trainable_parameters(counts)
    hs_bytes = bytes_per_token(cfg.hidden_size, recipe.data.hidden_states_dtype)  # a shard's bytes per token
    tokens = recipe.data.expected_tokens
    estimate = memory_estimate(recipe, cfg, counts, V, launch)
    gpu = {**{k: v for k, v in estimate["state"].items() if k not in ("total", "optimizer_shards")},
           **estimate["frozen"], "batch": estimate["batch"],
           "activations": sum(estimate["activations"].values()), "total": estimate["per_gpu_bytes"]}
    weights = target_weight_bytes(config_json, recipe.target.dtype)
    dense = dict(config_json, quantization_config=None)  # transformers without MXFP4 kernels dequantises
    online_bytes = target_weight_bytes(dense, recipe.target.dtype)["bytes"]
    nodes = launch.num_machines if launch is not None else 1
    gpus = max(1, (launch.num_processes or 8 * nodes) // nodes) if launch is not None else 1
    plan = build_plan(recipe, config_json, Cluster(nodes, gpus, device_memory_gib),
                      regenerate_engine=_gpu_engine(recipe.data.regenerate.engine),
                      capture_engine="vllm" if recipe.data.hidden_states_engine == "auto"
                      else recipe.data.hidden_states_engine)
    return {
        "target": recipe.target.name_or_path,
        "target_config": source,
        "target_weights": {**weights, "online_bytes": online_bytes},
        "hidden_states_mode": recipe.data.hidden_states_mode,
        "data_plan": plan,
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
                 + (f" ({w['quantization']} experts); {_gib(w['online_bytes'])} dequantised (online mode)"
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
