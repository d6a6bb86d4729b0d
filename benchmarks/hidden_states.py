"""Benchmark: hidden-state capture vs a plain target forward on the same batch (tokens/s).

    python -m benchmarks.hidden_states [--target embedded:SmolLM2-135M-Instruct] [--batch 4] [--seq 512]
        [--device cuda:0]

Prints tokens/s for (a) the plain causal-LM forward (``model(input_ids)``, logits included),
(b) the decoder stack alone (``model.model(input_ids)``, no lm_head), (c) draftsmith's capture
(decoder stack + pre-hooks on the three aux layers, no lm_head), and the ratio of (c) to (a)
and to (b); (b) isolates what the hooks and the copies of the aux states cost. Median of ``--repeats`` interleaved timed rounds after one warm-up round.
The model runs on ``--device`` (default: this process's accelerator); on a GPU each timed call
ends with a synchronisation, so the times cover the kernels, not just their launch.

    python -m benchmarks.hidden_states --capture-rss [--rss-tokens 32768 131072]
        [--rss-hidden 1024] [--shard-bytes 33554432] [--rss-dtype bfloat16]

measures the shard writer instead: ``generate_hidden_states`` with an engine that yields random
states (no model), once per ``--rss-tokens`` size, each in a fresh process. Prints the peak
resident memory over the start of the capture (``VmHWM`` reset just before it, in MB), the
shards written and the capture rate (tok/s): with a fixed ``--shard-bytes`` the peak stays flat
as the data grows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

from draftsmith.target.capture import capture_batch
from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.shards import ShardSpec, bytes_per_token
from draftsmith.target import DEVICE_HELP, aux_layer_ids, load_target, resolve_target
from benchmarks import subprocess_env


def _time_interleaved(fns: list, repeats: int, device: torch.device = torch.device("cpu")) -> list[float]:
    """Median seconds per call of each function, measured in interleaved rounds (one call of
    each per round, after one warm-up round) so that drift in machine speed hits all alike.
    On an accelerator each call is followed by a synchronisation (kernels run asynchronously)."""
    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    for fn in fns:
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            sync()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


class RandomStates:
    """A capture engine without a model: each record gets fresh random ``aux (T, 3H)`` and
    ``final (T, H)`` float32 states (copies of one pool, so generating them costs a memcpy)."""

    name = "random"

    def __init__(self, hidden_size: int, max_len: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self._aux = torch.randn(max_len, 3 * hidden_size, generator=g)
        self._final = torch.randn(max_len, hidden_size, generator=g)

    def capture(self, records: list[dict]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for j, r in enumerate(records):
            n = len(r["input_ids"])
            yield j, self._aux[:n].clone(), self._final[:n].clone()


def _status_mb(key: str) -> float:
    """``VmRSS`` / ``VmHWM`` (peak RSS since the last reset) of this process from /proc, in MB."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) / 1024


