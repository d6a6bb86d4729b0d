"""``draftsmith simulate``: simulated acceptance length without vLLM (the command line of :mod:`draftsmith.eval.simulate`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..eval import simulate as sim
from ..runtime import HelpFormatter


def temperature_list(text: str) -> tuple[float, ...]:
    """``--temperatures``: comma-separated numbers >= 0 (argparse reports a bad one, exit 2)."""
    temps = []
    for item in text.split(","):
        try:
            t = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r} is not a number; give comma-separated "
                                             "temperatures, e.g. --temperatures 0,0.7") from None
        if not t >= 0:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r}: a temperature must be >= 0, "
                                             "e.g. --temperatures 0,0.7")
        temps.append(t)
    return tuple(temps)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=sim.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--draft", type=Path, required=True, help="EAGLE-3 export folder or draftsmith checkpoint")
    p.add_argument("--data", type=Path, required=True, help="prepared RUN_DIR/data folder (hidden-state shards)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per chain (num_speculative_tokens)")
    p.add_argument("--temperatures", default=None, type=temperature_list,
                   help="comma-separated sampling temperatures simulated, each >= 0 (e.g. 0,0.7); default: "
                   "--recipe's validation temperatures (its served eval.temperature, then 0), else 0")
    p.add_argument("--recipe", type=Path, help="recipe whose served temperature is simulated (with T=0) when "
                   "--temperatures is not given")
    p.add_argument("--draft-sampling", default=None, choices=["greedy", "sample", "probabilistic"],
                   help="T > 0: greedy drafts (vLLM's default draft_sample_method; accepted with p(argmax q)) or "
                   "drafts sampled from the draft (sample, the same as vLLM's probabilistic; accepted with "
                   "sum min(p, q)); default: --recipe's eval.draft_sampling, else greedy")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--out", type=Path, help="write the metrics as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    from ..fileio import ShardError
    from ..train.method_base import MethodSetupError

    from ..recipe import RecipeError, load_recipe, simulated_draft_sampling

    args = build_parser().parse_args(argv)
    temps, sampling = args.temperatures, args.draft_sampling
    try:
        recipe = load_recipe(args.recipe) if args.recipe else None
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if temps is None:
        temps = tuple(recipe.validation_temperatures) if recipe else (0.0,)
    if sampling is None:
        sampling = recipe.eval.draft_sampling if recipe else "greedy"
    sampling = simulated_draft_sampling(sampling)
    try:
        out = sim.simulator()(args.draft, args.data, args.k, temps, args.batch_size, sampling)
    except (MethodSetupError, ShardError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rates = "/".join(f"{out[f'val_sim_rate_{k}']:.3f}" for k in range(args.k))
    line = f"simulated AL {out['val_sim_al']:.3f} (per position {rates})"
    for t in temps:
        if t:
            line += f", T={t:g}: {out[f'val_sim_al_t{t:g}']:.3f}"
    print(f"{line}; {out['num_sequences']} sequences, {int(out['val_chains'])} chains")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
