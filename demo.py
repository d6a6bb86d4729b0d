"""The whole EAGLE-3 pipeline in one command (what ``make demo`` runs).

    python -m draftsmith.demo recipes/smollm2_135m.yaml --run-dir runs/smollm2_135m
        [--eval-prompts builtin:mt_bench] [--set key=value ...]

Stages: prepare data (target, regenerate, tokenize, vocab, hidden states) -> train
(TTT) -> export (speculators format) -> acceptance in vLLM on the recipe's held-out prompts
(and any extra prompt sets: ``builtin:mt_bench`` fetches MT-bench from the Hub with ``datasets``,
a local FastChat ``question.jsonl`` works too), beside vLLM's ``ngram`` method on the same prompts.
Each stage skips work already on disk, so a rerun continues where the last one stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .data_prep.prepare import prepare
from .eval.acceptance import format_row, measure
from .eval.export import export
from .cli import add_recipe_arguments, recipe_from_args, setup_logging
from .recipe import dump_recipe
from .train.method_eagle3 import Eagle3Method
from .train.checkpoint import find_checkpoints
from .train.trainer import fit

log = logging.getLogger("draftsmith.demo")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--eval-prompts", action="append", default=[], help="extra prompt files to measure on")
    args = p.parse_args(argv)
    setup_logging()
    recipe = recipe_from_args(args)
    run = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, run / "recipe.yaml")
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    t = time.perf_counter()
    data_summary = prepare(recipe, run)
    timings["prepare_s"] = time.perf_counter() - t

    t = time.perf_counter()
    ckpts = find_checkpoints(run / "checkpoints")
    if ckpts and json.loads((ckpts[-1] / "train_state.json").read_text()).get("finished"):
        log.info("training already finished: %s", ckpts[-1])
        train_summary = {"checkpoint": str(ckpts[-1])}
    else:
        # no checkpoint yet: whatever a killed earlier attempt logged is started over
        result = fit(recipe, Eagle3Method(recipe, run), run, resume=bool(ckpts), overwrite=not ckpts)
        train_summary = {"steps": result.steps, "tokens": result.tokens, "seconds": result.seconds,
                         "tokens_per_s": result.tokens_per_s, "final_metrics": result.last_metrics,
                         "checkpoint": str(result.checkpoint)}
    timings["train_s"] = time.perf_counter() - t

    draft = export(Path(train_summary["checkpoint"]), run / "export" / "eagle3",
                   num_speculative_tokens=recipe.eval.num_speculative_tokens)
    if recipe.eval.export_legacy:
        export(Path(train_summary["checkpoint"]), run / "export" / "eagle3-legacy", legacy=True)
    target_dir = Path(json.loads((run / "data" / "target.json").read_text())["path"])

    t = time.perf_counter()
    e = recipe.eval
    common = dict(target=target_dir, k=e.num_speculative_tokens, temperature=e.temperature,
                  max_new_tokens=e.max_new_tokens, max_prompts=e.max_prompts, seed=recipe.seed, engine=recipe.vllm,
                  ngram_min=e.ngram_prompt_lookup_min, ngram_max=e.ngram_prompt_lookup_max)
    prompt_sets = ([recipe.data.eval_prompts] if recipe.data.eval_prompts else []) + args.eval_prompts
    acceptance: dict[str, dict] = {}
    for prompts in prompt_sets:
        acceptance[prompts] = {}
        methods = ["eagle3"] + (["ngram"] if e.compare_ngram else [])
        for m in methods:
            r = measure(method=m, draft=draft if m == "eagle3" else None, prompts=prompts,
                        log_path=run / "eval" / f"vllm_{m}_{Path(prompts).stem.replace(':', '_')}.log", **common)
            r.pop("outputs")
            acceptance[prompts][m] = r
    timings["eval_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_all

    report = {"recipe": args.recipe, "data": data_summary, "train": train_summary, "acceptance": acceptance,
              "timings": timings, "draft": str(draft)}
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "acceptance.json").write_text(json.dumps(report, indent=1))

    print("\n=== draftsmith demo: EAGLE-3 draft for", recipe.target.name_or_path, "===")
    print(f"exported draft: {draft}")
    if "steps" in train_summary:
        print(f"training: {train_summary['steps']} steps, {train_summary['tokens']} tokens, "
              f"{train_summary['tokens_per_s']:.0f} tok/s")
    print(f"vLLM acceptance, K={e.num_speculative_tokens}, T={e.temperature}:")
    for prompts, rows in acceptance.items():
        print(f"  prompts: {prompts}")
        for m, r in rows.items():
            print("    " + format_row(m, r))
    print("wall time: " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in timings.items()))
    print(f"figures saved to {run / 'eval' / 'acceptance.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
