"""Train the draft of any recipe, the method from its ``draft.method``:

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=3e-4]
    python -m draftsmith.train RECIPE.yaml --run-dir runs/x

The command line of ``draftsmith train`` (:mod:`draftsmith.cli.train`), run by each rank of a launch.
"""

# The launch module (`accelerate launch -m draftsmith.train`): it calls the command line, whose
# parser and training call live in draftsmith.cli.train.
import sys

from draftsmith.cli.train import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m draftsmith.train"))
