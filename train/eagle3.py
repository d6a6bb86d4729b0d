"""Train an EAGLE-3 draft with training-time test.

    accelerate launch train/eagle3.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=3e-4]
    python train/eagle3.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``): target info, draft vocab and
hidden-state shards. Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to
``RUN_DIR/metrics.jsonl``.
"""

# An entry script run as a file (`accelerate launch train/eagle3.py`), so its imports are absolute;
# the method itself lives in train/method_eagle3.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_eagle3 import Eagle3Method


def main(argv: list[str] | None = None) -> int:
    return train_main(Eagle3Method, "train/eagle3.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
