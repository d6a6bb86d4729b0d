"""Train an EAGLE-3 draft (the command on published model cards, kept as a file):

    accelerate launch train/eagle3.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=3e-4]
    python train/eagle3.py RECIPE.yaml --run-dir runs/x

``accelerate launch -m draftsmith.train`` for EAGLE-3 recipes (a recipe of another draft.method is
refused); its flags and ``--help`` are those of :mod:`draftsmith.cli.train`.
"""

# An entry script run as a file (`accelerate launch train/eagle3.py`), so its imports are absolute;
# the command line lives in cli/train.py.
import sys

from draftsmith.cli.train import launch


def main(argv: list[str] | None = None) -> int:
    return launch(argv, method="eagle3", script="train/eagle3.py")


if __name__ == "__main__":
    sys.exit(main())
