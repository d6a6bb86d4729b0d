"""Benchmark: hidden-state capture vs a plain target forward on the same batch (tokens/s).

    python -m draftsmith.eval.bench_hidden_states [--target embedded:SmolLM2-135M-Instruct] [--batch 4] [--seq 512]
        [--device cuda:0]

Prints tokens/s for (a) the plain causal-LM forward (``model(input_ids)``, logits included),
(b) the decoder stack alone (``model.model(input_ids)``, no lm_head), (c) draftsmith's capture
(decoder stack + pre-hooks on the three aux layers, no lm_head), and the ratio of (c) to (a)
and to (b); (b) isolates what the hooks and the copies of the aux states cost. Median of ``--repeats`` interleaved timed rounds after one warm-up round.
The model runs on ``--device`` (default: this process's accelerator); on a GPU each timed call
ends with a synchronisation, so the times cover the kernels, not just their launch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..data_prep.capture import capture_batch
from ..data_prep.target import DEVICE_HELP, default_aux_layer_ids, load_target, resolve_target


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


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``eval/bench_hidden_states.py``."""
    from ..cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target", default="embedded:SmolLM2-135M-Instruct",
                   help="target dir, hub id or embedded:SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=4, help="sequences per forward pass")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes")
    p.add_argument("--dtype", default="float32", help="target dtype (a torch dtype name)")
    p.add_argument("--device", help=DEVICE_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = resolve_target(args.target)
    model, _ = load_target(path, getattr(torch, args.dtype), device=args.device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq)).to(model.device)
    att = torch.ones_like(ids)
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
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
