"""Train a P-EAGLE draft (EAGLE-3 + parallel drafting, COD-sampled mask chains).

    accelerate launch train/peagle.py RECIPE.yaml --run-dir runs/x [--resume] [--set draft.num_depths=8]
    python train/peagle.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``): target info, draft vocab,
tokenised data (to check the mask token never occurs in it) and hidden-state shards. Writes
checkpoints under ``RUN_DIR/checkpoints`` and metrics to ``RUN_DIR/metrics.jsonl``.
"""

# An entry script run as a file (`accelerate launch train/peagle.py`), so its imports are absolute;
# the method itself lives in train/method_peagle.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_peagle import PEagleMethod


def main(argv: list[str] | None = None) -> int:
    return train_main(PEagleMethod, "train/peagle.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
