"""``draftsmith bench step``: the GPU efficiency of a recipe's training step, counted on any CPU.

    draftsmith bench step RECIPE.yaml [--attention sdpa|flex] [--set KEY=VALUE ...]
        [--target-config config.json] [--batch-size B] [--max-length T] [--launcher L.yaml]
        [--precision P] [--as-measured] [--json]
    draftsmith bench step --calibrate [--json]      refit the constants against the H200 profile below
    draftsmith bench step --leave-one-out [--json]  fit on all profiles but one, score the one left out
    draftsmith bench step --predictions [--json]    the predictions frozen in docs/bench_step.md

The recipe's REAL training step (the trainer's: ``compute_loss``, ``backward``, gradient clipping,
the non-finite guard, the optimizer step and ``zero_grad``; :func:`benchmarks.memory.trainer_step`)
runs at its full geometry (``train.batch_size`` x ``data.max_length``, the target's true dims
from ``recipes/targets/**/config.json``) under ``FakeTensorMode``: shapes, dtypes and strides, no
data and no compute, as ``draftsmith bench memory`` runs it (same builders: the draft at random
weights, the launcher's precision, CUDA's autocast and grouped key/value choices). Two steps run;
the second is counted. A ``TorchDispatchMode`` sees every aten op the step dispatches and keeps,
per op:

- **ops**: one per dispatched aten op that launches a kernel. Pure views / metadata ops are not
  counted (every op whose schema returns an alias it does not write: view, expand, permute,
  transpose, t, slice, select, unsqueeze, squeeze, as_strided, detach, alias, split, chunk,
  unbind, ...; in-place view ops; ``_unsafe_view``, ``empty*``, ``lift_fresh``, ``resize_``,
  ``set_``). **launches** (the estimate's kernel launches) equal ops except: the attention
  backward (cuDNN 3 kernels, flex 2), the out-of-place ``*_backward`` / ``index_add`` ops that
  fill before they copy (2), and the foreach / fused optimizer ops (multi_tensor_apply: one
  launch per 320 chunks of 65536 elements, ``_foreach_norm`` one more).
- **FLOPs** of the matmuls: ``torch.utils.flop_counter``'s formulas for mm, addmm, bmm, baddbmm,
  convolution and the SDPA / flash / efficient / cuDNN attention forward (``4 b h Tq Tk d``) and
  backward (2.5 times that, the recomputed scores included). SDPA is counted over the dense area
  its kernel computes, the masked-out part of the concatenated TTT keys included. flex_attention
  is counted at the fraction of (query tile, key tile) pairs its ``BlockMask`` leaves unmasked
  (fully masked tiles are skipped; partial ones are computed whole).
- **bytes**: the input tensors' bytes plus the output tensors' bytes of each op, a tensor counted
  at its own element count (a view at the view's numel; a broadcast dimension, stride 0, once) times
  its element size. Three rules keep that close to the traffic: a ``copy_`` / ``fill_`` /
  ``zero_`` does not read its destination; a gather (``embedding``, ``index_select``, ``index``,
  ``gather``) reads from its source only the elements it returns; an in-place scatter
  (``index_put_``, ``index_add_``, ``scatter_``, ...) writes only its values / source elements.
  ``nonmatmul_gb`` sums every op but the gemms and attention kernels.

On the GPU the step runs these ops as its kernels; the CPU run reproduces the CUDA path where
the two differ: ``F.scaled_dot_product_attention`` is sent to the kernel CUDA selects (cuDNN
attention for bf16 / fp16 with head dims up to 256 on an H100 / H200, as torch >= 2.9 prefers it
there; the memory-efficient kernel for fp32), with the bool mask turned into the additive bias
CUDA builds; gradient clipping takes the foreach path CUDA takes (fake tensors would send it per
tensor); flex_attention runs its higher-order op unfused under the fake tensors (on a GPU it is
``torch.compile``d: its forward is one generated kernel, its backward two, and it is counted so).
The loss takes ``train.fused_loss`` as the trainer sets it (the fused Triton kernel is one op,
``draftsmith::distill_rows``). ``train.compile``'s decoder-layer regions cannot compile under
fake tensors: they are counted by their eager aten ops, an upper bound, and the output says so
(``compiled_regions``). Every other op runs eagerly on a GPU too and is counted by its aten op.

**Roofline.** Each op's time on a GPU is ``max(FLOPs / (peak * eff), bytes / (HBM * mem_eff)) +
launches * launch_us``, summed over the step; peak by dtype: 989 TFLOP/s dense bf16 / fp16 on
both GPUs, fp32 matmuls at the TF32 rate 494.7 TFLOP/s (the trainer turns TF32 on for CUDA),
fp32 attention at the CUDA-core fp32 rate 66.9 TFLOP/s; HBM 3.35 TB/s (H100 SXM) and 4.8 TB/s
(H200); ``eff`` per kernel class (gemm, SDPA attention, flex attention) and ``mem_eff`` for
the bytes. :data:`FITTED` holds them: ``mem_eff`` = 0.8 is assumed (streaming kernels reach about
80% of the datasheet bandwidth; the profile cannot tell it from the launch cost), the other four
are fitted to the per-class kernel times of a torch.profiler run of recipes/gptoss120b.yaml on one
H200 with each backend (:data:`H200_PROFILE`; ``--calibrate`` refits them on the counts of the
measured steps, :data:`MEASURED_COUNTS`, and recounts today's code beside them): ``launch_us`` by
least squares so that the non-matmul ops of both runs take the profile's time outside gemm and
attention kernels, then ``gemm_eff`` / ``sdpa_eff`` / ``flex_eff`` so that those classes match.
Four constants from four numbers of one recipe: a fit. ``--leave-one-out`` fits on every profile
but one (recipe or profile held out) and scores the one left out by class, which is what the
model predicts (docs/bench_step.md). The table :data:`H200_MEASURED` holds the wall step times
measured on the H200 (torch 2.11, ``benchmarks.gpu``); a recipe found there at its own ``B x T``
prints its measurement beside the estimate when the counted step is the one measured
(``--as-measured``: :data:`MEASURED_STEP`, the chunked loss, eager layers, unpacked rows, no
sliding window, for the keys the recipe has).
Host-side time is not modelled: the H200 step of gptoss120b was GPU-bound.

The exit code is 0; 1 on a bad target config / length / launcher; 2 on a bad recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from draftsmith.hardware import GPUS, H200, Gpu
from benchmarks.memory import (MemoryTracker, Precision, _device_batch, bench_recipe, cuda_attention_policy,
                               cuda_autocast_policy, offline_method, prepare_model, random_batch, trainer_step)

aten = torch.ops.aten
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
TOP = 15  # top_ops: the ops listed by count and by bytes

# ---------------------------------------------------------------------------------------------
# the GPUs and the fitted constants


# the GPUs' datasheet figures: draftsmith.hardware (shared with draftsmith plan --roofline)


@dataclass(frozen=True)
class Constants:
    """The constants of the roofline (module docstring): four fitted, ``mem_eff`` assumed."""

    launch_us: float  # per kernel launch: the floor of a small kernel plus the gap between kernels
    mem_eff: float  # fraction of the HBM bandwidth memory-bound kernels reach (assumed, not fitted)
    gemm_eff: float  # fraction of the matmul peak the gemms reach
    sdpa_eff: float  # ... the SDPA attention kernels (cuDNN / memory-efficient) over their dense area
    flex_eff: float  # ... the compiled flex_attention kernels over their unmasked tiles


# from `python -m benchmarks.step --calibrate` (docs/bench_step.md, "Calibration")
FITTED = Constants(launch_us=7.76, mem_eff=0.8, gemm_eff=0.781, sdpa_eff=0.274, flex_eff=0.103)

# H200, torch 2.11, benchmarks.gpu: random weights, every position real, the recipe's B x T.
# (recipe name, attention, B, T) -> ms per step (wall, CUDA events over 10 steps)
H200_MEASURED: dict[tuple[str, str, int, int], float] = {
    ("gptoss120b", "sdpa", 2, 4096): 466.0, ("gptoss120b", "flex", 2, 4096): 310.0,
    ("llama3_1_8b", "sdpa", 4, 2048): 516.9, ("llama3_1_8b", "flex", 4, 2048): 448.6,
    ("gptoss120b_dflash", "sdpa", 2, 4096): 461.3, ("gptoss120b_peagle", "sdpa", 2, 4096): 360.3,
    ("llama3_1_8b_dspark", "sdpa", 4, 2048): 563.8,
}
# torch.profiler CUDA kernel time per step on the H200 by kernel class (ms)
H200_PROFILE: dict[tuple[str, str, int, int], dict[str, float]] = {
    ("gptoss120b", "sdpa", 2, 4096): {"total": 462.6, "attention": 198.9, "gemm": 89.9, "copy/cast": 60.5,
                                      "elementwise": 51.9, "softmax/loss": 32.2, "reductions": 21.3},
    ("gptoss120b", "flex", 2, 4096): {"total": 341.8, "attention": 80.8, "gemm": 90.3, "copy/cast": 61.2,
                                      "elementwise": 51.9, "softmax/loss": 32.2, "reductions": 20.9},
    ("llama3_1_8b", "sdpa", 4, 2048): {"total": 544.4, "attention": 88.7, "gemm": 190.4, "copy/cast": 94.2,
                                       "elementwise": 73.1, "softmax/loss": 32.5, "reductions": 24.8},
}
H200_LAUNCHES = {("gptoss120b", "sdpa", 2, 4096): 6084}  # kernels per step in the same profile
CALIBRATION = ("gptoss120b", 2, 4096)  # the recipe the constants are fitted on (both backends)
# The step the H200 figures above were measured on, as recipe settings: what the code and the GPU
# recipes gained after the measurement turned back off (the fused loss and compiled layers, code
# defaults; train.packing, in the GPU recipes since bbfed92, off in the measured step;
# draft.sliding_window: 2048, in the GPU recipes since 173801a). A key the recipe lacks is skipped.
MEASURED_STEP: dict[str, Any] = {"train.fused_loss": False, "train.compile": False, "train.packing": False,
                                 "draft.sliding_window": None}
MEASURED_SETS = tuple(f"{k}={'null' if v is None else str(v).lower()}" for k, v in MEASURED_STEP.items())

CLASSES = ("gemm", "attention", "copy/cast", "elementwise", "softmax/loss", "reductions", "optimizer", "other")
MATMUL_CLASSES = ("gemm", "attention")

# The measured steps of H200_PROFILE as counted by the code the constants were fitted on (2abbd50's count of
# the step --as-measured builds; the same constants as ca934e7's refit), reduced to what the roofline reads:
# per class outside gemm and attention (ops, launches, bytes), whose time is linear in them, and every gemm /
# attention op group (class, backend, peak, FLOPs, bytes, launches, count). --calibrate and --leave-one-out fit
# on these, so a later change to the counted code cannot move the constants unseen; --calibrate recounts
# today's code beside them and prints the difference (reduce_count).
MEASURED_COUNTS: dict[tuple[str, str, int, int], dict[str, Any]] = {
    ('gptoss120b', 'sdpa', 2, 4096): {
        "other_classes": {"copy/cast": (1079, 1170, 101578775514), "elementwise": (2753, 2753, 269224580532), "softmax/loss": (280, 280, 80641792000), "reductions": (709, 709, 54822753360), "optimizer": (13, 38, 4030963626)},
        "matmul": (
            ('gemm', '', 'bf16', 1509212160000, 755514880, 1, 1),
            ('gemm', '', 'bf16', 407686348800, 238510080, 1, 2),
            ('gemm', '', 'bf16', 386547056640, 208666624, 1, 21),
            ('gemm', '', 'bf16', 193273528320, 137887744, 1, 21),
            ('gemm', '', 'bf16', 193167360000, 257428480, 1, 196),
            ('gemm', '', 'bf16', 157040640000, 243755520, 1, 4),
            ('gemm', '', 'bf16', 156672000000, 243616000, 1, 4),
            ('gemm', '', 'bf16', 156303360000, 243476480, 1, 4),
            ('gemm', '', 'bf16', 155934720000, 243336960, 1, 4),
            ('gemm', '', 'bf16', 155566080000, 243197440, 1, 4),
            ('gemm', '', 'bf16', 155197440000, 243057920, 1, 4),
            ('gemm', '', 'bf16', 154828800000, 242918400, 1, 4),
            ('gemm', '', 'bf16', 135895449600, 110960640, 1, 63),
            ('gemm', '', 'bf16', 48318382080, 108658688, 1, 42),
            ('attention', 'sdpa', 'bf16', 9620726743040, 2384461840, 3, 1),
            ('attention', 'sdpa', 'bf16', 8246337208320, 2082471952, 3, 1),
            ('attention', 'sdpa', 'bf16', 6871947673600, 1780482064, 3, 1),
            ('attention', 'sdpa', 'bf16', 5497558138880, 1478492176, 3, 1),
            ('attention', 'sdpa', 'bf16', 4123168604160, 1176502288, 3, 1),
            ('attention', 'sdpa', 'bf16', 3848290697216, 1310720016, 1, 1),
            ('attention', 'sdpa', 'bf16', 3298534883328, 1142947856, 1, 1),
            ('attention', 'sdpa', 'bf16', 2748779069440, 874512400, 3, 1),
            ('attention', 'sdpa', 'bf16', 2748779069440, 975175696, 1, 1),
            ('attention', 'sdpa', 'bf16', 2199023255552, 807403536, 1, 1),
            ('attention', 'sdpa', 'bf16', 1649267441664, 639631376, 1, 1),
            ('attention', 'sdpa', 'bf16', 1374389534720, 572522512, 3, 1),
            ('attention', 'sdpa', 'bf16', 1099511627776, 471859216, 1, 1),
            ('attention', 'sdpa', 'bf16', 549755813888, 304087056, 1, 1),
        ),
    },
    ('gptoss120b', 'flex', 2, 4096): {
        "other_classes": {"copy/cast": (1182, 1273, 98024731634), "elementwise": (2975, 2975, 271548402674), "softmax/loss": (280, 280, 80641792000), "reductions": (758, 758, 51067198032), "optimizer": (13, 38, 4030963626)},
        "matmul": (
            ('gemm', '', 'bf16', 1509212160000, 755514880, 1, 1),
            ('gemm', '', 'bf16', 407686348800, 238510080, 1, 2),
            ('gemm', '', 'bf16', 386547056640, 208666624, 1, 21),
            ('gemm', '', 'bf16', 193273528320, 137887744, 1, 21),
            ('gemm', '', 'bf16', 193167360000, 257428480, 1, 196),
            ('gemm', '', 'bf16', 157040640000, 243755520, 1, 4),
            ('gemm', '', 'bf16', 156672000000, 243616000, 1, 4),
            ('gemm', '', 'bf16', 156303360000, 243476480, 1, 4),
            ('gemm', '', 'bf16', 155934720000, 243336960, 1, 4),
            ('gemm', '', 'bf16', 155566080000, 243197440, 1, 4),
            ('gemm', '', 'bf16', 155197440000, 243057920, 1, 4),
            ('gemm', '', 'bf16', 154828800000, 242918400, 1, 4),
            ('gemm', '', 'bf16', 135895449600, 110960640, 1, 63),
            ('gemm', '', 'bf16', 48318382080, 108658688, 1, 42),
            ('attention', 'flex', 'bf16', 966367641600, 505530368, 2, 1),
            ('attention', 'flex', 'bf16', 923417968640, 471959296, 2, 1),
            ('attention', 'flex', 'bf16', 880468295679, 438388224, 2, 1),
            ('attention', 'flex', 'bf16', 837518622720, 404817152, 2, 1),
            ('attention', 'flex', 'bf16', 794568949760, 371246080, 2, 1),
            ('attention', 'flex', 'bf16', 751619276800, 337675008, 2, 1),
            ('attention', 'flex', 'bf16', 708669603840, 304103936, 2, 1),
            ('attention', 'flex', 'bf16', 386547056640, 255969280, 1, 1),
            ('attention', 'flex', 'bf16', 369367187456, 239175424, 1, 1),
            ('attention', 'flex', 'bf16', 352187318272, 222381568, 1, 1),
            ('attention', 'flex', 'bf16', 335007449088, 205587712, 1, 1),
            ('attention', 'flex', 'bf16', 317827579904, 188793856, 1, 1),
            ('attention', 'flex', 'bf16', 300647710720, 172000000, 1, 1),
            ('attention', 'flex', 'bf16', 283467841536, 155206144, 1, 1),
        ),
    },
    ('llama3_1_8b', 'sdpa', 4, 2048): {
        "other_classes": {"copy/cast": (1018, 1109, 181270783522), "elementwise": (2753, 2753, 373174846938), "softmax/loss": (280, 280, 80543232000), "reductions": (709, 709, 59901476716), "optimizer": (13, 74, 18686345670)},
        "matmul": (
            ('gemm', '', 'bf16', 2145386496000, 852963328, 1, 1),
            ('gemm', '', 'bf16', 962072674304, 419430400, 1, 63),
            ('gemm', '', 'bf16', 824633720832, 369098752, 1, 2),
            ('gemm', '', 'bf16', 549755813888, 268435456, 1, 21),
            ('gemm', '', 'bf16', 274877906944, 167772160, 1, 21),
            ('gemm', '', 'bf16', 274726912000, 337801216, 1, 196),
            ('gemm', '', 'bf16', 222298112000, 323362816, 1, 4),
            ('gemm', '', 'bf16', 221249536000, 323074048, 1, 4),
            ('gemm', '', 'bf16', 220200960000, 322785280, 1, 4),
            ('gemm', '', 'bf16', 219152384000, 322496512, 1, 4),
            ('gemm', '', 'bf16', 218103808000, 322207744, 1, 4),
            ('gemm', '', 'bf16', 217055232000, 321918976, 1, 4),
            ('gemm', '', 'bf16', 216006656000, 321630208, 1, 4),
            ('gemm', '', 'bf16', 137438953472, 167772160, 1, 42),
            ('attention', 'sdpa', 'bf16', 4810363371520, 2207252496, 3, 1),
            ('attention', 'sdpa', 'bf16', 4123168604160, 1930428432, 3, 1),
            ('attention', 'sdpa', 'bf16', 3435973836800, 1653604368, 3, 1),
            ('attention', 'sdpa', 'bf16', 2748779069440, 1376780304, 3, 1),
            ('attention', 'sdpa', 'bf16', 2061584302080, 1099956240, 3, 1),
            ('attention', 'sdpa', 'bf16', 1924145348608, 1133510672, 1, 1),
            ('attention', 'sdpa', 'bf16', 1649267441664, 990904336, 1, 1),
            ('attention', 'sdpa', 'bf16', 1374389534720, 823132176, 3, 1),
            ('attention', 'sdpa', 'bf16', 1374389534720, 848298000, 1, 1),
            ('attention', 'sdpa', 'bf16', 1099511627776, 705691664, 1, 1),
            ('attention', 'sdpa', 'bf16', 824633720832, 563085328, 1, 1),
            ('attention', 'sdpa', 'bf16', 687194767360, 546308112, 3, 1),
            ('attention', 'sdpa', 'bf16', 549755813888, 420478992, 1, 1),
            ('attention', 'sdpa', 'bf16', 274877906944, 277872656, 1, 1),
        ),
    },
}

# ---------------------------------------------------------------------------------------------
# what an op is


GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "_int_mm", "mv", "addmv", "dot", "vdot",
        "convolution", "_convolution", "convolution_backward", "cudnn_convolution", "convolution_overrideable",
        "_slow_conv2d_forward"}
ATTENTION = {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
             "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
             "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward", "flex_attention", "flex_attention_backward"}
FLEX = {"flex_attention", "flex_attention_backward"}
SOFTMAX_LOSS = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "_safe_softmax",
                "logsumexp", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
                "kl_div", "binary_cross_entropy", "binary_cross_entropy_backward", "binary_cross_entropy_with_logits",
                "mse_loss", "mse_loss_backward", "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss",
                "huber_loss_backward", "cross_entropy_loss",
                "distill_rows"}  # train/fused_loss.py's Triton kernel (draftsmith::distill_rows)
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "aminmax", "norm", "linalg_vector_norm",
              "var", "var_mean", "std", "std_mean", "prod", "any", "all", "cumsum", "cumprod", "cummax", "cummin",
              "logcumsumexp", "topk", "sort", "count_nonzero", "nansum", "median", "mode", "_unique2",
              "unique_consecutive", "unique_dim", "searchsorted", "bincount", "histc"}
COPY = {"copy_", "_to_copy", "clone", "cat", "stack", "constant_pad_nd", "repeat", "repeat_interleave", "flip", "roll",
        "index", "index_select", "gather", "take", "embedding", "embedding_dense_backward", "_unsafe_index",
        "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put", "index_add", "index_add_", "index_copy",
        "index_copy_", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
        "masked_select", "masked_scatter", "masked_scatter_", "nonzero", "slice_scatter", "select_scatter",
        "diagonal_scatter", "as_strided_scatter", "lift_fresh_copy", "_local_scalar_dense", "split_with_sizes_copy",
        "unbind_copy", "narrow_copy", "_foreach_copy_", "tril", "triu", "contiguous", "slice_backward",
        "select_backward", "diagonal_backward", "as_strided_backward", "index_fill", "index_fill_"}
# factories and fills run the elementwise fill kernel
ELEMENTWISE = {"fill", "fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros",
               "new_ones", "new_full", "scalar_tensor", "arange", "eye", "linspace", "rand", "randn", "rand_like",
               "randn_like", "randint", "randperm", "bernoulli", "bernoulli_", "uniform_", "normal_", "masked_fill",
               "masked_fill_", "where", "clamp", "clamp_", "_masked_scale", "native_dropout", "isin"}
OPTIMIZER_PREFIXES = ("_foreach_", "_fused_adam", "_fused_sgd", "_fused_adagrad")
NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
             "resize_", "set_", "_resize_output_", "record_stream", "is_same_size", "_has_compatible_shallow_copy_type",
             "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
             "_nested_tensor_size", "dim", "size", "stride", "numel"}
LAUNCHES = {"_scaled_dot_product_cudnn_attention_backward": 3,  # cuDNN: dO.O, the fused backward, dQ conversion
            "flex_attention_backward": 2,  # inductor: the delta reduction, the backward template
            "slice_backward": 2, "select_backward": 2, "diagonal_backward": 2,  # a zero fill, then the copy
            "as_strided_backward": 2, "index_add": 2, "index_put": 2, "scatter_add": 2}  # out of place: a copy first
# torch's multi_tensor_apply (foreach / fused optimizer kernels): one launch per 320 chunks of 65536
# elements or per depth_to_max_tensors tensors (depth: tensor lists per kernel), whichever fills first
MTA_CHUNK, MTA_BLOCKS, MTA_MAX_TENSORS = 65536, 320, (110, 64, 48, 36, 30)
WRITE_ONLY = {"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_", "masked_fill_", "index_fill_"}
GATHERS = {"embedding", "index_select", "index", "gather", "_unsafe_index", "take"}  # the source is args[0]
ROW_GATHERS = {"distill_rows": (1, 2)}  # (source arg, index arg): the source is read at the indexed rows only
SCATTERS = {"index_put_", "_index_put_impl_", "_unsafe_index_put", "index_add_", "index_copy_", "scatter_",
            "scatter_add_", "scatter_reduce_", "masked_scatter_"}


def op_name(func: Any) -> str:
    """``mm`` of ``aten.mm.default``; the name of a higher-order op (``flex_attention``)."""
    packet = getattr(func, "_overloadpacket", None)
    return packet.__name__ if packet is not None else str(getattr(func, "__name__", func))


def full_name(func: Any) -> str:
    return str(func) if isinstance(func, torch._ops.OpOverload) else op_name(func)


def launches_kernel(func: Any) -> bool:
    """False for views and metadata ops (module docstring), which launch no kernel."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return True
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in ("prim", "profiler"):
        return False
    name = op_name(func)
    if name in NO_KERNEL or torch.Tag.inplace_view in func.tags:
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


