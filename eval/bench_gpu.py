"""GPU benchmark: target hidden-state capture and EAGLE-3 training at Llama-3.1-8B geometry.

    python -m draftsmith.eval.bench_gpu [--geometry llama3_8b] [--device cuda] [--seq-len 2048] [--batch 1]
        [--ttt-steps 7] [--draft-vocab 32000] [--steps 10] [--warmup 3] [--peak-tflops 790] [--out results.json]
    python -m draftsmith.eval.bench_gpu --geometry tiny --device cpu     # the same code path on a CPU, in seconds

The target is a random-init ``LlamaForCausalLM`` built in code from the geometry (no download).
``llama3_8b``: H 4096, 32 layers, MLP 14336, 32 query / 8 key-value heads of 128, V 128256,
RoPE theta 500000 with Llama-3.1's scaling: 8.0B parameters, 16 GB in bf16. Random weights give
real speed and memory figures, not acceptance. Aux layers are vLLM's default ``(2, N//2, N-3)``,
``(2, 16, 29)`` for N = 32.

Rows (each: ``--warmup`` untimed iterations, then ``--steps`` timed ones; CUDA events, tokens/s =
batch x seq-len / mean step time), all on the same random ``(batch, seq-len)`` token batch:

- ``plain forward``: ``model(input_ids)``, logits over the full vocabulary, no KV cache.
- ``decoder only``: the decoder stack without ``lm_head``.
- ``capture``: draftsmith's :func:`~draftsmith.data_prep.capture.capture_batch`: the decoder
  stack with pre-hooks on the aux layers, returning aux ``(B, T, 3H)`` and final normed ``(B, T, H)``
  states. The three forward rows run under ``torch.no_grad`` alike.
- ``EAGLE-3 train online``: per step, ``capture_batch`` on the target (no grad), then the
  training step below.
- ``EAGLE-3 train offline``: the aux and final states are precomputed once and kept on the device
  in the target dtype, i.e. what a batch read from the bf16 shards gives once moved to the GPU;
  the disk read and the host-to-device copy are NOT timed. The target is freed first, so the peak
  memory is the draft's alone.

The training step is the trainer's work per micro-batch (``train/eagle3.py`` under a launcher with
``mixed_precision: bf16``): :class:`~draftsmith.models.eagle3.Eagle3DraftModel` (fp32 parameters)
forward with TTT under bf16 autocast (fp32 without autocast when the dtype is float32), the
target distribution from :class:`~draftsmith.train.losses.TargetDraftHead` (fp32) and
:func:`~draftsmith.train.losses.ttt_loss` outside autocast, backward, gradient clipping at 0.5
and an AdamW step. Every position is a trained (assistant) token: the upper bound of the
``lm_head`` and loss work; real data trains on the assistant share of each row only.

FLOP counts (``MFU`` = achieved FLOP/s / ``--peak-tflops``; B batch, T seq-len, N = B*T tokens,
L target layers, d = heads * head_dim, K TTT steps):

- a Linear-layer forward over n tokens: ``2 * P * n``, P = the weights of its ``nn.Linear``
  modules (embedding lookups, norms, RoPE, softmax are not counted); training (forward +
  backward): ``6 * P * n``.
- causal attention forward, per layer and sequence: ``2 * T^2 * d`` (QK^T and PV over the causal
  half; the masked half is not credited, even where a kernel computes it); training 3x that.
- capture / decoder only: ``2 * P_decoder * N + L * B * 2 T^2 d``; plain forward adds
  ``2 * P_lm_head * N``.
- EAGLE-3 training step: ``6 * P_fc * N + sum_k 6 * (P_layer * N + P_lm_head * M_k)`` plus
  attention ``sum_k B * 3 * (2 T^2 d + 4 T d k)`` (step 0's causal block and one diagonal per
  earlier step) plus the target distribution ``2 * H * Vd * N`` (fp32, no grad); ``M_k`` = the
  positions trained at step k (N minus the ``k + 2`` last of each row). Online adds the capture.

The default peak, 790 TFLOP/s, is the project's working figure for the dense bf16 peak of its
H100/H200 (GPU.md); NVIDIA's datasheets give 989 (H100 SXM, H200), 835 (H100 NVL) and 756
(H100 PCIe): pass ``--peak-tflops`` to rescale. On a CPU no peak is assumed unless given.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..data_prep.capture import capture_batch
from ..data_prep.target import default_aux_layer_ids
from ..models.eagle3 import Eagle3Config, Eagle3DraftModel, ttt_prediction_mask
from ..train.losses import TargetDraftHead, ttt_loss

LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}

# Target config (LlamaConfig keyword arguments) and the defaults of each geometry.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "llama3_8b": {
        "config": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                       rope_scaling=LLAMA31_ROPE_SCALING, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
        "seq_len": 2048, "batch": 1, "draft_vocab": 32000,
    },
    "tiny": {
        "config": dict(hidden_size=128, num_hidden_layers=8, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=2048, rope_theta=500000.0,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
        "seq_len": 128, "batch": 2, "draft_vocab": 512,
    },
}
DEFAULT_PEAK_TFLOPS_GPU = 790.0
LR, BETAS, MAX_GRAD_NORM, GAMMA = 1e-4, (0.9, 0.95), 0.5, 0.8  # the recipe defaults


@dataclass
class Row:
    """One measurement: ``tokens_per_s`` (batch x seq-len / mean step seconds), ``ms_per_step``,
    ``tflop_per_step`` (the count in the module docstring), ``tflops`` (achieved TFLOP/s),
    ``mfu`` (fraction of the peak; None without one) and ``peak_mem_gib``
    (``torch.cuda.max_memory_allocated`` over warm-up and timed steps; None on CPU)."""

    name: str
    tokens_per_s: float
    ms_per_step: float
    tflop_per_step: float
    tflops: float
    mfu: float | None
    peak_mem_gib: float | None


def linear_params(module: nn.Module) -> int:
    """Weights of every ``nn.Linear`` inside ``module`` (the matmul parameters)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def causal_attention_flops(batch: int, seq_len: int, width: int, layers: int = 1) -> float:
    """Forward FLOPs of causal self-attention: ``2 * T^2 * d`` per layer and sequence."""
    return 2.0 * batch * layers * seq_len**2 * width


