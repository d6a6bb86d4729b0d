"""The Markdown tables of ``scripts/compare_parallel_drafts.sh``'s output folder: per data set
and draft, training (steps, tokens, wall time), parameters, and vLLM's acceptance on MT-bench
at each temperature; then the serving figures (output tok/s vs no speculation at each
concurrency, the K sweep).

    python scripts/parallel_drafts_table.py runs/cmp/out
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftsmith.eval.compare_drafts import count_parameters, training_figures
from draftsmith.eval.results import ServeResults, read_acceptance

LABEL = {"eagle3": "EAGLE-3 (TTT 3)", "peagle": "P-EAGLE (2 layers, 4 depths)",
         "dflash_b8": "DFlash (1 layer, block 8)", "dflash_b4": "DFlash (1 layer, block 4)",
         "dflash_l3": "DFlash (3 layers, block 8, 64 anchors)"}
DATA = {"demo": "demo data (77,861 tokens)", "sd": "self-distilled set (264,175 tokens)"}


def acceptance_rows(out: Path) -> list[str]:
    rows = ["| data | draft | K | training: steps, tokens, time | parameters (trained) | T | vLLM AL | per position | drafts |",
            "|---|---|---|---|---|---|---|---|---|"]
    for data in DATA:
        for name in LABEL:
            run = out / data / name
            if not (run / "export" / name).is_dir():
                continue
            tf = training_figures(run)
            params = count_parameters(run / "export" / name, run)
            for t in ("0", "0.7"):
                f = run / f"acceptance_t{t}.json"
                if not f.is_file():
                    continue
                (r,) = read_acceptance(f).values()
                pp = " / ".join(f"{p:.3f}" for p in r.per_position_acceptance or [])
                rows.append(f"| {DATA[data]} | {LABEL[name]} | {r.num_speculative_tokens} | {tf['steps']}, "
                            f"{tf['train_tokens']:,}, {tf['train_seconds'] / 60:.1f} min | "
                            f"{params['parameters'] / 1e6:.1f}M ({params['trained_parameters'] / 1e6:.1f}M) | {t} | "
                            f"{r.mean_acceptance_length:.3f} | {pp} | {r.num_drafts:,} |")
    return rows


def serving_rows(out: Path) -> list[str]:
    rows = ["| draft | K | baseline c=1 | draft c=1 (AL) | baseline c=4 | draft c=4 (AL) | K sweep at c=1: tok/s (AL) |",
            "|---|---|---|---|---|---|---|"]
    for name in LABEL:
        f = out / "serve" / name / "results.json"
        if not f.is_file():
            continue
        res = ServeResults.read(f)
        base = res.configs.get("baseline")
        draft = next((c for n, c in res.configs.items() if n != "baseline"), None)
        if base is None or draft is None or draft.status != "ok":
            rows.append(f"| {LABEL[name]} | | failed: {draft.error if draft else 'no draft run'} | | | | |")
            continue

        def cell(cfg, c, with_al=False, ref=None):
            lv = cfg.levels.get(c)
            if lv is None or lv.output_tok_s is None:
                return "n/a"
            s = f"{lv.output_tok_s:.1f}"
            if ref is not None and ref.levels.get(c) and ref.levels[c].output_tok_s:
                s += f", {lv.output_tok_s / ref.levels[c].output_tok_s:.2f}x"
            if with_al and lv.acceptance and lv.acceptance.num_drafts:
                s += f" ({lv.acceptance.mean_acceptance_length:.2f})"
            return s

        sweep = ""
        if res.k_sweep:
            sweep = "; ".join(f"K={k}: {cell(c, 1, True, base)}" for k, c in sorted(res.k_sweep.k.items())
                              if c.status == "ok")
        rows.append(f"| {LABEL[name]} | {draft.k} | {cell(base, 1)} | {cell(draft, 1, True, base)} | {cell(base, 4)} | "
                    f"{cell(draft, 4, True, base)} | {sweep} |")
    return rows


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path("runs/cmp/out")
    print("\n".join(acceptance_rows(out)))
    print()
    print("\n".join(serving_rows(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
