"""GPU benchmark of the real training step of EAGLE-3 (and 3.1), DFlash, P-EAGLE and DSpark at each recipe's geometry.

    python -m benchmarks.gpu [--recipes R [R ...]] [--backends sdpa flex] [--steps 10]
        [--warmup 3] [--batch-size B] [--max-length T] [--lengths default|full|RUN_DIR]
        [--set KEY=VALUE ...] [--profile] [--out bench_gpu.json]
    python -m benchmarks.gpu --tiny --device cpu --steps 1 --warmup 0   # the same code on a CPU

For every recipe (a name under ``recipes/`` or a YAML path; default: the Llama-3.1-8B
recipes of EAGLE-3, DFlash, P-EAGLE, EAGLE-3.1 and DSpark, and gpt-oss-120b's of the first three) and every ``train.attention_backend`` (``--backends``),
one row: the recipe's method object is built at the target's true geometry with random weights by
the builders of ``draftsmith bench memory`` (:mod:`benchmarks.memory`:
:func:`~benchmarks.memory.offline_method`, :func:`~benchmarks.memory.prepare_model`,
:func:`~benchmarks.memory.random_batch`; the target's ``config.json`` from
``recipes/targets/``, nothing downloaded), at the recipe's micro-batch ``B x T`` (Llama-3.1-8B /
Qwen3-8B recipes 4 x 2048, gpt-oss-120b 2 x 4096; ``--batch-size`` / ``--max-length`` override)
and on the launcher's precision path (bf16 autocast with fp32 weights; bf16 weights under
DeepSpeed; ``--precision``). The batch is real random tensors on the device: every position real
and trained (the upper bound of the loss work), the method's batch plan applied on the host, the
aux / final hidden states in ``data.hidden_states_dtype``. Each step is the trainer's: the method's
``compute_loss`` (loss chunked inside the draft's forward), ``backward``, gradient clipping at
``train.max_grad_norm``, the non-finite guard and the step of ``train.optimizer`` (fused AdamW;
AdamW then torch's Muon, whose Newton-Schulz iterations are timed but not in the model FLOPs),
the metrics summed on the device; ``begin_step`` advances, so DFlash anchors and P-EAGLE COD elements are redrawn every step.
``--warmup`` untimed steps (torch.compile of the flex kernels happens there; each row compiles
afresh, for its one shape, where a run whose lengths vary compiles dynamic-shape kernels), then
``--steps`` timed back to back, timed by CUDA events around the whole run (no synchronisation in
between).
The batch's host-to-device copy is not timed (the trainer overlaps it: pinned, non-blocking).

The batch timed: ``--lengths`` (:mod:`benchmarks.lengths`): by default sequence lengths drawn from a
documented stand-in for regenerated chat conversations at the recipe's ``data.max_length`` (or a
prepared run's own, ``--lengths RUN_DIR``), batched as the trainer batches them (packed rows of
``train.pack_tokens`` under ``train.packing``, else length-grouped rows), the batch with the median
useful fraction, padded as the trainer pads it (to its length bucket under flex); ``--lengths full``:
every position real.

Per row: ``ms_per_step``, ``useful_tokens_per_s`` (real, non-padding tokens per second: what a run
buys), ``positions_per_s`` (``B * T`` per second, padding included), ``useful_fraction``,
``documents``, ``loss_tokens`` / ``loss_tokens_per_s`` (the batch's ``loss_mask`` positions, the
tokens that carry loss, per second: the useful tokens here, where every real position is trained),
``fused_loss_ran`` / ``fused_loss_launches_per_step`` (the fused loss's op ``draftsmith::distill_rows``
ran its kernel in the timed steps, :class:`FusedLossCount`; ``fused_loss`` the setting; False where
the step took the chunked torch path, e.g. on a CPU), ``compiled_regions`` / ``compile_regions``
(``train.compile``'s regions torch._dynamo holds compiled code for / regions wrapped,
:func:`compiled_regions`), ``compiled_graphs`` / ``graphs_after_first_step`` (graphs dynamo made over
the row's steps, flex included / after the first: 0 when a bucket compiles once), ``first_step_s``
and ``compile_s`` (the first warm-up step's wall seconds, and those beyond a timed step's: the cold
compilation of dynamo, inductor and Triton, reported, not asserted; None without ``--warmup``) with
``compile_caches`` (:func:`compile_caches`: the inductor / Triton cache folders and whether they
already held entries, i.e. whether the compile was really cold), ``cuda_max_allocated`` /
``cuda_max_reserved`` (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the timed
steps, i.e. with the optimizer state; one process holding the whole training state),
``fake_process_peak`` / ``fake_per_gpu`` (``draftsmith bench memory``'s FakeTensorMode
measurement of the same step with the SDPA backend: one process, and per GPU under the recipe's
launcher), ``per_gpu`` (the CUDA peak with the launcher's sharding applied as the fake measurement
applies it: ``cuda_max_allocated - fake_process_peak + fake_per_gpu``; for the 8-GPU FSDP /
ZeRO-2 recipes the trainable state a rank holds is an eighth) and ``mfu``.

MFU = credited FLOPs per step / step time / the device's dense bf16 peak (``--peak-tflops``, else
from the device name: H100 SXM / H200 / GH200 989, H100 NVL 835, H100 PCIe 756, A100 312, B200
2250, L40S 362 TFLOP/s, NVIDIA's datasheets; none on a CPU). Credited FLOPs (model FLOPs: what the
step must compute, not what the kernels execute):

- every ``nn.Linear`` of the draft over the rows it really runs on: ``2 * P * rows`` forward, plus
  ``2 * P * rows`` for the weight gradient when the weight is trained, plus ``2 * P * rows`` for
  the input gradient when the input needs one (not ``fc``, whose input is the target's states).
  Rows (N: the batch's real positions, B*T without padding; padding is computed but not credited):
  EAGLE-3 ``fc`` N, its layer N per TTT step, ``lm_head`` the M_k trained rows of each
  step (the batch plan's counts); DFlash ``fc`` B*T, per layer ``k_proj`` / ``v_proj`` over the
  context and the blocks (B*T + B*A*Bk), ``q_proj`` / ``o_proj`` / the MLP over the blocks, the
  (frozen) ``lm_head`` over the B*A*(Bk-1) slot rows; P-EAGLE ``fc`` B*T, every layer over the B*S
  COD elements, ``lm_head`` over the plan's trained rows. Embedding lookups, norms, RoPE, softmax
  and the optimizer are not counted.
- attention at its real masked work: ``12 * nh * hd`` per allowed (query, key) pair and layer
  (QK^T and PV, ``4 * hd`` per pair and head forward, twice that backward). Allowed pairs:
  EAGLE-3 ``K * sum T_doc (T_doc + 1) / 2 + N * K (K - 1) / 2`` (the causal step-0 block and one
  diagonal key per earlier step); DFlash ``sum over valid anchors Bk * (context before the anchor + Bk)``;
  P-EAGLE the pairs the COD interval rule allows between valid elements. DFlash's anchors and
  P-EAGLE's elements are drawn on the device inside the step: the count is taken on one draw of
  the same sampler on the CPU batch (same sizes; the pair count varies between draws by a few
  tenths of a percent). Fully masked work SDPA still computes is not credited; flex skips it.
- the teacher head (the target's ``lm_head`` rows of the draft vocab, bf16 on a GPU, no grad):
  ``2 * Ht * Vd`` per teacher row (EAGLE-3 the rows some TTT step needs, DFlash ``min(B*A*(Bk-1),
  B*T)``, P-EAGLE ``B*(T-1)``).
- not credited: activation-checkpointing recomputation (DFlash's layers) and the chunked loss's
  recomputation of each chunk's logits in backward. ``counted_tflop_per_step`` (SDPA rows) is
  ``torch.utils.flop_counter``'s count of one extra step's forward and backward for comparison
(not the optimizer's: Muon's Newton-Schulz matmuls are no model FLOPs): every matmul executed,
  recomputation included, and attention as dense over its whole mask (CUDA kernels; torch counts
  no CPU attention kernel).

Unless ``--no-capture``: the target's hidden-state capture at the same ``B x T`` (the online
mode's per-micro-batch work) for each distinct dense target whose random bf16 weights fit the
device (not gpt-oss-120b): ``target plain forward`` (logits over the full vocab), ``decoder only``
and ``capture`` (:func:`~draftsmith.target.capture.capture_batch`: the decoder with hooks on
the aux layers), all under ``no_grad``; FLOPs ``2 * P_decoder * B*T`` plus causal attention
``4 * d * T (T + 1) / 2`` per layer and row, plus ``2 * P_lm_head * B*T`` for the plain forward.

``--profile``: ``--steps`` more steps under ``torch.profiler`` per row, and per step the kernel time
and count by class (:func:`kernel_class`: gemm, attention, copy/cast, elementwise, softmax/loss,
reductions, optimizer; CUDA kernels on a GPU, the aten ops' time on a CPU) beside the host's time
per step: where the GPU time goes, and whether launches or Python are on the critical path.

Output: a table on stdout and, with ``--out``, one JSON object (``environment``, ``settings``,
``rows``, ``capture``). Exit 0; 1 when a row failed (its ``error`` is recorded, the other rows
still run); 2 on bad arguments or no CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

GiB = 1024**3
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
# one 80 GB GPU: the Llama recipes' one-process peaks are 27-49 GiB, gpt-oss's 7-13 GiB (bench memory)
DEFAULT_RECIPES = ("llama3_1_8b", "llama3_1_8b_dflash", "llama3_1_8b_peagle",
                   "llama3_1_8b_eagle31", "llama3_1_8b_dspark",
                   "gptoss120b", "gptoss120b_dflash", "gptoss120b_peagle")
TINY_RECIPES = ("smollm2_135m", "smollm2_135m_dflash", "smollm2_135m_peagle", "smollm2_135m_dspark")
TINY_BATCH, TINY_LENGTH = 1, 64
# EAGLE-3.1 recipes are method eagle3 (its norms are not matmuls: no FLOPs credited for them)
METHODS = ("eagle3", "dflash", "peagle", "dspark")
BACKENDS = ("sdpa", "flex")
# dense bf16 tensor-core peak per GPU (TFLOP/s), NVIDIA datasheets; the first name contained in the
# device name wins ("NVIDIA H100 80GB HBM3" is the SXM part)
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("A100", 312.0), ("B200", 2250.0), ("L40S", 362.0))


# ---------------------------------------------------------------------------------------------
# FLOP counts (module docstring)


def linear_flops(module: nn.Module, rows: int, input_grad: bool = True) -> float:
    """Training FLOPs of every ``nn.Linear`` in ``module`` over ``rows`` rows: ``2 * P * rows``
    forward, the same again for the weight gradient (trained weights) and for the input gradient
    (``input_grad``)."""
    total = 0.0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            passes = 1 + int(m.weight.requires_grad) + int(input_grad)
            total += 2.0 * m.weight.numel() * rows * passes
    return total


def attention_flops(pairs: float, heads: int, head_dim: int) -> float:
    """Training FLOPs of attention over ``pairs`` allowed (query, key) pairs: ``12 * nh * hd`` each."""
    return 12.0 * pairs * heads * head_dim


def document_lengths(document_ids: torch.Tensor | None, B: int, T: int) -> list[list[int]]:
    """Per row, the lengths of its documents (contiguous runs of ``document_ids``, padding's -1
    left out); one of T without."""
    if document_ids is None:
        return [[T]] * B
    out = []
    for row in document_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        out.append(counts[ids >= 0].tolist())
    return out


def document_starts(document_ids: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """``(B, T)`` the first position of each position's document (0 without documents)."""
    if document_ids is None:
        return torch.zeros(B, T, dtype=torch.long)
    docs = document_ids.cpu()
    start = torch.ones_like(docs, dtype=torch.bool)
    start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    idx = torch.arange(T).expand(B, T)
    return torch.where(start, idx, 0).cummax(1).values