def capture_rss(tokens: int, hidden_size: int = 1024, shard_bytes: int = 32 << 20, dtype: str = "bfloat16",
                seq_len: int = 512, out_dir: str | None = None) -> dict:
    """Capture ``tokens`` tokens (records of ``seq_len``) of :class:`RandomStates` into shards of
    ``shard_bytes`` in this process and measure its peak resident memory during the capture:
    Linux's ``VmHWM`` is reset (``/proc/self/clear_refs``) just before, after the records and
    the engine exist, so the growth is what the capture itself holds. Shards go to ``out_dir``
    (default: a temporary directory, removed after).

    Returns:
        ``{"tokens", "hidden_size", "dtype", "shard_bytes", "shards", "start_mb", "peak_growth_mb",
        "tok_s"}``.
    """
    n = -(-tokens // seq_len)
    records = [{"id": str(i), "input_ids": [1] * seq_len, "loss_mask": [1] * seq_len} for i in range(n)]
    engine = RandomStates(hidden_size, seq_len)
    spec = ShardSpec(hidden_size, [0, 1, 2], dtype)
    with tempfile.TemporaryDirectory(dir=out_dir) as d:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
        start = _status_mb("VmRSS")
        m = generate_hidden_states(engine, records, Path(d), spec, sequences_per_shard=n, shard_bytes=shard_bytes,
                                   progress=False)
        peak = _status_mb("VmHWM")
    return {"tokens": n * seq_len, "hidden_size": hidden_size, "dtype": dtype, "shard_bytes": shard_bytes,
            "shards": len(m["shards"]), "start_mb": round(start, 1), "peak_growth_mb": round(peak - start, 1),
            "tok_s": round(m["throughput_tok_s"])}


# glibc raises its mmap threshold after each large free, so later record-sized buffers come from
# the heap and freed heap stays resident: the peak then measures the allocator's history (45 -> 55 MB
# for 32k -> 128k tokens here) more than what the capture holds (26 -> 26 MB with the threshold fixed)
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def measure_capture_rss(tokens: int, pin_malloc: bool = True, **kwargs) -> dict:
    """:func:`capture_rss` in a fresh Python process (nothing allocated before it skews the peak);
    ``pin_malloc``: with glibc's mmap threshold fixed at 1 MiB (:data:`PINNED_MALLOC`)."""
    code = ("import json, sys; from benchmarks.hidden_states import capture_rss; "
            "print(json.dumps(capture_rss(**json.loads(sys.argv[1]))))")
    env = subprocess_env(**(PINNED_MALLOC if pin_malloc else {}))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(dict(tokens=tokens, **kwargs))],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks/hidden_states.py``."""
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", default="embedded:SmolLM2-135M-Instruct",
                   help="target dir, hub id or embedded:SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=4, help="sequences per forward pass")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes")
    p.add_argument("--dtype", default="float32", help="target dtype (a torch dtype name)")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--capture-rss", action="store_true",
                   help="measure the shard writer's peak memory and rate instead (random states, no model)")
    p.add_argument("--rss-tokens", type=int, nargs="+", default=[32768, 131072],
                   help="--capture-rss: tokens captured, one fresh process per size")
    p.add_argument("--rss-hidden", type=int, default=1024, help="--capture-rss: hidden size H")
    p.add_argument("--rss-dtype", default="bfloat16", help="--capture-rss: shard storage dtype")
    p.add_argument("--shard-bytes", type=int, default=32 << 20, help="--capture-rss: bytes per shard")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.capture_rss:
        print(f"shard writer: random states, H={args.rss_hidden}, {args.rss_dtype} "
              f"({bytes_per_token(args.rss_hidden, args.rss_dtype)} B/token), shards of {args.shard_bytes} bytes")
        print(f"{'tokens':>9} {'shards':>6} {'start MB':>9} {'peak growth MB':>15} {'tok/s':>9}")
        for tokens in args.rss_tokens:
            r = measure_capture_rss(tokens, hidden_size=args.rss_hidden, shard_bytes=args.shard_bytes,
                                    dtype=args.rss_dtype)
            print(f"{r['tokens']:>9} {r['shards']:>6} {r['start_mb']:>9} {r['peak_growth_mb']:>15} {r['tok_s']:>9}")
        return 0
    path = resolve_target(args.target)
    model, _ = load_target(path, getattr(torch, args.dtype), device=args.device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq)).to(model.device)
    att = torch.ones_like(ids)
    layers = aux_layer_ids(None, model.config.num_hidden_layers)
    tokens = ids.numel()

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=att, use_cache=False)

    def decoder_only():
        with torch.inference_mode():
            model.model(input_ids=ids, attention_mask=att, use_cache=False)

    def capture():  # as the pipeline calls it (capture_batch runs under no_grad)
        capture_batch(model, ids, att, layers)

    t_plain, t_dec, t_cap = _time_interleaved([plain, decoder_only, capture], args.repeats, model.device)
    print(f"target {args.target} ({args.dtype}) on {model.device}, batch {args.batch} x {args.seq} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"plain forward      {tokens / t_plain:8.1f} tok/s")
    print(f"decoder, no lm_head {tokens / t_dec:7.1f} tok/s")
    print(
        f"capture aux+final  {tokens / t_cap:8.1f} tok/s   ratio {t_plain / t_cap:.2f} of plain forward speed, "
        f"{t_dec / t_cap:.2f} of the decoder without lm_head"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
