#!/usr/bin/env python
"""Is the simulated acceptance length worth trusting? Issue 17's check, on the machine it runs on.

    scripts/sim_vs_vllm.py RUN_DIR --sim-data PROMPT_DATA --prompts MT_BENCH --recipe RECIPE --target TARGET_DIR [--out OUT]

For every checkpoint of a training run (``checkpoints/step-N``, keep them with
``train.keep_checkpoints``, and ``checkpoints/best``): export it, simulate its acceptance length
(``draftsmith simulate``) on ``PROMPT_DATA``, a data folder prepared from the same prompts with the
target's greedy replies (``draftsmith prepare ... --set data.regenerate.max_new_tokens=128``), and
measure it in vLLM (``draftsmith acceptance``, T=0, the same prompts and new-token count). Prints a
markdown table (also the run's own held-out ``val_sim_al`` at that step from ``metrics.jsonl``) and
the Pearson correlation and largest gap between simulated and measured AL. Finished rows are kept
in ``OUT/rows.json``, so a stopped check continues.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson's r (:func:`statistics.correlation`); nan where it is undefined (a constant side)."""
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    from draftsmith.eval.acceptance import measure
    from draftsmith.eval.export import export
    from draftsmith.models.eagle3.simulate import simulate
    from draftsmith.recipe import load_recipe
    from draftsmith.train.checkpoint import BEST_NAME, find_checkpoints

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--sim-data", type=Path, required=True, help="prepared data folder of the prompts")
    p.add_argument("--prompts", required=True, help="the prompts of that data (vLLM acceptance)")
    p.add_argument("--recipe", type=Path, required=True, help="recipe whose vllm section runs the engine")
    p.add_argument("--target", type=Path, required=True, help="the target's local folder (vLLM loads it)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, help="default: RUN_DIR/sim_vs_vllm")
    args = p.parse_args(argv)
    out = args.out or args.run_dir / "sim_vs_vllm"
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.json"
    rows = json.loads(rows_path.read_text()) if rows_path.is_file() else {}
    engine = load_recipe(args.recipe).vllm
    val = {}
    metrics = args.run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            m = json.loads(line)
            if "val_sim_al" in m:
                val[m["step"]] = m["val_sim_al"]
    ckpts = find_checkpoints(args.run_dir / "checkpoints")
    best = args.run_dir / "checkpoints" / BEST_NAME
    for ckpt in ckpts + ([best] if best.is_dir() else []):
        name = ckpt.name
        if name in rows:
            continue
        step = json.loads((ckpt / "best.json").read_text())["step"] if name == BEST_NAME else int(name.split("-")[1])
        same = next((r for n, r in rows.items() if n != BEST_NAME and r["step"] == step), None)
        if name == BEST_NAME and same is not None:  # best is that step's draft: measured once
            rows[name] = dict(same)
            rows_path.write_text(json.dumps(rows, indent=1))
            continue
        exp = export(ckpt, out / "export" / name, num_speculative_tokens=args.k)
        sim = simulate(exp, args.sim_data, k=args.k)
        r = measure(args.target, args.prompts, draft=exp, k=args.k, temperature=0.0,
                    max_new_tokens=args.max_new_tokens, engine=engine, log_path=out / f"vllm_{name}.log")
        rows[name] = {"step": step, "sim_al": sim["val_sim_al"], "held_out_sim_al": val.get(step),
                      "vllm_al": r["mean_acceptance_length"], "vllm_per_position": r["per_position_acceptance"],
                      "sim_per_position": [sim[f"val_sim_rate_{k}"] for k in range(args.k)]}
        rows_path.write_text(json.dumps(rows, indent=1))
        print(f"{name}: simulated {rows[name]['sim_al']:.3f}, vLLM {rows[name]['vllm_al']:.3f}", flush=True)
    table = ["| checkpoint | step | simulated AL (same prompts) | vLLM AL | gap | held-out simulated AL |",
             "|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda kv: (kv[1]["step"], kv[0])):
        held = f"{r['held_out_sim_al']:.3f}" if r.get("held_out_sim_al") else "-"
        table.append(f"| {name} | {r['step']} | {r['sim_al']:.3f} | {r['vllm_al']:.3f} | "
                     f"{r['sim_al'] - r['vllm_al']:+.3f} | {held} |")
    steps = [r for n, r in rows.items() if n != BEST_NAME]
    sim, real = [r["sim_al"] for r in steps], [r["vllm_al"] for r in steps]
    table.append("")
    table.append(f"checkpoints: {len(steps)}; Pearson r (simulated vs vLLM) {pearson(sim, real):.3f}; "
                 f"largest |gap| {max(abs(a - b) for a, b in zip(sim, real)):.3f}")
    held = [(r["held_out_sim_al"], r["vllm_al"]) for r in steps if r.get("held_out_sim_al")]
    if len(held) >= 2:
        table.append(f"held-out simulated AL vs vLLM: Pearson r {pearson(*map(list, zip(*held))):.3f}")
    text = "\n".join(table)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