def op_class(func: Any, name: str, phase: str) -> str:
    if name in ATTENTION:
        return "attention"
    if name in GEMM:
        return "gemm"
    if phase == "optimizer" or name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer"
    if name in SOFTMAX_LOSS:
        return "softmax/loss"
    if name in COPY:
        return "copy/cast"
    tags = getattr(func, "tags", ())
    if name in REDUCTIONS or torch.Tag.reduction in tags:
        return "reductions"
    if name in ELEMENTWISE or torch.Tag.pointwise in tags:
        return "elementwise"
    return "other"


def tensor_bytes(t: Any) -> int:
    """The bytes of ``t``'s own elements: its numel, a broadcast (stride 0) dimension counted once."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def op_launches(name: str, args: tuple) -> int:
    """Kernel launches of one op: 1, :data:`LAUNCHES`' exceptions, and for the foreach / fused
    optimizer ops multi_tensor_apply's launches (:data:`MTA_CHUNK`), plus the final reduction of
    ``_foreach_norm``."""
    if not name.startswith(("_foreach_", "_fused_")):
        return LAUNCHES.get(name, 1)
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)]
    if not lists:
        return 1
    first = lists[0]
    depth = min(len(MTA_MAX_TENSORS), sum(1 for lst in lists if len(lst) == len(first)))
    chunks = sum(math.ceil(t.numel() / MTA_CHUNK) for t in first)
    n = max(1, math.ceil(chunks / MTA_BLOCKS), math.ceil(len(first) / MTA_MAX_TENSORS[depth - 1]))
    return n + (1 if name == "_foreach_norm" else 0)


def _leaves(obj: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place (schema arguments marked ``!``)."""
    if not isinstance(func, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        out.extend(_leaves(value))
    return out


def op_bytes(func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> int:
    """Input plus output bytes of one op (module docstring: the copy / gather / scatter rules)."""
    inputs = _leaves((args, kwargs))
    outputs = _leaves(out)
    written = _written(func, args, kwargs)
    in_bytes = sum(tensor_bytes(t) for t in inputs)
    out_bytes = sum(tensor_bytes(t) for t in outputs) if outputs else sum(tensor_bytes(t) for t in written)
    if name in ROW_GATHERS:
        src, idx = (args[i] if i < len(args) else None for i in ROW_GATHERS[name])
        if isinstance(src, torch.Tensor) and isinstance(idx, torch.Tensor) and src.dim() >= 1:
            rows = idx.numel() * (src.numel() // max(src.shape[0], 1)) * src.element_size()
            in_bytes += min(rows, tensor_bytes(src)) - tensor_bytes(src)
    if name in WRITE_ONLY:  # the destination is written, not read
        in_bytes -= sum(tensor_bytes(t) for t in written)
    elif name in GATHERS and args and isinstance(args[0], torch.Tensor) and outputs:
        src = args[0]
        gathered = sum(o.numel() for o in outputs) * src.element_size()
        in_bytes += min(gathered, tensor_bytes(src)) - tensor_bytes(src)
    elif name in SCATTERS and args and isinstance(args[0], torch.Tensor):
        self_bytes = tensor_bytes(args[0])
        values = [t for t in _leaves(args[1:]) if t.is_floating_point() or t.dtype == args[0].dtype]
        values = [t for t in values if t is not args[0]]
        written_bytes = sum(t.numel() for t in values) * args[0].element_size() if values else self_bytes
        in_bytes -= self_bytes
        out_bytes = min(written_bytes, self_bytes)
    return max(int(in_bytes), 0) + int(out_bytes)


def block_mask_fraction(block_mask: Any) -> float | None:
    """The fraction of (query tile, key tile) pairs a flex ``BlockMask`` (as the tuple the op
    receives) computes: partial plus full tiles over all tiles; None when its counts are fake."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(block_mask, tuple) or len(block_mask) < 6:
        return None
    kv_len, kv_num, full_num = block_mask[1], block_mask[2], block_mask[4]
    ints = [x for x in block_mask if isinstance(x, int) and not isinstance(x, bool)]
    if not isinstance(kv_num, torch.Tensor) or isinstance(kv_num, FakeTensor) or len(ints) < 4:
        return None
    if isinstance(full_num, FakeTensor):
        return None
    kv_block = ints[-1]
    n_kv = max(1, math.ceil(int(kv_len) / kv_block))
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        tiles = kv_num.double()
        if isinstance(full_num, torch.Tensor):
            tiles = tiles + full_num.double()
        return float(min(1.0, tiles.mean().item() / n_kv))


def op_flops(func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> tuple[int, float | None]:
    """``(FLOPs, tile fraction)`` of a matmul / attention op (0 for the others): torch's flop
    formulas; flex_attention scaled by its BlockMask's tile fraction (None: counted dense)."""
    from torch.utils.flop_counter import flop_registry

    if name in FLEX:
        q, k, v = args[:3]
        if name == "flex_attention":
            from torch.utils.flop_counter import sdpa_flop_count

            dense = sdpa_flop_count(q.shape, k.shape, v.shape)
            mask = args[4] if len(args) > 4 else kwargs.get("block_mask")
        else:
            from torch.utils.flop_counter import sdpa_backward_flop_count

            grad_out = args[5] if args[5] is not None else args[3]
            dense = sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
            mask = args[9] if len(args) > 9 else kwargs.get("block_mask")
        fraction = block_mask_fraction(mask)
        return int(dense * (1.0 if fraction is None else fraction)), fraction
    if name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

        if name.endswith("backward"):
            return int(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)), None
        return int(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)), None
    if name in ("mv", "addmv", "dot", "vdot"):
        a = args[1] if name == "addmv" else args[0]
        return 2 * a.numel(), None
    packet = getattr(func, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0, None
    try:
        return int(formula(*args, **kwargs, out_val=out)), None
    except Exception:  # noqa: BLE001 - a shape the formula does not take: no FLOPs rather than no count
        return 0, None


def rate_key(name: str, args: tuple) -> str:
    """The peak an op runs at: ``bf16`` (bf16 / fp16 / fp8 tensor cores), ``tf32`` (fp32
    matmuls under TF32), ``fp32`` (fp32 attention on CUDA cores)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.dtype not in (torch.float32, torch.float64):
        return "bf16"
    return "fp32" if name in ATTENTION else "tf32"


# ---------------------------------------------------------------------------------------------
# the counter


@dataclass
class OpStat:
    """One group of identical ops (name, class, FLOPs, bytes, peak): how many times it ran."""

    name: str
    cls: str
    flops: int
    bytes: int
    launches: int
    rate: str
    attention: str  # "sdpa" / "flex" for attention ops, else ""
    count: int = 0


class StepCounter(MemoryTracker):
    """A ``TorchDispatchMode`` counting the ops, FLOPs and bytes of what runs under it.

    Counts only while :attr:`recording`; :meth:`phase` names the part of the step (``optimizer``:
    every op in it is of the optimizer class). Under ``fake`` (a ``FakeTensorMode`` entered before
    it) it runs ops as :class:`~benchmarks.memory.MemoryTracker` does (index / mask tensors from the
    real batch stay real, a scalar read from a fake tensor is 1); it keeps no memory accounting.
    Higher-order ops (flex_attention) are counted as one op and run by the mode below."""

    supports_higher_order_operators = True

    def __init__(self, fake: Any | None = None):
        super().__init__(fake=fake)
        self.recording = True
        self.current_phase = "forward_backward"
        self.stats: dict[tuple, OpStat] = {}
        self.views = 0
        self.host_syncs = 0
        self.casts: dict[str, int] = {}
        self.flex_fractions: list[tuple[float | None, int]] = []
        self._tracing = 0

    def _register(self, t: torch.Tensor) -> None:  # no memory accounting
        return

    def _run(self, func, args, kwargs):
        if self._tracing:  # a graph traced for a higher-order op: every tensor fake, nothing counted
            return func(*args, **kwargs)
        return super()._run(func, args, kwargs)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """While active, ops are neither counted nor run for real (flex_attention tracing its
        score_mod's forward / backward graphs on example tensors: host work, no kernels)."""
        saved = self.recording
        self._tracing += 1
        self.recording = False
        try:
            yield
        finally:
            self._tracing -= 1
            self.recording = saved

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:  # type: ignore[override]
        saved, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            out = func(*args, **kwargs)  # the mode below (FakeTensorMode) runs it
        elif self.fake is not None:
            out = self._run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.recording:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not launches_kernel(func):
            if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
                self.views += 1  # aten views and metadata ops (prim / profiler calls are not ops at all)
            return
        name = op_name(func)
        cls = op_class(func, name, self.current_phase)
        flops, fraction = op_flops(func, name, args, kwargs, out) if cls in MATMUL_CLASSES else (0, None)
        nbytes = op_bytes(func, name, args, kwargs, out)
        if name in FLEX:
            self.flex_fractions.append((fraction, flops))
        if name == "_local_scalar_dense":
            self.host_syncs += 1
        if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor) \
                and args[0].dtype != out.dtype:
            key = f"{_dtype(args[0].dtype)}->{_dtype(out.dtype)}"
            self.casts[key] = self.casts.get(key, 0) + 1
        rate = rate_key(name, args) if cls in MATMUL_CLASSES else ""
        attention = ("flex" if name in FLEX else "sdpa") if cls == "attention" else ""
        launches = op_launches(name, args)
        key = (full_name(func), cls, flops, nbytes, rate, launches)
        stat = self.stats.get(key)
        if stat is None:
            stat = self.stats[key] = OpStat(full_name(func), cls, flops, nbytes, launches, rate, attention)
        stat.count += 1


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# the CUDA path on a CPU


def cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as CUDA runs it on an H100 / H200: the kernel it selects
    (cuDNN attention for bf16 / fp16 at head dims up to 256; flash without a mask otherwise; the
    memory-efficient kernel for fp32) with a bool mask turned into the additive bias first
    (``where(mask.logical_not(), -inf, 0)``, as aten's SDPA does)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):  # autocast runs SDPA in its lower precision (the private ops are not listed)
        low = torch.get_autocast_dtype(device)
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    B, h, Tq, d = query.shape
    Tk = key.shape[-2]
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.where(bias.logical_not(), float("-inf"), torch.zeros((), dtype=query.dtype, device=query.device))
    if bias is not None:
        bias = bias.expand(B, h, Tq, Tk)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    half = query.dtype in (torch.bfloat16, torch.float16)
    if half and d <= 256 and d % 8 == 0 and d == value.shape[-1]:
        return aten._scaled_dot_product_cudnn_attention(query, key, value, bias, grad, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if half and bias is None and d <= 256:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p, is_causal,
                                                        scale=scale)[0]


@contextlib.contextmanager
def cuda_sdpa_policy() -> Iterator[None]:
    """While active, ``F.scaled_dot_product_attention`` is :func:`cuda_sdpa`."""
    import torch.nn.functional as F

    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = cuda_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


@torch.library.custom_op("draftsmith_bench::fused_rms_norm", mutates_args=())
def _fused_rms_norm(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's ``aten::_fused_rms_norm`` (normed ``x``, fp32 ``rstd (..., 1)``) as one op a CPU
    counts: torch's CPU build decomposes ``rms_norm`` into ~7 ops forward and ~12 backward."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * rstd).to(x.dtype), rstd


@_fused_rms_norm.register_fake
def _(x, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("draftsmith_bench::fused_rms_norm_backward", mutates_args=())
def _fused_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """CUDA's ``aten::_fused_rms_norm_backward`` for the input (the weight is applied outside)."""
    xf, g = x.float(), grad.float()
    n = xf * rstd
    return (rstd * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)


@_fused_rms_norm_backward.register_fake
def _(grad, x, rstd):
    return torch.empty_like(x)


def _rms_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])


def _rms_norm_grad(ctx, grad, _grad_rstd):
    x, rstd = ctx.saved_tensors
    return _fused_rms_norm_backward(grad, x, rstd), None


_fused_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


@contextlib.contextmanager
def cuda_rms_norm_policy() -> Iterator[None]:
    """While active, the drafts' RMSNorm (:func:`draftsmith.models.common.rms_normalize`) is one op
    forward and one backward, as CUDA runs ``rms_norm`` (``aten::_fused_rms_norm`` and its backward,
    reading the input and the fp32 ``rstd``), instead of the CPU's decomposition."""
    from draftsmith.models import common

    saved = common.rms_normalize
    common.rms_normalize = lambda x, eps: _fused_rms_norm(x, float(eps))[0]
    try:
        yield
    finally:
        common.rms_normalize = saved


@contextlib.contextmanager
def cuda_foreach_policy() -> Iterator[None]:
    """While active, gradient clipping takes the foreach kernels it takes on CUDA (fake tensors are
    not plain tensors, so torch would clip them one tensor at a time)."""
    from torch.nn.utils import clip_grad
    from torch.utils._foreach_utils import _device_has_foreach_support

    saved = clip_grad._has_foreach_support
    clip_grad._has_foreach_support = lambda tensors, device: _device_has_foreach_support(device)
    try:
        yield
    finally:
        clip_grad._has_foreach_support = saved


@contextlib.contextmanager
def fake_flex_policy(counter: StepCounter) -> Iterator[None]:
    """While active, ``flex_attention`` calls its higher-order op directly (no ``torch.compile``
    wrapper, which refuses a dispatch mode), accepts CPU tensors that need gradients (torch has
    no CPU flex backward kernel; under fake tensors none runs) and traces its score_mod graphs
    under ``counter``'s :meth:`StepCounter.tracing`. ``create_block_mask`` runs for real (its
    mask evaluated on the real batch: the tile counts of the FLOPs) only while the counter
    records; in the step before, its tensors are fake (the mask is the CPU's largest work)."""
    import functools
    import importlib

    import torch.nn.attention.flex_attention as fa

    hop = importlib.import_module("torch._higher_order_ops.flex_attention")  # the module, not the op

    saved = (fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, hop.create_fw_bw_graph,
             fa.create_block_mask)
    graphs, masks = hop.create_fw_bw_graph, fa.create_block_mask

    @functools.wraps(graphs)
    def traced_graphs(*args, **kwargs):
        with counter.tracing():
            return graphs(*args, **kwargs)

    @functools.wraps(masks)
    def block_mask(*args, **kwargs):
        if counter.recording:
            return masks(*args, **kwargs)
        with counter.tracing():
            return masks(*args, **kwargs)

    fa._validate_device = lambda *a, **k: None
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    hop.create_fw_bw_graph = traced_graphs
    fa.create_block_mask = block_mask
    try:
        yield
    finally:
        (fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, hop.create_fw_bw_graph,
         fa.create_block_mask) = saved


# ---------------------------------------------------------------------------------------------
# one counted step


@dataclass
class StepCount:
    """What one counted training step ran: op groups and the counts beside them."""

    stats: list[OpStat]
    views: int
    host_syncs: int
    casts: dict[str, int]
    flex_fraction: float | None
    flex_readable: bool
    trainable_parameters: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def fused_loss_setting(recipe: Any) -> Iterator[None]:
    """While active, the loss takes ``train.fused_loss`` as the trainer sets it (where the checkout
    has the fused loss; ``auto``: fused on CUDA, which the fake step stands for)."""
    try:
        from draftsmith.train import losses
    except ImportError:
        yield
        return
    setting = getattr(recipe.train, "fused_loss", None)
    if setting is None or not hasattr(losses, "set_fused_loss"):
        yield
        return
    saved = losses.FUSED_LOSS
    with warnings.catch_warnings():  # set_fused_loss may be deprecated (the methods pass the setting): same effect
        warnings.simplefilter("ignore", DeprecationWarning)
        losses.set_fused_loss(setting)
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            losses.set_fused_loss(saved)


def cuda_compile(recipe: Any) -> bool:
    """Whether the trainer ``torch.compile``s the draft's decoder-layer regions on CUDA (``train.compile``)."""
    setting = getattr(recipe.train, "compile", None)
    if setting is None:
        return False
    try:
        from draftsmith.models.common import resolve_compile
    except ImportError:
        return setting is True or setting == "auto"
    return resolve_compile(setting, torch.device("cuda"))


def cuda_backend(backend: str) -> str:
    """``train.attention_backend`` as it resolves on CUDA (``auto``: flex)."""
    try:
        from draftsmith.models.common import resolve_attention_backend
    except ImportError:
        return "flex" if backend == "auto" else backend
    return resolve_attention_backend(backend, torch.device("cuda"))


def count_step(recipe: Any, config_json: dict[str, Any], precision: Precision, seed: int = 0,
               fused_norm: bool = True) -> StepCount:
    """Build the recipe's method and draft under fake tensors, run two trainer steps on a random
    batch shaped like the real one and count the second (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    dev = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    counter = StepCounter(fake=fake_mode)
    counter.recording = False
    with contextlib.ExitStack() as ctx:
        ctx.enter_context(fake_mode)
        ctx.enter_context(counter)
        if precision.autocast:
            ctx.enter_context(cuda_autocast_policy())
        ctx.enter_context(cuda_attention_policy())
        ctx.enter_context(cuda_sdpa_policy())
        ctx.enter_context(cuda_foreach_policy())
        if fused_norm:  # today's RMSNorm on CUDA; the H200-measured code ran transformers' written-out one
            ctx.enter_context(cuda_rms_norm_policy())
        ctx.enter_context(fake_flex_policy(counter))
        ctx.enter_context(fused_loss_setting(recipe))
        head_dtype = getattr(torch, recipe.target.dtype)
        with offline_method(recipe, config_json, head_dtype, torch.empty) as method:
            H, V = int(method.target_info.hidden_size), int(method.target_info.vocab_size)
            n_aux = len(method.target_info.aux_layer_ids)
            model, trainable, optimizers = prepare_model(method, recipe, precision, dev, fake=True)
            cpu_batch = random_batch(recipe, H, V, n_aux, fake=True, seed=seed)
            plan = method.batch_plan() if hasattr(method, "batch_plan") else None
            batch = _device_batch(cpu_batch, plan, dev, None, True)
            forward_backward, update, _window = trainer_step(method, model, batch, trainable, optimizers,
                                                             recipe.train, dev)
            for step in range(2):
                counter.recording = step == 1
                with counter.phase("forward_backward"):
                    forward_backward(step)
                with counter.phase("optimizer"):
                    update()
            counter.recording = False
            n_trainable = sum(p.numel() for p in trainable)
    fractions = counter.flex_fractions
    readable = all(f is not None for f, _ in fractions)
    flex_fraction = None
    if fractions:
        dense = sum(fl / f for f, fl in fractions if f)
        flex_fraction = sum(fl for _, fl in fractions) / dense if dense and readable else None
    fused = any(st.name.startswith("draftsmith.distill_rows") for st in counter.stats.values())
    return StepCount(stats=list(counter.stats.values()), views=counter.views, host_syncs=counter.host_syncs,
                     casts=counter.casts, flex_fraction=flex_fraction, flex_readable=readable,
                     trainable_parameters=n_trainable, seconds=time.perf_counter() - t0,
                     extra={"loss_path": "fused" if fused else "chunked", "compiled_layers": cuda_compile(recipe)})


# ---------------------------------------------------------------------------------------------
# the roofline


def op_seconds(s: OpStat, gpu: Gpu, c: Constants) -> float:
    """The estimated time of one op of group ``s`` on ``gpu`` (module docstring)."""
    mem = s.bytes / (gpu.hbm_tbps * 1e12 * c.mem_eff)
    compute = 0.0
    if s.flops:
        peak = {"bf16": gpu.bf16_tflops, "tf32": gpu.tf32_tflops, "fp32": gpu.fp32_tflops}[s.rate] * 1e12
        eff = c.gemm_eff if s.cls == "gemm" else (c.flex_eff if s.attention == "flex" else c.sdpa_eff)
        compute = s.flops / (peak * eff)
    return max(compute, mem) + s.launches * c.launch_us * 1e-6


def breakdown(count: StepCount, c: Constants) -> dict[str, dict[str, float]]:
    """Per class: ops, launches, TFLOP, GB and the estimated ms on each GPU."""
    out = {k: {"ops": 0, "launches": 0, "tflop": 0.0, "gb": 0.0, "est_ms_h100": 0.0, "est_ms_h200": 0.0}
           for k in CLASSES}
    for s in count.stats:
        row = out[s.cls]
        row["ops"] += s.count
        row["launches"] += s.count * s.launches
        row["tflop"] += s.count * s.flops / 1e12
        row["gb"] += s.count * s.bytes / 1e9
        for key, gpu in GPUS.items():
            row[f"est_ms_{key}"] += s.count * op_seconds(s, gpu, c) * 1e3
    return out


def top_ops(count: StepCount, c: Constants, n: int = TOP) -> dict[str, list[dict[str, Any]]]:
    """The ``n`` aten ops with the most calls and the most bytes (all shapes of an op together)."""
    per: dict[str, dict[str, Any]] = {}
    for s in count.stats:
        row = per.setdefault(s.name, {"op": s.name, "class": s.cls, "count": 0, "gb": 0.0, "tflop": 0.0,
                                      "est_ms_h200": 0.0})
        row["count"] += s.count
        row["gb"] += s.count * s.bytes / 1e9
        row["tflop"] += s.count * s.flops / 1e12
        row["est_ms_h200"] += s.count * op_seconds(s, H200, c) * 1e3
    rows = list(per.values())
    for r in rows:
        r["gb"], r["tflop"], r["est_ms_h200"] = round(r["gb"], 3), round(r["tflop"], 4), round(r["est_ms_h200"], 2)
    return {"by_count": sorted(rows, key=lambda r: (-r["count"], r["op"]))[:n],
            "by_bytes": sorted(rows, key=lambda r: (-r["gb"], r["op"]))[:n]}


def fit_constants(runs: list[tuple[StepCount, str, dict[str, float]]], mem_eff: float | None = None,
                  fallback: Constants | None = FITTED) -> Constants:
    """The fitted constants from profiled runs ``(count, attention backend, kernel ms by class)``.

    ``mem_eff`` is assumed, not fitted (default :data:`FITTED`'s; the profiled runs cannot tell it
    from the launch cost). ``launch_us``: least squares (relative errors) of the memory-bound part,
    every class but gemm and attention, whose time is ``bytes / (HBM * mem_eff) + launches *
    launch_us``, against the profile's total minus its gemm and attention kernels. Then
    ``gemm_eff`` over the gemm kernels of every run, ``sdpa_eff`` / ``flex_eff`` over the attention
    kernels of the runs of that backend, each by bisection to the measured sum (the class
    boundaries of a kernel-name profile and of aten ops agree for these two classes).

    A constant no run identifies (``flex_eff`` without a flex profile) is ``fallback``'s, or NaN
    with ``fallback=None`` (the leave-one-out folds: no estimate borrows a constant fitted on the
    held-out profiles; every op that needs it estimates NaN)."""
    mem_eff = FITTED.mem_eff if mem_eff is None else mem_eff
    unknown = lambda attr: math.nan if fallback is None else getattr(fallback, attr)  # noqa: E731
    num = den = 0.0
    for count, _, measured in runs:
        nonmatmul = [s for s in count.stats if s.cls not in MATMUL_CLASSES]
        seconds = sum(s.count * s.bytes for s in nonmatmul) / (H200.hbm_tbps * 1e12 * mem_eff)
        launches = sum(s.count * s.launches for s in nonmatmul)
        target = (measured["total"] - measured["gemm"] - measured["attention"]) / 1e3
        w = 1.0 / target**2
        num += w * (target - seconds) * launches
        den += w * launches * launches
    launch_us = max(0.0, num / den * 1e6) if den else unknown("launch_us")
    base = Constants(launch_us=launch_us, mem_eff=mem_eff, gemm_eff=1.0, sdpa_eff=1.0, flex_eff=1.0)

    def solve(attr: str, cls: str, backend: str | None) -> float:
        chosen = [(cnt, m[cls] / 1e3) for cnt, b, m in runs if cls in m and backend in (None, b)]
        if not chosen:
            return unknown(attr)

        def excess(eff: float) -> float:  # estimate - measured, summed over the runs; falls as eff rises
            c = Constants(**{**asdict(base), attr: eff})
            return sum(sum(s.count * op_seconds(s, H200, c) for s in cnt.stats
                           if s.cls == cls and (backend is None or s.attention == backend)) - m for cnt, m in chosen)

        lo, hi = 1e-3, 1.0
        if excess(hi) > 0:
            return hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    return Constants(launch_us=round(launch_us, 2), mem_eff=mem_eff, gemm_eff=round(solve("gemm_eff", "gemm", None), 3),
                     sdpa_eff=round(solve("sdpa_eff", "attention", "sdpa"), 3),
                     flex_eff=round(solve("flex_eff", "attention", "flex"), 3))


# ---------------------------------------------------------------------------------------------
# the command


def load(recipe_arg: str | Path, sets: list[str], args: argparse.Namespace) -> tuple[Any, dict[str, Any], str, Any]:
    """``(recipe at the bench's B x T with its CUDA attention backend, config.json, its source, launcher)``.

    Raises:
        ValueError / FileNotFoundError / LauncherError: one line naming the problem.
    """
    from draftsmith.recipe import load_recipe

    path = Path(recipe_arg)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = RECIPES_DIR / f"{recipe_arg}.yaml"
    recipe = load_recipe(path, sets)
    return _prepare(recipe, args)


def _prepare(recipe: Any, args: argparse.Namespace) -> tuple[Any, dict[str, Any], str, Any]:
    from draftsmith.target import check_lengths, load_config_json, validate_geometry
    from draftsmith.train.launchers import draft_model_class, validate_launcher

    config_json, source = load_config_json(recipe, getattr(args, "target_config", None))
    validate_geometry(config_json, source)
    B = getattr(args, "batch_size", None) or recipe.train.batch_size
    T = getattr(args, "max_length", None) or recipe.data.max_length
    if B < 1:
        raise ValueError(f"--batch-size {B}: must be >= 1")
    check_lengths(config_json, [T], source, "--max-length" if getattr(args, "max_length", None) else "data.max_length")
    launcher = getattr(args, "launcher", None) or recipe.launcher
    launch = validate_launcher(recipe, launcher, draft_model_class(recipe.draft.method)) if launcher else None
    r = bench_recipe(recipe, B, T)
    attention = getattr(args, "attention", None)
    if hasattr(r.train, "attention_backend"):
        r.train.attention_backend = cuda_backend(attention or r.train.attention_backend)
    return r, config_json, str(source), launch


def measure(recipe: Any, config_json: dict[str, Any], source: str, launch: Any, precision: Precision,
            constants: Constants = FITTED) -> dict[str, Any]:
    """Count one step of ``recipe`` (at its bench ``B x T`` and CUDA backend) and estimate it: the
    object ``--json`` prints."""
    B, T = recipe.train.batch_size, recipe.data.max_length
    attention = getattr(recipe.train, "attention_backend", "sdpa")
    count = count_step(recipe, config_json, precision, fused_norm=not norm_written_out(recipe))
    return report(recipe, count, attention, B, T, source, launch, precision, constants)


def report(recipe: Any, count: StepCount, attention: str, B: int, T: int, source: str, launch: Any,
           precision: Precision, constants: Constants) -> dict[str, Any]:
    classes = breakdown(count, constants)
    total = {k: sum(row[f"est_ms_{k}"] for row in classes.values()) for k in GPUS}
    ops = sum(row["ops"] for row in classes.values())
    launches = sum(row["launches"] for row in classes.values())
    matmul = sum(classes[k]["tflop"] for k in MATMUL_CLASSES)
    nonmatmul = sum(row["gb"] for k, row in classes.items() if k not in MATMUL_CLASSES)
    key = (recipe.name, attention, B, T)
    loss_path, compiled_layers = count.extra.get("loss_path", "chunked"), count.extra.get("compiled_layers", False)
    # the step the H200 figures were measured on (the code and the recipe settings: MEASURED_STEP)
    as_measured = loss_path == "chunked" and not compiled_layers and is_as_measured(recipe)
    measured = H200_MEASURED.get(key) if as_measured else None
    profile = H200_PROFILE.get(key) if as_measured else None
    has_attention = classes["attention"]["ops"] > 0
    notes = [
        "ops: aten ops dispatched in the second training step (forward, backward, clipping, optimizer step, "
        "zero_grad), views and metadata ops excluded; launches: ops, the attention backward at its kernels "
        "(cuDNN 3, flex 2), fill-then-copy backward ops at 2, foreach / fused optimizer ops at multi_tensor_apply's "
        "launches",
        "bytes: inputs + outputs of each op, a tensor at its own numel (a broadcast dim once); copy_/fill_ do "
        "not read their destination, gathers read what they return, in-place scatters write their values",
        "host-side time (Python, dispatch, launches the GPU does not hide) is not modelled",
    ]
    if has_attention and attention == "sdpa":
        notes.append("attention: F.scaled_dot_product_attention sent to the kernel CUDA selects (cuDNN for bf16/fp16, "
                     "the memory-efficient kernel for fp32) with its bool mask as an additive bias; FLOPs dense over "
                     "the whole (masked) area it computes, backward 2.5x forward")
    if has_attention and attention == "flex":
        if count.flex_readable and count.flex_fraction is not None:
            notes.append(f"attention: flex_attention ran under fake tensors; FLOPs counted at its BlockMask's "
                         f"unmasked-tile fraction ({count.flex_fraction:.4f} of the dense area, FLOP-weighted)")
        else:
            notes.append("attention: flex_attention ran under fake tensors but its BlockMask was not readable: "
                         "FLOPs counted dense")
    if attention == "flex" and recipe.draft.method in ("dflash", "dspark", "dflash2"):
        notes.append("the DFlash block mask is built by a compiled create_block_mask on CUDA; counted here by its "
                     "eager aten ops")
    if precision.autocast:
        notes.append("autocast: CPU bf16 autocast with CUDA's fp32 op list (softmax, log_softmax, exp, log, rsqrt, "
                     "pow, sum, cumsum, logsumexp, layer_norm)")
    notes.append("loss: the fused Triton loss (draftsmith::distill_rows, one kernel per chunk of rows)"
                 if loss_path == "fused" else "loss: the chunked torch loss (logits, log-softmaxes, divergence, "
                                              "argmaxes per chunk of rows, recomputed in backward)")
    if H200_MEASURED.get(key) is not None and not as_measured:
        notes.append(f"the H200 measurement of this recipe ({H200_MEASURED[key]} ms) is of the chunked loss, eager "
                     "decoder layers, unpacked rows and full attention: count that step with --as-measured")
    elif measured is None:
        notes.append("no H200 measurement of this recipe / attention / B x T in the table")
    regions = []
    if attention == "flex" and has_attention:
        regions.append("flex_attention (torch.compile on CUDA): counted by the kernels inductor generates for it "
                       "(1 forward, 2 backward)")
    if compiled_layers:
        regions.append("the decoder layers' regions around attention (train.compile, torch.compile on CUDA): counted "
                       "by their eager aten ops, an upper bound on their launches and bytes (inductor fuses their "
                       "elementwise chains; under fake tensors nothing compiles)")
    compiled = "; ".join(regions) + "; every other op runs eagerly, counted by aten ops" if regions else \
        "none: every op runs eagerly, counted by aten ops"
    out: dict[str, Any] = {
        "recipe": recipe.name, "method": recipe.draft.method, "target": recipe.target.name_or_path,
        "target_config": source, "launcher": None if launch is None else str(launch.path),
        "precision": precision.name, "attention": attention, "B": B, "T": T, "loss": loss_path,
        "compiled_layers": compiled_layers,
        "ops": ops, "launches": launches, "views_not_counted": count.views, "host_syncs": count.host_syncs,
        "matmul_tflop": round(matmul, 3), "gemm_tflop": round(classes["gemm"]["tflop"], 3),
        "attention_tflop": round(classes["attention"]["tflop"], 3), "nonmatmul_gb": round(nonmatmul, 2),
        "est_ms": {k: round(v, 1) for k, v in total.items()},
        "measured_ms": {"h200": measured} if measured is not None else {},
        "measured_launches_h200": H200_LAUNCHES.get(key) if as_measured else None,
        "error_vs_measured": round(total["h200"] / measured - 1, 4) if measured else None,
        "classes": {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in row.items()}
                    for k, row in classes.items() if row["ops"]},
        "profile_h200_ms": profile or {},
        "flex_tile_fraction": None if count.flex_fraction is None else round(count.flex_fraction, 4),
        "casts": dict(sorted(count.casts.items(), key=lambda kv: -kv[1])),
        "top_ops": top_ops(count, constants),
        "compiled_regions": compiled,
        "constants": {**asdict(constants), "gpus": {k: asdict(g) for k, g in GPUS.items()},
                      "fitted_on": f"{CALIBRATION[0]} sdpa + flex at {CALIBRATION[1]} x {CALIBRATION[2]}, "
                                   "H200 torch.profiler kernel time by class; mem_eff assumed, not fitted; "
                                   "out-of-sample errors by class: docs/bench_step.md, --leave-one-out"},
        "trainable_parameters": count.trainable_parameters,
        "cpu_seconds": round(count.seconds, 1),
        "notes": notes,
    }
    return out


def format_report(r: dict[str, Any]) -> str:
    g = lambda v: f"{v:,.1f}"  # noqa: E731
    lines = [f"{r['recipe']} ({r['method']}), attention {r['attention']}, B x T {r['B']} x {r['T']}, precision "
             f"{r['precision']}, {r['loss']} loss{', compiled layers' if r['compiled_layers'] else ''}; target "
             f"{r['target']}; counted in {r['cpu_seconds']} s on this CPU (fake tensors)",
             "per training step (forward + backward + clipping + optimizer; the second of two steps):",
             f"  ops {r['ops']:,} (view / metadata ops not counted: {r['views_not_counted']:,}), est. kernel launches "
             f"{r['launches']:,}" + (f" (H200 profile: {r['measured_launches_h200']:,} kernels)"
                                     if r.get("measured_launches_h200") else "") + f", host syncs {r['host_syncs']}",
             f"  matmul {r['matmul_tflop']:.2f} TFLOP (gemm {r['gemm_tflop']:.2f}, attention {r['attention_tflop']:.2f})"
             + (f", flex tile fraction {r['flex_tile_fraction']}" if r["flex_tile_fraction"] is not None else "")
             + f"; non-matmul bytes {r['nonmatmul_gb']:.1f} GB",
             f"  est. step time: H100 SXM {g(r['est_ms']['h100'])} ms, H200 {g(r['est_ms']['h200'])} ms"
             + (f" (measured on an H200: {r['measured_ms']['h200']} ms, {r['error_vs_measured']:+.1%})"
                if r["measured_ms"] else ""),
             "", "| class | ops | launches | TFLOP | GB | H100 ms | H200 ms | H200 share |"
             + (" H200 profile ms |" if r["profile_h200_ms"] else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if r["profile_h200_ms"] else "")]
    total = r["est_ms"]["h200"] or 1.0
    for k, row in r["classes"].items():
        line = (f"| {k} | {row['ops']:,} | {row['launches']:,} | {row['tflop']:.2f} | {row['gb']:.1f} | "
                f"{row['est_ms_h100']:.1f} | {row['est_ms_h200']:.1f} | {row['est_ms_h200'] / total:.1%} |")
        if r["profile_h200_ms"]:
            p = r["profile_h200_ms"].get(k)
            line += f" {p if p is not None else '-'} |"
        lines.append(line)
    lines.append(f"| total | {r['ops']:,} | {r['launches']:,} | {r['matmul_tflop']:.2f} | "
                 f"{sum(v['gb'] for v in r['classes'].values()):.1f} | {r['est_ms']['h100']:.1f} | "
                 f"{r['est_ms']['h200']:.1f} | 100% |" + (f" {r['profile_h200_ms']['total']} |"
                                                         if r["profile_h200_ms"] else ""))
    for title, key, fmt in (("by count", "by_count", lambda o: f"{o['count']:,}"),
                            ("by bytes", "by_bytes", lambda o: f"{o['gb']:.1f} GB")):
        lines += ["", f"top {TOP} ops {title}: " + ", ".join(f"{o['op']} {fmt(o)}" for o in r["top_ops"][key])]
    if r["casts"]:
        lines.append("casts: " + ", ".join(f"{k} {v}" for k, v in r["casts"].items()))
    c = r["constants"]
    lines += ["", f"compiled regions: {r['compiled_regions']}",
              f"constants: launch {c['launch_us']} us, HBM efficiency {c['mem_eff']} (assumed), gemm {c['gemm_eff']}, "
              f"SDPA attention {c['sdpa_eff']}, flex attention {c['flex_eff']} (fitted on {c['fitted_on']}); "
              "peaks 989 TFLOP/s bf16, 494.7 TF32, 66.9 fp32; HBM 3.35 TB/s (H100 SXM), 4.8 TB/s (H200)"]
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def _setting(recipe: Any, dotted: str) -> tuple[Any, str]:
    section, key = dotted.split(".")
    return getattr(recipe, section), key


def as_measured(recipe: Any) -> None:
    """Set ``recipe`` to the step the H200 figures were measured on (:data:`MEASURED_STEP`): the
    chunked torch loss, eager decoder layers, unpacked rows and full attention (no
    ``draft.sliding_window``), for the keys the recipe has; :func:`count_step` then also counts
    RMSNorm written out (``fused_norm=False``), as the measured code's transformers ``LlamaRMSNorm`` ran."""
    for dotted, value in MEASURED_STEP.items():
        section, key = _setting(recipe, dotted)
        if hasattr(section, key):
            setattr(section, key, value)


def measured_step_differences(recipe: Any) -> list[str]:
    """The ``KEY=VALUE`` settings of :data:`MEASURED_STEP` that ``recipe`` does not have (empty:
    it is the measured step)."""
    out = []
    for dotted, value in MEASURED_STEP.items():
        section, key = _setting(recipe, dotted)
        if hasattr(section, key) and getattr(section, key) != value:
            out.append(f"{dotted}={'null' if value is None else str(value).lower()}")
    return out


def is_as_measured(recipe: Any) -> bool:
    """Whether ``recipe`` is the step the H200 figures were measured on (:func:`as_measured`)."""
    return not measured_step_differences(recipe)


def norm_written_out(recipe: Any) -> bool:
    """Whether the count takes RMSNorm written out, as the measured code ran it: the chunked loss and
    eager layers (``train.fused_loss`` and ``train.compile`` false)."""
    return getattr(recipe.train, "fused_loss", False) is False and getattr(recipe.train, "compile", False) is False


def measured_count(name: str, attention: str, B: int, T: int, args: argparse.Namespace) -> tuple[Any, ...]:
    """``(recipe, count, source, launcher, precision)`` of the step the H200 figures of ``name``
    with ``attention`` at ``B x T`` were measured on (:func:`as_measured`)."""
    ns = argparse.Namespace(**{**vars(args), "attention": attention, "batch_size": B, "max_length": T,
                               "launcher": None, "target_config": None})
    recipe, config_json, source, launch = load(name, [], ns)
    as_measured(recipe)
    precision = Precision.of(launch, getattr(args, "precision", "auto"))
    count = count_step(recipe, config_json, precision, fused_norm=False)
    return recipe, count, source, launch, precision


def reduce_count(count: StepCount) -> dict[str, Any]:
    """``count`` as :data:`MEASURED_COUNTS` keeps a step: per class outside gemm and attention
    ``(ops, launches, bytes)``, and the gemm / attention op groups ``(class, backend, peak, FLOPs,
    bytes, launches, count)``; the roofline's estimate of either is the same."""
    other: dict[str, list[int]] = {}
    for st in count.stats:
        if st.cls not in MATMUL_CLASSES:
            row = other.setdefault(st.cls, [0, 0, 0])
            row[0] += st.count
            row[1] += st.count * st.launches
            row[2] += st.count * st.bytes
    matmul = sorted(((st.cls, st.attention, st.rate, st.flops, st.bytes, st.launches, st.count)
                     for st in count.stats if st.cls in MATMUL_CLASSES), key=lambda t: (t[0] != "gemm", -t[3], t))
    return {"other_classes": {k: tuple(other[k]) for k in CLASSES if k in other}, "matmul": tuple(matmul)}


def snapshot_count(snapshot: dict[str, Any]) -> StepCount:
    """A :class:`StepCount` the roofline estimates as the step :func:`reduce_count` reduced: one op
    group per class outside gemm and attention (its ops, at their mean launches and bytes)."""
    stats = [OpStat(f"{cls} ops", cls, 0, nbytes / ops, launches / ops, "", "", count=ops)  # type: ignore[arg-type]
             for cls, (ops, launches, nbytes) in snapshot["other_classes"].items()]
    stats += [OpStat(f"{cls} op", cls, flops, nbytes, launches, rate, attention, count=n)
              for cls, attention, rate, flops, nbytes, launches, n in snapshot["matmul"]]
    return StepCount(stats=stats, views=0, host_syncs=0, casts={}, flex_fraction=None, flex_readable=True,
                     trainable_parameters=0, seconds=0.0, extra={"loss_path": "chunked", "compiled_layers": False})


def measured_snapshots() -> dict[tuple[str, str, int, int], StepCount]:
    """The measured steps the constants are fitted on (:data:`MEASURED_COUNTS`)."""
    return {key: snapshot_count(snap) for key, snap in MEASURED_COUNTS.items()}


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Refit the constants on the calibration recipe's measured steps (both backends,
    :data:`MEASURED_COUNTS`), recount the same steps with today's code (:func:`as_measured`) and
    return the fit, the fit today's count would give, the difference of the two counts and today's
    estimates under the fit (``--calibrate``)."""
    name, B, T = CALIBRATION
    keys = [(name, attention, B, T) for attention in ("sdpa", "flex")]
    snapshots = measured_snapshots()
    fitted = fit_constants([(snapshots[k], k[1], H200_PROFILE[k]) for k in keys])
    today, rows, drift = {}, [], {}
    for key in keys:
        recipe, count, source, launch, precision = measured_count(*key, args)
        today[key] = count
        rows.append(report(recipe, count, key[1], B, T, source, launch, precision, fitted))
        then, now = MEASURED_COUNTS[key], reduce_count(count)
        drift[key[1]] = {
            "ops": [sum(v[0] for v in then["other_classes"].values()) + sum(t[6] for t in then["matmul"]),
                    sum(v[0] for v in now["other_classes"].values()) + sum(t[6] for t in now["matmul"])],
            "nonmatmul_gb": [round(sum(v[2] for v in then["other_classes"].values()) / 1e9, 2),
                             round(sum(v[2] for v in now["other_classes"].values()) / 1e9, 2)],
            "est_ms_h200": [round(class_ms(snapshots[key], fitted)["total"], 1), round(class_ms(count, fitted)["total"], 1)]}
    refit = fit_constants([(today[k], k[1], H200_PROFILE[k]) for k in keys])
    return {"fitted": asdict(fitted), "baked": asdict(FITTED), "today": asdict(refit), "drift": drift, "rows": rows}


# ---------------------------------------------------------------------------------------------
# how well the constants predict a profile they were not fitted on


PROFILE_CLASSES = ("gemm", "attention", "copy/cast", "elementwise", "softmax/loss", "reductions")
SCORED = (*PROFILE_CLASSES, "non-matmul", "total")  # non-matmul: total - gemm - attention (launch_us's target)
SPLITS = ("recipe", "profile")


def class_ms(count: StepCount, c: Constants) -> dict[str, float]:
    """Estimated H200 kernel ms of one counted step by :data:`SCORED` class (NaN where a constant is)."""
    rows = breakdown(count, c)
    out = {k: rows[k]["est_ms_h200"] for k in PROFILE_CLASSES}
    out["non-matmul"] = sum(row["est_ms_h200"] for k, row in rows.items() if k not in MATMUL_CLASSES)
    out["total"] = sum(row["est_ms_h200"] for row in rows.values())
    return out


def profile_ms(key: tuple[str, str, int, int]) -> dict[str, float]:
    p = H200_PROFILE[key]
    return {**{k: p[k] for k in PROFILE_CLASSES}, "non-matmul": p["total"] - p["gemm"] - p["attention"],
            "total": p["total"]}


def leave_one_out(counts: dict[tuple[str, str, int, int], StepCount] | None = None,
                  split: str = "recipe") -> list[dict[str, Any]]:
    """Hold out each recipe (``split="recipe"``: all its profiles) or each profile (``"profile"``) of
    the measured steps (``counts``, default :func:`measured_snapshots`),
    fit the constants on the other profiles (:func:`fit_constants`, nothing borrowed from
    :data:`FITTED`: a constant they cannot identify is NaN) and estimate the held-out profiles by
    class. One row per held-out profile: the fold's constants, estimated and profiled ms and the
    relative error by :data:`SCORED` class (None where the fold cannot estimate the class)."""
    counts = measured_snapshots() if counts is None else counts
    group = (lambda k: k[0]) if split == "recipe" else (lambda k: k)  # noqa: E731
    rows = []
    for held in dict.fromkeys(group(k) for k in counts):
        train = [k for k in counts if group(k) != held]
        c = fit_constants([(counts[k], k[1], H200_PROFILE[k]) for k in train], fallback=None)
        for key in (k for k in counts if group(k) == held):
            est, prof = class_ms(counts[key], c), profile_ms(key)
            rows.append({"split": split, "held_out": "/".join(map(str, key)),
                         "fitted_on": ["/".join(map(str, k)) for k in train],
                         "constants": {k: (None if isinstance(v, float) and math.isnan(v) else v)
                                       for k, v in asdict(c).items()},
                         "est_ms": {k: (None if math.isnan(v) else round(v, 1)) for k, v in est.items()},
                         "profile_ms": {k: round(v, 1) for k, v in prof.items()},
                         "error": {k: (None if math.isnan(est[k]) else round(est[k] / prof[k] - 1, 3)) for k in SCORED}})
    return rows


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def format_leave_one_out(rows: list[dict[str, Any]]) -> str:
    """The leave-one-out rows as the two markdown tables docs/bench_step.md publishes: the relative
    error by class, then the estimated / profiled ms."""
    def const(c: dict[str, Any]) -> str:
        return " / ".join("-" if c[k] is None else str(c[k]) for k in ("launch_us", "gemm_eff", "sdpa_eff", "flex_eff"))

    lines = ["| split | held out | fitted on | launch µs / gemm / sdpa / flex | " + " | ".join(SCORED) + " |",
             "|---|---|---|---|" + "---:|" * len(SCORED)]
    for r in rows:
        lines.append(f"| {r['split']} | {r['held_out']} | {', '.join(r['fitted_on'])} | {const(r['constants'])} | "
                     + " | ".join(_pct(r["error"][k]) for k in SCORED) + " |")
    lines += ["", "| split | held out | " + " | ".join(SCORED) + " |", "|---|---|" + "---:|" * len(SCORED)]
    for r in rows:
        lines.append(f"| {r['split']} | {r['held_out']} | " + " | ".join(
            f"{'n/a' if r['est_ms'][k] is None else r['est_ms'][k]} / {r['profile_ms'][k]}" for k in SCORED) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# predictions frozen before a GPU scores them (docs/bench_step.md, "Predictions, frozen 2026-11-29")


FROZEN_ON = "2026-11-29"
# (label, recipe, --set overrides): the default step of each recipe, and two gptoss120b geometries never profiled
PREDICTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("gptoss120b default", "gptoss120b", ()),
    ("llama3_1_8b default", "llama3_1_8b", ()),
    ("gptoss120b 1 x 4096", "gptoss120b", ("train.batch_size=1", "data.max_length=4096")),
    ("gptoss120b 4 x 2048", "gptoss120b", ("train.batch_size=4", "data.max_length=2048")),
)
PREDICTED = ("gemm", "attention", "copy/cast", "elementwise", "softmax/loss", "reductions", "optimizer", "non-matmul",
             "total")
# the pass band of each predicted H200 kernel-ms figure (relative, either way); None: no band (the class
# boundaries of an aten count and of a kernel-name profile differ there: only their sum, non-matmul, is scored)
BANDS: dict[str, float | None] = {"gemm": 0.10, "attention": 0.30, "copy/cast": None, "elementwise": None,
                                  "softmax/loss": None, "reductions": None, "optimizer": None, "non-matmul": 0.35,
                                  "total": 0.20}


def prediction(label: str, name: str, sets: tuple[str, ...], constants: Constants = FITTED) -> dict[str, Any]:
    """One frozen prediction: the step ``draftsmith bench step recipes/NAME.yaml --set ...`` counts
    and its estimated H200 kernel ms by :data:`PREDICTED` class (H100 total beside)."""
    args = argparse.Namespace(precision="auto", attention=None, batch_size=None, max_length=None, launcher=None,
                              target_config=None)
    recipe, config_json, source, launch = load(name, list(sets), args)
    r = measure(recipe, config_json, source, launch, Precision.of(launch, "auto"), constants)
    ms = {k: round(r["classes"].get(k, {}).get("est_ms_h200", 0.0), 1) for k in PREDICTED[:-2]}
    ms["non-matmul"] = round(r["est_ms"]["h200"] - sum(r["classes"].get(k, {}).get("est_ms_h200", 0.0)
                                                       for k in MATMUL_CLASSES), 1)
    ms["total"] = r["est_ms"]["h200"]
    return {"label": label, "recipe": name, "sets": list(sets), "attention": r["attention"], "B": r["B"], "T": r["T"],
            "ops": r["ops"], "nonmatmul_gb": r["nonmatmul_gb"], "est_ms_h200": ms, "est_ms_h100": r["est_ms"]["h100"],
            "command": prediction_command(name, sets)}


def prediction_command(name: str, sets: tuple[str, ...]) -> str:
    return " ".join(["draftsmith bench step", f"recipes/{name}.yaml", *(f"--set {s}" for s in sets), "--json"])


def format_predictions(rows: list[dict[str, Any]]) -> str:
    """The frozen predictions as docs/bench_step.md's table: H200 kernel ms by class, with the bands."""
    band = lambda k: "-" if BANDS[k] is None else f"±{BANDS[k]:.0%}"  # noqa: E731
    lines = ["| step | attention | B x T | ops | non-matmul GB | " + " | ".join(PREDICTED) + " | H100 total |",
             "|---|---|---|---:|---:|" + "---:|" * (len(PREDICTED) + 1)]
    for r in rows:
        lines.append(f"| {r['label']} | {r['attention']} | {r['B']} x {r['T']} | {r['ops']:,} | {r['nonmatmul_gb']} | "
                     + " | ".join(f"{r['est_ms_h200'][k]}" for k in PREDICTED) + f" | {r['est_ms_h100']} |")
    lines.append("| pass band | | | | | " + " | ".join(band(k) for k in PREDICTED) + " | - |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(prog="draftsmith bench step", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("recipe", nargs="?", help="recipe YAML, or a name under recipes/ (gptoss120b)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.attention_backend=flex (repeatable)")
    p.add_argument("--attention", choices=["sdpa", "flex"],
                   help="train.attention_backend to count (default: the recipe's, as it resolves on CUDA: auto is flex)")
    p.add_argument("--target-config", type=Path,
                   help="the target's config.json (default: the copy under recipes/targets/; never weights)")
    p.add_argument("--batch-size", type=int, help="micro-batch B (default: train.batch_size)")
    p.add_argument("--max-length", type=int, help="sequence length T (default: data.max_length)")
    p.add_argument("--launcher", type=Path, help="accelerate launcher YAML (default: the recipe's `launcher`)")
    p.add_argument("--precision", choices=["auto", "fp32", "amp-bf16", "bf16"], default="auto",
                   help="auto: the launcher's (bf16 autocast; bf16 weights under DeepSpeed; fp32 without mixed precision)")
    p.add_argument("--as-measured", action="store_true",
                   help="count the step the H200 figures were measured on: " + ", ".join(MEASURED_SETS)
                        + " (the keys the recipe has), RMSNorm written out")
    p.add_argument("--calibrate", action="store_true",
                   help=f"refit the constants on {CALIBRATION[0]} (sdpa and flex) against the H200 profile and print "
                        "the fit (no RECIPE)")
    p.add_argument("--leave-one-out", action="store_true",
                   help="hold out each profiled recipe, then each profile, fit the constants on the rest and print "
                        "the held-out profiles' errors by class (no RECIPE)")
    p.add_argument("--predictions", action="store_true",
                   help=f"count the steps of the predictions frozen on {FROZEN_ON} (docs/bench_step.md) and print "
                        "their table (no RECIPE)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """``draftsmith bench step``; exit 0, 1 on a bad target config / length / launcher, 2 on a bad recipe."""
    from draftsmith.runtime import setup_logging
    from draftsmith.recipe import RecipeError
    from draftsmith.train.launchers import LauncherError

    p = build_parser()
    args = p.parse_args(argv)
    setup_logging()
    if args.calibrate:
        result = calibrate(args)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"fitted on the measured steps' counts (MEASURED_COUNTS): {result['fitted']}\n"
                  f"baked (FITTED):                                          {result['baked']}\n"
                  f"fitted on today's code's count of the same steps:        {result['today']}")
            for attention, d in result["drift"].items():
                print(f"{attention}: ops {d['ops'][0]:,} -> {d['ops'][1]:,}, non-matmul GB {d['nonmatmul_gb'][0]} -> "
                      f"{d['nonmatmul_gb'][1]}, est. H200 ms {d['est_ms_h200'][0]} -> {d['est_ms_h200'][1]} "
                      "(measured step's count -> today's)")
            for r in result["rows"]:
                print()
                print(format_report(r))
        return 0
    if args.leave_one_out:
        rows = [row for split in SPLITS for row in leave_one_out(split=split)]
        print(json.dumps({"rows": rows}) if args.json else format_leave_one_out(rows))
        return 0
    if args.predictions:
        rows = [prediction(*p_) for p_ in PREDICTIONS]
        print(json.dumps({"frozen_on": FROZEN_ON, "constants": asdict(FITTED), "bands": BANDS, "rows": rows})
              if args.json else "\n".join([*(r["command"] for r in rows), "", format_predictions(rows)]))
        return 0
    if not args.recipe:
        p.error("RECIPE is required (or --calibrate, --leave-one-out, --predictions)")
    for key in ("batch_size", "max_length"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    try:
        recipe, config_json, source, launch = load(args.recipe, list(args.overrides), args)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, LauncherError) as exc:
        print(f"draftsmith bench step: error: {exc}", file=sys.stderr)
        return 1
    if args.as_measured:
        as_measured(recipe)
    precision = Precision.of(launch, args.precision)
    result = measure(recipe, config_json, source, launch, precision)
    print(json.dumps(result) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
