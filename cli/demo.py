"""The whole pipeline in one command (:func:`draftsmith.demo.demo`; what ``make demo`` runs):

    python -m draftsmith.cli.demo recipes/smollm2_135m.yaml --run-dir runs/smollm2_135m
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import demo as pipeline
from ..recipe import add_recipe_arguments, recipe_from_args
from ..runtime import setup_logging


def main(argv: list[str] | None = None) -> int:
    from ..eval.acceptance import format_row
    from ..methods import get_method

    p = argparse.ArgumentParser(description=pipeline.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--eval-prompts", action="append", default=[], help="extra prompt files to measure on")
    args = p.parse_args(argv)
    setup_logging()
    recipe = recipe_from_args(args)
    spec = get_method(recipe.draft.method)
    run = args.run_dir
    report = pipeline.demo(recipe, run, args.recipe, args.eval_prompts)
    draft, train_summary, acceptance, timings = report["draft"], report["train"], report["acceptance"], report["timings"]
    e = recipe.eval

    print(f"\n=== draftsmith demo: {spec.format.layout} draft for", recipe.target.name_or_path, "===")
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