def forward_flops(target: nn.Module, batch: int, seq_len: int, with_lm_head: bool) -> float:
    """Forward FLOPs of the target over ``(batch, seq_len)`` tokens (module docstring)."""
    cfg = target.config
    n = batch * seq_len
    flops = 2.0 * linear_params(target.get_decoder()) * n
    flops += causal_attention_flops(batch, seq_len, cfg.num_attention_heads * cfg.head_dim, cfg.num_hidden_layers)
    if with_lm_head:
        flops += 2.0 * target.get_output_embeddings().weight.numel() * n
    return flops


def draft_train_flops(draft: Eagle3DraftModel, loss_mask: torch.Tensor, ttt_steps: int) -> float:
    """FLOPs of one EAGLE-3 training step (forward + backward of the draft, the target
    distribution) on a batch with ``loss_mask (B, T)`` (module docstring)."""
    cfg = draft.config
    B, T = loss_mask.shape
    n = B * T
    width = cfg.num_attention_heads * cfg.head_dim
    p_layer = linear_params(draft.layers[0])
    flops = 6.0 * draft.fc.weight.numel() * n + 2.0 * cfg.hidden_size * cfg.draft_vocab_size * n
    for k in range(ttt_steps):
        m_k = int(ttt_prediction_mask(loss_mask, k).sum())
        flops += 6.0 * (p_layer * n + draft.lm_head.weight.numel() * m_k)
        flops += 3.0 * (causal_attention_flops(B, T, width) + 4.0 * B * T * width * k)
    return flops


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn: Callable[[], Any], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed calls (CUDA events on
    a GPU, ``perf_counter`` around a synchronised call elsewhere)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1000.0 for start, end in events]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def measure(name: str, fn: Callable[[], Any], flop_per_step: float, tokens: int, args: argparse.Namespace,
            device: torch.device, peak_tflops: float | None) -> Row:
    """Time ``fn`` (warm-up excluded) and record its peak device memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(fn, args.steps, args.warmup, device)
    mean = sum(times) / len(times)
    tflops = flop_per_step / mean / 1e12
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = Row(name, tokens / mean, 1e3 * mean, flop_per_step / 1e12, tflops,
              tflops / peak_tflops if peak_tflops else None, peak)
    print(f"  measured {name}: {row.tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)
    return row


def build_target(geometry: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A random-init ``LlamaForCausalLM`` of ``geometry``, created directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**GEOMETRIES[geometry]["config"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def build_draft(target: nn.Module, draft_vocab: int, aux_layer_ids: list[int], device: torch.device
                ) -> tuple[Eagle3DraftModel, TargetDraftHead]:
    """The EAGLE-3 draft for ``target`` as ``train/eagle3.py`` builds it (fp32 parameters, frozen
    target embedding, ``lm_head`` and ``norm`` started from the target's), with a random draft
    vocab of ``draft_vocab`` target ids; and the fp32 target head over that vocab."""
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values  # (Vd,) target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(draft_vocab)  # offsets: target_id = i + d2t[i]
    with torch.device(device):
        draft = Eagle3DraftModel(Eagle3Config.from_target(target.config, draft_vocab, aux_layer_ids))
    t2d = t2d.to(device)
    head = TargetDraftHead.from_full(target.get_output_embeddings().weight, t2d).float()
    draft.init_from_target(target.get_input_embeddings().weight.float(), head.weight,
                           target.get_decoder().norm.weight.float())
    draft.set_vocab_mapping(d2t.to(device), t2d)
    return draft, head


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1))
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the target and draft, measure every row; returns what ``--out`` stores."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    geo = GEOMETRIES[args.geometry]
    B, T = args.batch or geo["batch"], args.seq_len or geo["seq_len"]
    Vd = min(args.draft_vocab or geo["draft_vocab"], geo["config"]["vocab_size"])
    K = args.ttt_steps
    peak = args.peak_tflops if args.peak_tflops else (DEFAULT_PEAK_TFLOPS_GPU if device.type == "cuda" else None)
    torch.manual_seed(0)

    target = build_target(args.geometry, dtype, device)
    cfg = target.config
    aux_ids = default_aux_layer_ids(cfg.num_hidden_layers)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    att = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    n = B * T
    setup = {"geometry": args.geometry, "dtype": str(dtype).removeprefix("torch."), "batch": B, "seq_len": T,
             "ttt_steps": K, "draft_vocab": Vd, "aux_layer_ids": aux_ids, "steps": args.steps, "warmup": args.warmup,
             "peak_tflops": peak, "target_params": sum(p.numel() for p in target.parameters()),
             "target_weights_gib": sum(p.numel() * p.element_size() for p in target.parameters()) / 2**30,
             "attn_implementation": getattr(cfg, "_attn_implementation", None)}
    rows = []

    def plain():
        with torch.no_grad():
            target(input_ids=ids, attention_mask=att, use_cache=False)

    def decoder_only():
        with torch.no_grad():
            target.get_decoder()(input_ids=ids, attention_mask=att, use_cache=False)

    def capture():
        capture_batch(target, ids, att, aux_ids)

    fwd, fwd_lm = forward_flops(target, B, T, False), forward_flops(target, B, T, True)
    rows.append(measure("target plain forward (logits)", plain, fwd_lm, n, args, device, peak))
    rows.append(measure("target decoder only (no lm_head)", decoder_only, fwd, n, args, device, peak))
    rows.append(measure(f"capture aux {tuple(aux_ids)} + final", capture, fwd, n, args, device, peak))

    draft, target_head = build_draft(target, Vd, aux_ids, device)
    params = [p for p in draft.parameters() if p.requires_grad]
    setup["draft_trainable_params"] = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0)
    autocast = dtype != torch.float32

    def train_step(aux: torch.Tensor, final: torch.Tensor) -> None:
        target_logits = target_head(final)  # (B, T, Vd) fp32, as Eagle3Method.compute_loss
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):  # accelerate's mixed_precision
            step_logits = draft(ids, aux.to(params[0].dtype), K, loss_mask)  # K x (M_k, Vd)
        loss, _ = ttt_loss(step_logits, target_logits, loss_mask, GAMMA)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def online():
        train_step(*capture_batch(target, ids, att, aux_ids))

    train = draft_train_flops(draft, loss_mask, K)
    rows.append(measure(f"EAGLE-3 train online (TTT {K})", online, train + fwd, n, args, device, peak))

    aux, final = capture_batch(target, ids, att, aux_ids)  # (B, T, 3H), (B, T, H) in the target dtype
    del target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows.append(measure(f"EAGLE-3 train offline (TTT {K})", lambda: train_step(aux, final), train, n, args, device,
                        peak))
    return {"environment": environment(device), "setup": setup, "rows": [asdict(r) for r in rows],
            "capture_vs_plain_forward": rows[2].tokens_per_s / rows[0].tokens_per_s,
            "capture_vs_decoder_only": rows[2].tokens_per_s / rows[1].tokens_per_s}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_table(result: dict[str, Any]) -> str:
    env, s = result["environment"], result["setup"]
    peak = f"MFU vs {s['peak_tflops']:g} TFLOP/s" if s["peak_tflops"] else "no MFU (no --peak-tflops)"
    lines = [
        f"torch {env['torch']}, CUDA {env['cuda']}, transformers {env['transformers']}; device {env['device']}"
        + (f" ({env['device_memory_gib']} GiB)" if "device_memory_gib" in env else ""),
        f"target: random-init Llama, {s['geometry']} geometry, {_count(s['target_params'])} parameters, "
        f"{s['target_weights_gib']:.2f} GiB of {s['dtype']} weights, attention {s['attn_implementation']}; "
        f"EAGLE-3 draft {_count(s['draft_trainable_params'])} trainable parameters, draft vocab {s['draft_vocab']}",
        f"batch {s['batch']} x seq {s['seq_len']}, TTT {s['ttt_steps']}, aux layers {s['aux_layer_ids']}; "
        f"{s['steps']} timed steps after {s['warmup']} warm-up; {peak}",
        "",
        "| measurement | tok/s | ms/step | TFLOP/step | TFLOP/s | MFU | peak mem GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {r['tflop_per_step']:.3g} "
                     f"| {r['tflops']:.3g} | {mfu} | {mem} |")
    lines += ["",
              f"capture / plain forward: {result['capture_vs_plain_forward']:.2f}x tok/s; capture / decoder only: "
              f"{result['capture_vs_decoder_only']:.2f}x",
              "offline = aux/final states already on the device (disk read and host-to-device copy not timed); "
              "online = target forward (no grad) inside each step; the peak memory of the forward and online rows "
              "includes the target weights, offline's does not (target freed)"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``eval/bench_gpu.py``."""
    from ..cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3_8b",
                   help="draft / target shapes to benchmark")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="target dtype and draft autocast dtype; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2048 llama3_8b, 128 tiny)")
    p.add_argument("--batch", type=int, help="sequences per step (default: 1 llama3_8b, 2 tiny)")
    p.add_argument("--ttt-steps", type=int, default=7, help="unrolled TTT steps K")
    p.add_argument("--draft-vocab", type=int, help="draft vocab size Vd (default: 32000 llama3_8b, 512 tiny)")
    p.add_argument("--steps", type=int, default=10, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations before each row")
    p.add_argument("--peak-tflops", type=float, help=f"dense bf16 peak for MFU (default {DEFAULT_PEAK_TFLOPS_GPU:g} "
                   "on CUDA, none on CPU)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for key in ("seq_len", "batch", "draft_vocab", "steps", "ttt_steps"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU run `--geometry tiny --device cpu`", file=sys.stderr)
        return 2
    result = run(args)
    print(format_table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
