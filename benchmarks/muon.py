"""The demo's training step with AdamW, with torch's Muon (bf16 Newton-Schulz) and with draftsmith's Muon.

    python -m benchmarks.muon [--recipe smollm2_135m] [--steps 3] [--warmup 1] [--batch-size B]
        [--max-length T] [--device cpu] [--set KEY=VALUE ...] [--out bench_muon.json]
    make bench-muon

``train.optimizer: muon`` steps AdamW over the draft's norms / embeddings / head and Muon over its
hidden matrices. torch's ``torch.optim.Muon`` runs its 5 Newton-Schulz iterations in bf16, which a
CPU without native bf16 (AVX2, no AVX-512 bf16 / AMX) computes 20x slower than fp32: the demo's
step took 28 s instead of about 4. :class:`draftsmith.train.optim.Muon` runs them in the dtype
:func:`~draftsmith.train.optim.newton_schulz_dtype` detects for the device (fp32 there).

Three rows, the recipe's step each (default ``recipes/smollm2_135m.yaml``, EAGLE-3 on
SmolLM2-135M: its draft at the target's true geometry with random weights, its
``train.batch_size x data.max_length`` micro-batch, every position real and trained), built as
``make bench-gpu`` builds it (:func:`benchmarks.gpu.load_bench_recipe`,
:func:`benchmarks.memory.prepare_model`, the launcher's precision) and stepped as the trainer
steps it (forward and loss, backward, clipping, the non-finite guard, the optimizers):

- ``adamw``: ``train.optimizer: adamw`` (fused AdamW over every trainable parameter);
- ``muon (torch, bf16 NS)``: ``train.optimizer: muon`` with torch's own ``torch.optim.Muon``;
- ``muon (draftsmith, <dtype> NS)``: ``train.optimizer: muon`` as the trainer builds it.

The three are built first, then run in rounds of one step each (``--warmup`` untimed rounds,
then ``--steps`` timed ones), the order rotating, so that a machine busy with other work slows
them alike. Per row the median ``ms/step`` (wall clock; CUDA: synchronised), the part of it in
the optimizer steps, the ratio to AdamW's step, and the CPU time of this process per step
(``time.process_time``; with ``--threads 1`` the step's work however busy the machine is). The
bar: draftsmith's Muon within 1.3x AdamW's step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

BAR = 1.3  # draftsmith's Muon step within this factor of AdamW's


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_step(stack: contextlib.ExitStack, recipe: Any, config_json: dict[str, Any], precision: Any,
               dev: torch.device, torch_muon: bool = False, seed: int = 0
               ) -> tuple[Callable[[int], tuple[float, float, float]], dict[str, Any]]:
    """The trainer's step of ``recipe`` (module docstring) as ``step(i) -> (seconds, seconds in
    the optimizers, CPU seconds of this process)``, and facts about it; with ``torch_muon`` the
    Muon optimizer is replaced by ``torch.optim.Muon`` over the same parameters with the same
    settings. The method's run directory lives as long as ``stack``."""
    from benchmarks.memory import _device_batch, offline_method, prepare_model, random_batch, random_weights, trainer_step

    torch.manual_seed(seed)
    cfg = recipe.train
    method = stack.enter_context(offline_method(recipe, config_json, getattr(torch, recipe.target.dtype),
                                                random_weights))
    H, V = int(method.target_info.hidden_size), int(method.target_info.vocab_size)
    model, trainable, optimizers = prepare_model(method, recipe, precision, dev, ns_dtype=None)  # detected
    ns = str(optimizers[-1].ns_dtype).removeprefix("torch.") if hasattr(optimizers[-1], "ns_dtype") else None
    if torch_muon:
        group = optimizers[-1].param_groups[0]
        optimizers[-1] = torch.optim.Muon(group["params"], **{k: v for k, v in group.items() if k != "params"})
        ns = "bfloat16"
    plan = method.batch_plan() if hasattr(method, "batch_plan") else None
    n_aux = len(method.target_info.aux_layer_ids)
    batch = _device_batch(random_batch(recipe, H, V, n_aux, fake=False, seed=seed), plan, dev, None, fake=False)
    forward_backward, update, _ = trainer_step(method, model, batch, trainable, optimizers, cfg, dev)

    def step(i: int) -> tuple[float, float, float]:
        _sync(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        forward_backward(i)
        _sync(dev)
        t1 = time.perf_counter()
        update()
        _sync(dev)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, time.process_time() - c0

    muon_params = sum(p.numel() for o in optimizers if isinstance(o, torch.optim.Muon)
                      for g in o.param_groups for p in g["params"])
    return step, {"ns_dtype": ns, "muon_parameters": muon_params,
                  "trainable_parameters": sum(p.numel() for p in trainable)}


# (row name, train.optimizer, torch's own Muon)
ROWS = (("adamw", "adamw", False), ("muon (torch, bf16 NS)", "muon", True),
        ("muon (draftsmith, detected NS)", "muon", False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the three rows' steps, then run them in rounds, one step of each per round (the order
    rotating), so that whatever else the machine runs slows them alike; medians per row."""
    from draftsmith.train.optim import newton_schulz_dtype
    from benchmarks.gpu import load_bench_recipe
    from benchmarks.memory import Precision

    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    detected, why = newton_schulz_dtype(dev)
    where = argparse.Namespace(target_config=args.target_config, batch_size=args.batch_size, max_length=args.max_length)
    rows, steps = [], []
    with contextlib.ExitStack() as stack:
        for name, optimizer, torch_muon in ROWS:
            recipe, config_json, _, launch = load_bench_recipe(
                args.recipe, list(args.set or []) + [f"train.optimizer={optimizer}"], where)
            precision = Precision.of(launch, args.precision)
            step, facts = build_step(stack, recipe, config_json, precision, dev, torch_muon)
            if optimizer == "muon" and not torch_muon:
                name = f"muon (draftsmith, {facts['ns_dtype']} NS)"
            rows.append({"name": name, "optimizer": optimizer, **facts, "batch_size": recipe.train.batch_size,
                         "max_length": recipe.data.max_length, "precision": precision.name, "seconds": [],
                         "optimizer_seconds": [], "cpu_seconds": []})
            steps.append(step)
        for i in range(args.warmup + args.steps):
            print(f"  round {i + 1} of {args.warmup + args.steps}{' (warm-up)' if i < args.warmup else ''} ...",
                  file=sys.stderr, flush=True)
            for k in range(len(rows)):
                j = (i + k) % len(rows)
                seconds, in_optimizers, cpu = steps[j](i)
                if i >= args.warmup:
                    rows[j]["seconds"].append(seconds)
                    rows[j]["optimizer_seconds"].append(in_optimizers)
                    rows[j]["cpu_seconds"].append(cpu)
    for r in rows:
        for key in ("seconds", "optimizer_seconds", "cpu_seconds"):
            r[f"{key}_per_step"] = statistics.median(r[key])
    for r in rows:
        r["vs_adamw"] = r["seconds_per_step"] / rows[0]["seconds_per_step"]
        r["cpu_vs_adamw"] = r["cpu_seconds_per_step"] / rows[0]["cpu_seconds_per_step"]
    return {"environment": {"torch": torch.__version__, "python": platform.python_version(), "device": str(dev),
                            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                            "detected_ns_dtype": str(detected).removeprefix("torch."), "detected_why": why},
            "settings": {"recipe": args.recipe, "steps": args.steps, "warmup": args.warmup,
                         "sets": list(args.set or [])},
            "rows": rows, "bar": BAR, "meets_bar": rows[2]["vs_adamw"] <= BAR}


def format_table(result: dict[str, Any]) -> str:
    env, s, rows = result["environment"], result["settings"], result["rows"]
    r0 = rows[0]
    lines = [f"torch {env['torch']}; device {env['device']} ({env['cpu']}, {env['threads']} threads); "
             f"Newton-Schulz dtype detected: {env['detected_ns_dtype']} ({env['detected_why']})",
             f"recipe {s['recipe']} at {r0['batch_size']} x {r0['max_length']} ({r0['precision']}); "
             f"median of {s['steps']} timed steps after {s['warmup']} warm-up, the rows interleaved", "",
             "| optimizer | ms/step | optimizer ms/step | x AdamW | CPU ms/step | x AdamW (CPU) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {1e3 * r['seconds_per_step']:,.0f} "
                     f"| {1e3 * r['optimizer_seconds_per_step']:,.0f} "
                     f"| {r['vs_adamw']:.2f} | {1e3 * r['cpu_seconds_per_step']:,.0f} | {r['cpu_vs_adamw']:.2f} |")
    verdict = "meets" if result["meets_bar"] else "MISSES"
    lines += ["", f"draftsmith's Muon: {rows[2]['vs_adamw']:.2f}x AdamW's step "
              f"({verdict} the bar of {result['bar']}x); "
              f"torch's Muon (bf16 Newton-Schulz): {rows[1]['vs_adamw']:.2f}x"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m benchmarks.muon", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--recipe", default="smollm2_135m", help="a recipe name under recipes/ or a YAML path")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.add_argument("--batch-size", type=int, help="micro-batch B (default: the recipe's train.batch_size)")
    p.add_argument("--max-length", type=int, help="sequence length T (default: the recipe's data.max_length)")
    p.add_argument("--target-config", type=Path, help="the target's config.json (default: the recipe's target)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=["auto", "fp32", "amp-bf16", "bf16"], default="auto",
                   help="auto: the recipe launcher's (fp32 without one)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's); with 1 the CPU "
                   "time is the step's work whatever else the machine runs")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--out", type=Path, help="write the results as one JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    for key in ("batch_size", "max_length"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    result = run(args)
    print(format_table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
