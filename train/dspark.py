"""Train a DSpark draft (DFlash block drafting + Markov head + confidence head).

    accelerate launch train/dspark.py RECIPE.yaml --run-dir runs/x [--resume] [--set draft.markov_rank=64]
    python train/dspark.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``, the same data as EAGLE-3 and
DFlash). Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to ``RUN_DIR/metrics.jsonl``.
"""

# An entry script run as a file (`accelerate launch train/dspark.py`), so its imports are absolute;
# the method itself lives in train/method_dspark.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_dspark import DSparkMethod


def main(argv: list[str] | None = None) -> int:
    return train_main(DSparkMethod, "train/dspark.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
