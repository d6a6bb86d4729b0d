"""The dry run's memory estimate of every recipe's training step is within 20% of the step
measured with fake tensors (``draftsmith bench memory``)."""

from __future__ import annotations
from pathlib import Path

import pytest
from draftsmith.recipe import load_recipe


RECIPES = Path(__file__).parents[2] / "recipes"

GPU_RECIPES = sorted(p.stem for p in RECIPES.glob("*.yaml") if not p.stem.startswith("smollm2"))


@pytest.mark.integration
@pytest.mark.parametrize("name", GPU_RECIPES)
def test_dry_run_estimate_within_20_percent_of_the_measured_step(name):
    """The recipe's full B x T on its launcher's precision path (fake tensors: seconds, any machine)."""
    from benchmarks.memory import build_parser, run

    recipe = load_recipe(RECIPES / f"{name}.yaml")
    args = build_parser().parse_args([str(RECIPES / f"{name}.yaml")])
    (row,) = run(args, recipe)
    ratio = row["estimated_bytes"] / row["measured_bytes"]
    assert 0.8 <= ratio <= 1.2, (f"{name}: estimate {row['estimated_bytes'] / 2**30:.2f} GiB, measured "
                                 f"{row['measured_bytes'] / 2**30:.2f} GiB; largest at the peak: "
                                 f"{row['measured_phases']}")
    assert row["fits"], f"{name}: {row['measured_bytes'] / 2**30:.1f} GiB does not fit an 80 GiB GPU"