def ttt_pairs(document_ids: torch.Tensor | None, B: int, T: int, steps: int) -> int:
    """Allowed (query, key) pairs of EAGLE-3's TTT attention over ``steps`` steps: each step's
    causal step-0 block inside the documents plus one diagonal key per earlier step."""
    lengths = [L for row in document_lengths(document_ids, B, T) for L in row]
    return steps * sum(L * (L + 1) // 2 for L in lengths) + sum(lengths) * steps * (steps - 1) // 2


def dflash_pairs(anchors: torch.Tensor, valid: torch.Tensor, document_ids: torch.Tensor | None,
                 block_size: int) -> int:
    """Allowed (query, key) pairs of one DFlash layer over the valid anchor blocks: each of a
    block's Bk queries sees the context before its anchor (in its document) and its own block."""
    context = anchors  # keys strictly before the anchor ...
    if document_ids is not None:  # ... in its document
        context = anchors - document_starts(document_ids, *document_ids.shape).gather(1, anchors)
    return int((block_size * (context + block_size))[valid].sum())


def cod_allowed_pairs(elements: Any, document_ids: torch.Tensor | None) -> int:
    """The (query, key) pairs between valid COD elements that P-EAGLE's mask allows
    (``lo[k] <= x[q] <= hi[k]``, :func:`~draftsmith.models.peagle.model.cod_attention_keys`), counted
    with sorted interval bounds (no ``S x S`` tensor)."""
    from draftsmith.models.peagle.model import cod_attention_keys

    x, lo, hi = cod_attention_keys(elements, document_ids)
    total = 0
    for b in range(x.shape[0]):
        xq = x[b][elements.valid[b]]
        los, his = lo[b].sort().values, hi[b].sort().values
        # hi >= lo for every key, so the keys with hi < x are a subset of those with lo <= x
        n = torch.searchsorted(los, xq, right=True) - torch.searchsorted(his, xq, right=False)
        total += int(n.sum())
    return total


def step_flops(method: Any, model: nn.Module, batch: dict[str, Any], recipe: Any, seed: int = 0) -> dict[str, Any]:
    """The credited FLOPs of one training step of ``method`` on ``batch`` (the device batch with
    its plan), by part (``linear``, ``attention``, ``teacher``, ``total``), and the sizes they
    come from (``attention_pairs``, ``lm_head_rows``, ``teacher_rows``, method-specific sizes)."""
    ids = batch["input_ids"]
    B, T = ids.shape
    real = batch["attention_mask"].cpu()
    n = int(real.sum())  # real positions: padding is computed but not credited
    docs = batch.get("document_ids")
    docs_cpu = None if docs is None else docs.cpu()
    # unpacked rows with padding: one document per row, padding -1 (pair counts leave it out)
    docs_pairs = docs_cpu if docs_cpu is not None or n == B * T else torch.where(real.bool(), 0, -1)
    loss_mask = batch["loss_mask"].cpu()
    cfg = model.config
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    Vd, Ht = method.target_head.weight.shape
    out: dict[str, Any] = {}
    if method.name == "eagle3":
        K = recipe.draft.ttt_steps
        pairs = ttt_pairs(docs_pairs, B, T, K)
        lm_rows = int(sum(batch["ttt_counts_host"]))
        teacher_rows = int(batch["ttt_teacher_rows"].numel())
        linear = (linear_flops(model.fc, n, input_grad=False) + K * sum(linear_flops(layer, n) for layer in model.layers)
                  + linear_flops(model.lm_head, lm_rows))
        attention = len(model.layers) * attention_flops(pairs, nh, hd)
        out.update(ttt_steps=K)
    elif method.name in ("dflash", "dspark"):
        from draftsmith.models.dflash.training import NUM_ANCHORS_KEY, sample_anchors

        Bk = cfg.block_size
        A = batch.get(NUM_ANCHORS_KEY) or min(recipe.draft.num_anchors, max(T - 1, 1))
        anchors, valid = sample_anchors(loss_mask, A, torch.Generator().manual_seed(seed), docs_cpu)
        A = anchors.shape[1]
        pairs = dflash_pairs(anchors, valid, docs_cpu, Bk) * cfg.num_layers
        blocks = B * A * Bk
        # DFlash scores slots 1..Bk-1 (slot 0 holds the anchor); DSpark every slot (sample_from_anchor)
        slots = Bk if method.name == "dspark" else Bk - 1
        lm_rows = B * A * slots
        teacher_rows = lm_rows if A * slots < T else n
        linear = linear_flops(model.fc, n, input_grad=False) + linear_flops(model.lm_head, lm_rows)
        if method.name == "dspark":  # the Markov bias [Vd, r] and the confidence head [1, H (+r)] per scored slot
            linear += linear_flops(model.markov_head.markov_w2, lm_rows)
            if model.confidence_head is not None:
                linear += linear_flops(model.confidence_head.proj, lm_rows)
        for layer in model.layers:
            att = layer.self_attn
            linear += linear_flops(att.k_proj, n + blocks) + linear_flops(att.v_proj, n + blocks)
            linear += linear_flops(att.q_proj, blocks) + linear_flops(att.o_proj, blocks)
            linear += linear_flops(layer.mlp, blocks)
        attention = attention_flops(pairs, nh, hd)
        out.update(anchors=A, valid_anchors=int(valid.sum()), block_size=Bk)
    elif method.name == "peagle":
        from draftsmith.models.peagle.training import cod_sample, step0_prediction_mask

        d = recipe.draft
        pred = step0_prediction_mask(loss_mask, docs_cpu)
        elements = cod_sample(pred, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min,
                              torch.Generator().manual_seed(seed), d.max_anchors, docs_cpu, batch.get("cod_seed_bound"))
        S = elements.anchor.shape[1]
        pairs = cod_allowed_pairs(elements, docs_cpu) * cfg.num_layers
        rows0 = batch.get("cod_rows0")
        lm_rows = (int(rows0.numel()) if rows0 is not None else B * T) + B * (S - T)
        teacher_rows = B * (T - 1) if T > 1 else B
        linear = linear_flops(model.fc, n, input_grad=False) + linear_flops(model.lm_head, lm_rows)
        linear += sum(linear_flops(layer, B * S) for layer in model.layers)
        attention = attention_flops(pairs, nh, hd)
        out.update(cod_elements=S, valid_elements=int(elements.valid.sum()))
    else:
        raise ValueError(f"draft.method {method.name!r}: bench_gpu measures {', '.join(METHODS)}")
    teacher = 2.0 * Ht * Vd * teacher_rows
    out.update(linear=linear, attention=attention, teacher=teacher, total=linear + attention + teacher,
               attention_pairs=pairs, lm_head_rows=lm_rows, teacher_rows=teacher_rows)
    return out


# ---------------------------------------------------------------------------------------------
# the device


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_memory(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


KERNEL_CLASSES = (  # (class, substrings of a kernel / op name), first match wins; the rest is elementwise
    ("attention", ("flash", "fmha", "flex", "attention", "attn", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul", "sm90_xmma")),
    ("softmax/loss", ("softmax", "distill_rows", "cross_entropy", "nll_loss", "logsumexp")),
    ("reductions", ("reduce", "argmax", "argmin", "aten::sum", "aten::mean", "norm_kernel", "aten::max", "aten::min")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "muon")),
    ("copy/cast", ("copy", "cast", "aten::to", "aten::cat", "catarray", "index", "gather", "scatter", "clone")),
)


def kernel_class(name: str) -> str:
    """The class of a profiled kernel (CUDA) or op (CPU) by its name (:data:`KERNEL_CLASSES`)."""
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "elementwise"


def profile_steps(step: Callable[[int], Any], steps: int, dev: torch.device, first: int) -> dict[str, Any]:
    """``steps`` more steps under ``torch.profiler``: per step, kernel time (CUDA kernels on a GPU;
    the CPU's aten ops' self time elsewhere) and kernel count by :func:`kernel_class`, and the
    host's total time per step. The table the H200 profile of the landed code was read from."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(dev)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(first + i)
        synchronize(dev)
    host = (time.perf_counter() - t0) / steps
    classes: dict[str, dict[str, float]] = {}
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        else:
            if not e.name.startswith("aten::") or e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
                continue  # top-level aten ops only (their children are counted in them)
            us = e.cpu_time_total
        row = classes.setdefault(kernel_class(e.name), {"ms": 0.0, "kernels": 0})
        row["ms"] += us / 1e3 / steps
        row["kernels"] += 1 / steps
    total = sum(r["ms"] for r in classes.values())
    return {"device_ms_per_step": total, "host_ms_per_step": 1e3 * host,
            "kernels_per_step": sum(r["kernels"] for r in classes.values()),
            "classes": {k: {"ms": v["ms"], "share": v["ms"] / total if total else 0.0, "kernels": v["kernels"]}
                        for k, v in sorted(classes.items(), key=lambda kv: -kv[1]["ms"])},
            "what": "CUDA kernel time" if cuda else "CPU aten op time (top-level ops)"}


def time_steps(step: Callable[[int], Any], steps: int, warmup: int, dev: torch.device, first: int = 0,
               timed: Any = None) -> tuple[float, dict[str, Any]]:
    """Run ``step(i)`` for ``warmup`` untimed then ``steps`` timed steps, numbered from ``first``;
    returns the seconds of the timed run (CUDA events around it, no sync in between) and the CUDA
    memory (peaks over the timed steps; None on other devices) with ``first_step_s``: the wall
    seconds of the first warm-up step, synchronised on both sides (the cold step: torch.compile,
    Triton's JIT; None without warm-up). ``timed``: a context manager entered around the timed
    steps only (:class:`FusedLossCount`)."""
    mem: dict[str, Any] = {"allocated_before": None, "max_allocated": None, "max_reserved": None,
                           "first_step_s": None}
    for i in range(warmup):
        if i == 0:
            synchronize(dev)
            t0 = time.perf_counter()
        step(first + i)
        if i == 0:
            synchronize(dev)
            mem["first_step_s"] = time.perf_counter() - t0
    synchronize(dev)
    with timed if timed is not None else contextlib.nullcontext():
        if dev.type == "cuda":
            mem["allocated_before"] = int(torch.cuda.memory_allocated(dev))
            torch.cuda.reset_peak_memory_stats(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(steps):
                step(first + warmup + i)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
            mem["max_allocated"] = int(torch.cuda.max_memory_allocated(dev))
            mem["max_reserved"] = int(torch.cuda.max_memory_reserved(dev))
            return seconds, mem
        t0 = time.perf_counter()
        for i in range(steps):
            step(first + warmup + i)
        return time.perf_counter() - t0, mem


# ---------------------------------------------------------------------------------------------
# evidence that the fast paths ran (tests/helpers/fast_path.py builds the GPU tests' checks on these)

FUSED_OP = "draftsmith::distill_rows"  # the fused loss's row kernel as one torch op (train/fused_loss.py)


class FusedLossCount:
    """While active, ``launches``: how many times the fused loss's row kernel ran, i.e. the torch op
    ``draftsmith::distill_rows`` was dispatched to its real implementation (CUDA, or CPU tensors
    under Triton's interpreter), counted by wrapping ``fused_loss._launch_kernel``, the function
    that implementation calls. Nothing is added per op (a dispatch mode would add Python to every
    op of a timed step); under ``FakeTensorMode`` the op's fake implementation launches nothing
    and counts 0. Zero launches where the fused loss was asked for means the step took the chunked
    torch path (train/losses.py falls back where the fused loss cannot run, warning once per reason)."""

    def __init__(self) -> None:
        self.launches = 0
        self._module: Any = None
        self._saved: Any = None

    def __enter__(self) -> FusedLossCount:
        from draftsmith.train import fused_loss

        self._module, self._saved = fused_loss, fused_loss._launch_kernel
        launch = self._saved

        def counting(*args: Any, **kwargs: Any) -> Any:
            out = launch(*args, **kwargs)
            self.launches += 1
            return out

        fused_loss._launch_kernel = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module._launch_kernel = self._saved


def compiled_regions(model: nn.Module) -> tuple[int, int]:
    """``(regions, compiled)``: the ``torch.compile``'d callables the modules of ``model`` hold
    (what :func:`~draftsmith.models.common.compile_regions` put there), and how many of them
    torch._dynamo holds compiled code for (at least one cache entry on the wrapped function's code:
    the region was traced and compiled, not run eagerly). The code is shared by the instances of
    a class, so a layer counts as compiled once any layer of its class was."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    seen: set[int] = set()
    regions = compiled = 0
    for module in model.modules():
        for value in vars(module).values():
            orig = getattr(value, "_torchdynamo_orig_callable", None)
            if orig is None or id(value) in seen:
                continue
            seen.add(id(value))
            regions += 1
            code = getattr(orig, "__code__", None) or getattr(getattr(orig, "forward", None), "__code__", None)
            compiled += bool(code is not None and _debug_get_cache_entry_list(code))
    return regions, compiled


def compile_caches() -> dict[str, dict[str, Any]]:
    """The on-disk compile caches a step uses, as they are before it: inductor's
    (``TORCHINDUCTOR_CACHE_DIR``, default ``<tmp>/torchinductor_<user>``; its generated Triton
    kernels under ``triton/`` there unless ``TRITON_CACHE_DIR``) and Triton's own, where the fused
    loss's kernel is cached (``TRITON_CACHE_DIR``, default ``~/.triton/cache``): per cache the
    folder, whether it is the default one (inductor writes its folder into the environment when
    it first resolves it, so the variable's presence says nothing), and whether it already held
    entries (then ``compile_s`` was not a cold compile). Creates nothing."""
    import os

    def describe(env: str, default: Callable[[], str]) -> dict[str, Any]:
        try:
            fallback = default()
        except Exception:  # noqa: BLE001 - no default without the package
            fallback = None
        folder = os.environ.get(env) or fallback
        warm = bool(folder) and os.path.isdir(folder) and any(os.scandir(folder))
        return {"dir": folder, "default": folder == fallback, "had_entries": warm}

    def inductor_default() -> str:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())

    def triton_default() -> str:
        import triton

        return triton.knobs.cache.get_triton_dir("cache")

    return {"inductor": describe("TORCHINDUCTOR_CACHE_DIR", inductor_default),
            "triton": describe("TRITON_CACHE_DIR", triton_default)}


def device_peak_tflops(dev: torch.device, given: float | None) -> tuple[float | None, str]:
    """``(peak, where it came from)``: ``--peak-tflops``, else the table for a CUDA device's name."""
    if given:
        return given, "--peak-tflops"
    if dev.type != "cuda":
        return None, "none on a CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(dev)
    for key, peak in BF16_PEAK_TFLOPS:
        if key in name:
            return peak, f"dense bf16 datasheet figure for {key}"
    return None, f"unknown device {name!r} (give --peak-tflops)"


def environment(dev: torch.device) -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version()}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(device=props.name, device_memory_bytes=int(props.total_memory))
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    return env


# ---------------------------------------------------------------------------------------------
# recipes


def recipe_path(name: str) -> Path:
    """A recipe named under ``recipes/`` (``llama3_1_8b``) or a YAML path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return RECIPES_DIR / f"{name}.yaml"


def load_bench_recipe(name: str, sets: list[str], args: argparse.Namespace) -> tuple[Any, dict[str, Any], str, Any]:
    """``(recipe at the benchmark's B x T, target config.json, its source, launcher report)``.

    Raises:
        ValueError / FileNotFoundError / RecipeError / LauncherError: one line naming the problem.
    """
    from draftsmith.recipe import load_recipe
    from draftsmith.target import check_lengths, load_config_json, validate_geometry
    from draftsmith.train.launchers import draft_model_class, validate_launcher
    from benchmarks.memory import bench_recipe

    recipe = load_recipe(recipe_path(name), sets)
    if recipe.draft.method not in METHODS:
        raise ValueError(f"{name}: draft.method {recipe.draft.method!r}; bench_gpu measures {', '.join(METHODS)}")
    config_json, source = load_config_json(recipe, args.target_config)
    validate_geometry(config_json, source)
    B = args.batch_size or recipe.train.batch_size
    T = args.max_length or recipe.data.max_length
    check_lengths(config_json, [T], source, "--max-length" if args.max_length else "data.max_length")
    launch = None
    if recipe.launcher:
        launch = validate_launcher(recipe, recipe.launcher, draft_model_class(recipe.draft.method))
    return bench_recipe(recipe, B, T), config_json, source, launch


# ---------------------------------------------------------------------------------------------
# one training row


def bench_training(recipe: Any, config_json: dict[str, Any], precision: Any, dev: torch.device, steps: int,
                   warmup: int, count_executed: bool = True, seed: int = 0,
                   rows: list[list[int]] | None = None, length: int | None = None,
                   profile: bool = False) -> dict[str, Any]:
    """Build the recipe's method, draft, optimizer and a random batch on ``dev`` and time
    ``steps`` training steps after ``warmup`` (module docstring). ``rows`` / ``length``: the
    batch's documents per row and its padded length (:func:`benchmarks.lengths.trainer_rows`);
    None: every position real. Returns the row's measurements."""
    from benchmarks.memory import (OneProcess, _device_batch, offline_method, prepare_model, random_batch,
                                   random_weights, trainer_step)
    from torch._dynamo.utils import counters

    from draftsmith.models.common import compile_regions, resolve_compile

    torch.manual_seed(seed)
    cfg = recipe.train
    if cfg.attention_backend == "flex" or resolve_compile(cfg.compile, dev):
        torch._dynamo.reset()  # each row compiles its own kernels (flex, train.compile's regions) for its shapes
    with offline_method(recipe, config_json, getattr(torch, recipe.target.dtype), random_weights) as method:
        H, V = int(method.target_info.hidden_size), int(method.target_info.vocab_size)
        n_aux = len(method.target_info.aux_layer_ids)
        model, trainable, optimizers = prepare_model(method, recipe, precision, dev)
        if resolve_compile(cfg.compile, dev):  # as the trainer does (train.compile; auto: on CUDA)
            compile_regions(model)
        plan = method.batch_plan() if hasattr(method, "batch_plan") else None
        batch = _device_batch(random_batch(recipe, H, V, n_aux, fake=False, seed=seed, rows=rows, length=length),
                              plan, dev, None, fake=False)
        flops = step_flops(method, model, batch, recipe, seed)
        loss_tokens = int(batch["loss_mask"].sum())
        forward_backward, update, window = trainer_step(method, model, batch, trainable, optimizers, cfg, dev)
        graphs_made: list[int] = []

        def step(i: int) -> None:
            forward_backward(i)
            update()
            graphs_made.append(int(counters["stats"]["unique_graphs"]))

        caches = compile_caches()
        graphs_before = int(counters["stats"]["unique_graphs"])
        fused = FusedLossCount()
        seconds, mem = time_steps(step, steps, warmup, dev, timed=fused)
        regions, compiled = compiled_regions(model)
        profiled = profile_steps(step, steps, dev, warmup + steps + 1) if profile else None
        counted = None
        if count_executed and cfg.attention_backend == "sdpa":
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            with counter:  # the model's work only: Muon's Newton-Schulz matmuls are not model FLOPs
                forward_backward(warmup + steps)
            update()
            counted = int(counter.get_total_flops())
        synchronize(dev)
        n_trainable = sum(p.numel() for p in trainable)
        values = {k: float(v) for k, v in window.read(OneProcess(dev))[0].items() if k in ("loss", "grad_norm")}
    return {"seconds": seconds, "memory": mem, "flops": flops, "counted_flops": counted,
            "trainable_parameters": n_trainable, "metrics": values, "profile": profiled,
            "loss_tokens": loss_tokens, "fused_loss_launches": fused.launches, "compiled_regions": compiled,
            "compile_regions": regions, "compiled_graphs": graphs_made[warmup + steps - 1] - graphs_before,
            "graphs_after_first_step": graphs_made[warmup + steps - 1] - graphs_made[0], "compile_caches": caches}


def fake_reference(recipe: Any, config_json: dict[str, Any], launch: Any, precision: Any) -> dict[str, Any]:
    """``draftsmith bench memory``'s FakeTensorMode measurement of the same step (SDPA)."""
    from benchmarks.memory import measure_step

    r = recipe.model_copy(deep=True)
    r.train.attention_backend = "sdpa"
    m = measure_step(r, config_json, launch, precision, device="fake")
    return {"process_peak": m.process_peak_bytes, "per_gpu": m.per_gpu_bytes, "per_gpu_phase": m.per_gpu_phase}


def training_row(name: str, recipe: Any, source: str, launch: Any, precision: Any, backend: str,
                 config_json: dict[str, Any], args: argparse.Namespace, dev: torch.device,
                 peak: float | None, fake: dict[str, Any] | None,
                 lengths: list[int] | None = None) -> dict[str, Any]:
    """One table row: the measurement of ``recipe`` with ``backend`` on one batch of ``lengths``
    as the trainer batches them (None: every position real), or its error."""
    from benchmarks.lengths import describe, row_length, trainer_rows
    from draftsmith.models.common import resolve_attention_backend

    r = recipe.model_copy(deep=True)
    r.train.attention_backend = backend
    B, T = r.train.batch_size, r.data.max_length
    docs = None
    if lengths is not None:
        docs = trainer_rows(lengths, B, T, r.train.packing, r.train.pack_tokens, r.seed)
        T = row_length(docs, T, r.train.packing, r.train.pack_tokens,
                       bucketed=resolve_attention_backend(backend, dev) == "flex")
    shape = describe(docs, B, T)
    row: dict[str, Any] = {
        "recipe": name, "method": r.draft.method, "target": r.target.name_or_path, "target_config": source,
        "launcher": None if launch is None else str(launch.path), "precision": precision.name,
        "attention_backend": backend, "batch_size": B, "max_length": T, "steps": args.steps, "warmup": args.warmup,
        "lengths": args.lengths, "packing": bool(r.train.packing), **shape, "error": None,
    }
    print(f"  {name} ({r.draft.method}, {backend}, {B} x {T}) ...", file=sys.stderr, flush=True)
    try:
        m = bench_training(r, config_json, precision, dev, args.steps, args.warmup, not args.no_flop_count,
                           rows=docs, length=T, profile=getattr(args, "profile", False))
    except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run (one booked GPU)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"    failed: {row['error']}", file=sys.stderr, flush=True)
        free_memory(dev)
        return row
    free_memory(dev)
    per_step = m["seconds"] / args.steps
    flop = m["flops"]["total"]
    tflops = flop / per_step / 1e12
    mem = m["memory"]
    row.update(
        ms_per_step=1e3 * per_step, positions_per_s=B * T / per_step,
        useful_tokens_per_s=shape["useful_tokens"] / per_step,
        tflop_per_step=flop / 1e12, tflops=tflops, mfu=tflops / peak if peak else None,
        flops={k: v for k, v in m["flops"].items()},
        counted_tflop_per_step=None if m["counted_flops"] is None else m["counted_flops"] / 1e12,
        trainable_parameters=m["trainable_parameters"], final_metrics=m["metrics"],
        cuda_allocated_before_steps=mem["allocated_before"], cuda_max_allocated=mem["max_allocated"],
        cuda_max_reserved=mem["max_reserved"],
        fake_process_peak=None if fake is None else fake["process_peak"],
        fake_per_gpu=None if fake is None else fake["per_gpu"],
        profile=m["profile"],
        loss_tokens=m["loss_tokens"], loss_tokens_per_s=m["loss_tokens"] / per_step,
        fused_loss=r.train.fused_loss, fused_loss_ran=m["fused_loss_launches"] > 0,
        fused_loss_launches_per_step=m["fused_loss_launches"] / args.steps,
        compiled_regions=m["compiled_regions"], compile_regions=m["compile_regions"],
        compiled_graphs=m["compiled_graphs"], graphs_after_first_step=m["graphs_after_first_step"],
        first_step_s=mem["first_step_s"],
        compile_s=None if mem["first_step_s"] is None else max(0.0, mem["first_step_s"] - per_step),
        compile_caches=m["compile_caches"],
    )
    if fake is not None and mem["max_allocated"] is not None:
        row["cuda_vs_fake"] = mem["max_allocated"] / fake["process_peak"]
        row["per_gpu"] = mem["max_allocated"] - fake["process_peak"] + fake["per_gpu"]
    else:
        row["cuda_vs_fake"] = row["per_gpu"] = None
    print(f"    {row['useful_tokens_per_s']:,.0f} useful tok/s ({row['positions_per_s']:,.0f} positions/s), "
          f"{row['ms_per_step']:.1f} ms/step", file=sys.stderr, flush=True)
    return row


# ---------------------------------------------------------------------------------------------
# capture (the target forward)


def target_config(config_json: dict[str, Any], trust_remote_code: bool = False) -> Any:
    """The ``transformers`` config of a ``config.json``'s contents."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-gpu-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_json))
        return AutoConfig.from_pretrained(tmp, trust_remote_code=trust_remote_code)


def build_target(config: Any, dtype: torch.dtype, dev: torch.device | str) -> nn.Module:
    """A random-init causal LM of ``config``, created directly on ``dev`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def linear_params(module: nn.Module) -> int:
    """Weights of every ``nn.Linear`` inside ``module`` (the matmul parameters)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def capture_rows(recipe: Any, config_json: dict[str, Any], args: argparse.Namespace, dev: torch.device,
                 peak: float | None) -> dict[str, Any]:
    """The target's plain forward, decoder-only forward and hidden-state capture at the recipe's
    ``B x T`` (module docstring), or why they were skipped."""
    from draftsmith.target.capture import capture_batch
    from draftsmith.target import aux_layer_ids, text_config

    B, T = recipe.train.batch_size, recipe.data.max_length
    dtype = getattr(torch, recipe.target.dtype)
    out: dict[str, Any] = {"target": recipe.target.name_or_path, "batch_size": B, "max_length": T,
                           "dtype": recipe.target.dtype, "rows": [], "skipped": None}
    try:
        config = target_config(config_json, recipe.target.trust_remote_code)
        text = text_config(config)
        meta = build_target(config, dtype, "meta")  # the parameter count without memory
        n_params = sum(p.numel() for p in meta.parameters())
        weights = n_params * torch.finfo(dtype).bits // 8
        del meta
        room = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _host_memory()
        out.update(target_params=n_params, target_weight_bytes=weights)
        if weights > 0.6 * room:
            out["skipped"] = (f"random {recipe.target.dtype} weights {weights / GiB:.0f} GiB do not fit "
                              f"{room / GiB:.0f} GiB")
            return out
        moe = any(getattr(text, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        aux_ids = aux_layer_ids(recipe.data.aux_layer_ids, int(text.num_hidden_layers))
        target = build_target(config, dtype, dev)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(text.vocab_size), (B, T), generator=g).to(dev)
        att = torch.ones_like(ids)
        decoder = target.get_decoder()
        width = int(text.num_attention_heads) * int(getattr(text, "head_dim", None) or
                                                    text.hidden_size // text.num_attention_heads)
        fwd = 2.0 * linear_params(decoder) * B * T + int(text.num_hidden_layers) * B * 4.0 * width * T * (T + 1) / 2
        lm = 2.0 * target.get_output_embeddings().weight.numel() * B * T

        def plain(i: int) -> None:
            with torch.no_grad():
                target(input_ids=ids, attention_mask=att, use_cache=False)

        def decoder_only(i: int) -> None:
            with torch.no_grad():
                decoder(input_ids=ids, attention_mask=att, use_cache=False)

        def capture(i: int) -> None:
            capture_batch(target, ids, att, aux_ids)

        for name, fn, flop in (("target plain forward (logits)", plain, fwd + lm),
                               ("target decoder only (no lm_head)", decoder_only, fwd),
                               (f"capture aux {tuple(aux_ids)} + final", capture, fwd)):
            seconds, mem = time_steps(fn, args.steps, args.warmup, dev)
            per_step = seconds / args.steps
            tflops = None if moe else flop / per_step / 1e12
            out["rows"].append({"name": name, "ms_per_step": 1e3 * per_step, "tokens_per_s": B * T / per_step,
                                "tflop_per_step": None if moe else flop / 1e12, "tflops": tflops,
                                "mfu": tflops / peak if peak and tflops else None,
                                "cuda_max_allocated": mem["max_allocated"], "cuda_max_reserved": mem["max_reserved"]})
            print(f"  capture {out['target']}: {name}: {B * T / per_step:,.0f} tok/s", file=sys.stderr, flush=True)
        del target, decoder
    except Exception as exc:  # noqa: BLE001 - recorded; the training rows still run
        out["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    free_memory(dev)
    rows = out["rows"]
    if len(rows) == 3:
        out["capture_vs_plain_forward"] = rows[2]["tokens_per_s"] / rows[0]["tokens_per_s"]
        out["capture_vs_decoder_only"] = rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"]
    return out


def _host_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


# ---------------------------------------------------------------------------------------------
# the command


def setup_device(name: str) -> torch.device:
    """The benchmark's device: on CUDA with its index resolved, made current and given the
    trainer's defaults (TF32 for fp32 matmuls, :func:`~draftsmith.train.distributed.gpu_defaults`)."""
    dev = torch.device(name)
    if dev.type == "cuda":
        from draftsmith.train.distributed import gpu_defaults

        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        gpu_defaults()
    return dev


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every requested recipe and backend; returns what ``--out`` stores."""
    from benchmarks.lengths import lengths_for
    from benchmarks.memory import Precision

    dev = setup_device(args.device)
    peak, peak_source = device_peak_tflops(dev, args.peak_tflops)
    backends = args.backends or (list(BACKENDS) if dev.type == "cuda" else ["sdpa"])
    result: dict[str, Any] = {
        "environment": environment(dev),
        "settings": {"device": str(dev), "steps": args.steps, "warmup": args.warmup, "backends": backends,
                     "peak_tflops": peak, "peak_source": peak_source, "sets": list(args.set or []),
                     "batch_size": args.batch_size, "max_length": args.max_length, "lengths": args.lengths},
        "rows": [], "capture": [],
    }
    captured: set[str] = set()
    for name in args.recipes:
        try:
            recipe, config_json, source, launch = load_bench_recipe(name, list(args.set or []), args)
            precision = Precision.of(launch, args.precision)
        except Exception as exc:  # noqa: BLE001 - a bad recipe is a row with its error
            result["rows"].append({"recipe": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {name}: {exc}", file=sys.stderr, flush=True)
            continue
        if not args.no_capture and recipe.target.name_or_path not in captured:
            captured.add(recipe.target.name_or_path)
            result["capture"].append(capture_rows(recipe, config_json, args, dev, peak))
        fake = None
        if not args.no_fake:
            try:
                fake = fake_reference(recipe, config_json, launch, precision)
            except Exception as exc:  # noqa: BLE001 - the real rows do not need it
                print(f"  {name}: no fake reference ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        try:
            lengths = lengths_for(args.lengths, recipe.data.max_length, recipe.seed)
        except FileNotFoundError as exc:
            result["rows"].append({"recipe": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {name}: {exc}", file=sys.stderr, flush=True)
            continue
        for backend in backends:
            result["rows"].append(training_row(recipe_path(name).stem, recipe, source, launch, precision, backend,
                                               config_json, args, dev, peak, fake, lengths))
    return result


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def _fused(r: dict[str, Any]) -> str:
    if r["fused_loss_ran"]:
        return f"yes ({r['fused_loss_launches_per_step']:g}/step)"
    return f"no ({r['fused_loss']})"


def format_table(result: dict[str, Any]) -> str:
    env, s = result["environment"], result["settings"]
    mem = f" ({env['device_memory_bytes'] / GiB:.1f} GiB)" if "device_memory_bytes" in env else ""
    peak = f"MFU vs {s['peak_tflops']:g} TFLOP/s bf16 ({s['peak_source']})" if s["peak_tflops"] else \
        f"no MFU: {s['peak_source']}"
    lines = [f"torch {env['torch']}, CUDA {env['cuda']}, transformers {env['transformers']}; device {env['device']}{mem}",
             f"{s['steps']} timed steps after {s['warmup']} warm-up; {peak}", "",
             f"lengths: {s['lengths']} (useful = real, non-padding tokens of the batch timed)", "",
             "| recipe | method | attention | B x T | docs | useful | precision | ms/step | useful tok/s | positions/s "
             "| TFLOP/step | TFLOP/s | MFU | max alloc GiB | max reserved GiB | fake GiB | alloc/fake | per GPU GiB "
             "| fused loss | compiled regions | compile s |",
             "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        if r.get("error"):
            lines.append(f"| {r['recipe']} | {r.get('method', '-')} | {r.get('attention_backend', '-')} | "
                         f"{r.get('batch_size', '-')} x {r.get('max_length', '-')} | {r.get('precision', '-')} | "
                         f"error: {r['error']} ||||||||||||||||")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = f"{r['cuda_vs_fake']:.2f}" if r["cuda_vs_fake"] is not None else "-"
        lines.append(f"| {r['recipe']} | {r['method']} | {r['attention_backend']} | {r['batch_size']} x {r['max_length']} "
                     f"| {r['documents']} | {100 * r['useful_fraction']:.0f}% "
                     f"| {r['precision']} | {r['ms_per_step']:.1f} | {r['useful_tokens_per_s']:,.0f} "
                     f"| {r['positions_per_s']:,.0f} | {r['tflop_per_step']:.3g} "
                     f"| {r['tflops']:.3g} | {mfu} | {_gib(r['cuda_max_allocated'])} | {_gib(r['cuda_max_reserved'])} "
                     f"| {_gib(r['fake_process_peak'])} | {ratio} | {_gib(r['per_gpu'])} "
                     f"| {_fused(r)} | {r['compiled_regions']}/{r['compile_regions']} "
                     f"| {'-' if r['compile_s'] is None else format(r['compile_s'], '.1f')} |")
    lines += ["", "TFLOP/step credited: the draft's matmuls and attention at its masked work, the teacher head; no "
              "recomputation (module docstring). fake = bench memory's FakeTensorMode peak of the same step (SDPA, "
              "one process); per GPU = max alloc with the launcher's sharding of the trainable state applied. "
              "fused loss: whether draftsmith::distill_rows ran in the timed steps (launches per step); compiled "
              "regions: train.compile's regions dynamo compiled / regions wrapped; compile s: the first warm-up "
              "step's seconds beyond a timed step's (caches in the JSON's compile_caches)."]
    for r in result["rows"]:
        prof = r.get("profile")
        if not prof:
            continue
        lines += ["", f"profile of {r['recipe']} ({r['attention_backend']}): {prof['what']} "
                  f"{prof['device_ms_per_step']:.1f} ms/step over {prof['kernels_per_step']:,.0f} kernels, "
                  f"host {prof['host_ms_per_step']:.1f} ms/step",
                  "| class | ms/step | share | kernels/step |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['ms']:.1f} | {100 * v['share']:.1f}% | {v['kernels']:,.0f} |"
                  for k, v in prof["classes"].items()]
    for c in result["capture"]:
        lines += ["", f"capture, target {c['target']} ({c['dtype']}, {c['batch_size']} x {c['max_length']}, "
                  f"{c.get('target_params', 0) / 1e9:.2f}B parameters)"
                  + (f": skipped, {c['skipped']}" if c["skipped"] else "")]
        if c["rows"]:
            lines += ["| measurement | tok/s | ms/step | TFLOP/step | TFLOP/s | MFU | max alloc GiB |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for r in c["rows"]:
                mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
                tf = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
                lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                             f"{tf(r['tflop_per_step'])} | {tf(r['tflops'])} | {mfu} | {_gib(r['cuda_max_allocated'])} |")
        if "capture_vs_plain_forward" in c:
            lines.append(f"capture / plain forward: {c['capture_vs_plain_forward']:.2f}x tok/s; capture / decoder "
                         f"only: {c['capture_vs_decoder_only']:.2f}x")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks/gpu.py``."""
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--recipes", nargs="+", metavar="RECIPE",
                   help=f"recipe names under recipes/ or YAML paths (default: {' '.join(DEFAULT_RECIPES)}; "
                        f"--tiny: {' '.join(TINY_RECIPES)})")
    p.add_argument("--tiny", action="store_true",
                   help=f"the SmolLM2-135M recipes at {TINY_BATCH} x {TINY_LENGTH} (a CPU check of the whole path; "
                        "--recipes / --batch-size / --max-length still win)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="recipe override applied to every recipe (repeatable), e.g. draft.ttt_steps=3")
    p.add_argument("--batch-size", type=int, help="micro-batch B (default: each recipe's train.batch_size)")
    p.add_argument("--max-length", type=int, help="sequence length T (default: each recipe's data.max_length)")
    p.add_argument("--target-config", type=Path,
                   help="the target's config.json for every recipe (default: the copy under recipes/targets/)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS,
                   help="train.attention_backend values to measure (default: sdpa flex on CUDA, sdpa on a CPU: "
                        "torch has no flex backward on a CPU)")
    p.add_argument("--lengths", default="default", metavar="default|full|RUN_DIR",
                   help="sequence lengths of the batch timed (benchmarks/lengths.py): default: a log-normal stand-in "
                        "for regenerated chat conversations at each recipe's data.max_length; RUN_DIR: that run's "
                        "prepared data; full: every position real (no padding, no packing boundaries beyond two "
                        "documents per packed row). The batch is the trainer's (packed rows under train.packing, "
                        "length-grouped otherwise) with the median useful fraction")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--precision", choices=["auto", "fp32", "amp-bf16", "bf16"], default="auto",
                   help="auto: the launcher's (bf16 autocast; bf16 weights under DeepSpeed; fp32 without one)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (flex compiles here)")
    p.add_argument("--peak-tflops", type=float,
                   help="dense bf16 peak for MFU (default: from the CUDA device's name; none on a CPU)")
    p.add_argument("--no-capture", action="store_true", help="skip the target forward / capture rows")
    p.add_argument("--no-fake", action="store_true",
                   help="skip bench memory's FakeTensorMode reference (about 10 s per GPU recipe)")
    p.add_argument("--no-flop-count", action="store_true",
                   help="skip torch's FLOP counter over one extra SDPA step (counted_tflop_per_step)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, --steps more under torch.profiler: kernel time and count per step by "
                        "class (gemm, attention, copy/cast, elementwise, softmax/loss, reductions, optimizer) and the "
                        "host's time per step (CUDA kernels on a GPU; aten op time on a CPU)")
    p.add_argument("--out", type=Path, help="write the results as one JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.recipes is None:
        args.recipes = list(TINY_RECIPES if args.tiny else DEFAULT_RECIPES)
    if args.tiny:
        args.batch_size = args.batch_size or TINY_BATCH
        args.max_length = args.max_length or TINY_LENGTH
    for key in ("batch_size", "max_length", "steps"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU run `--tiny --device cpu --steps 1 --warmup 0`", file=sys.stderr)
        return 2
    if not args.device.startswith("cuda") and args.backends and "flex" in args.backends:
        p.error("--backends flex needs CUDA: torch has no flex_attention backward on a CPU")
    result = run(args)
    print(format_table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 1 if any(r.get("error") for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
