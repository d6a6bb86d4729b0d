"""Train a DFlash block-drafting draft (z-lab, arXiv:2602.06036).

    accelerate launch train/dflash.py RECIPE.yaml --run-dir runs/x [--resume] [--set draft.block_size=8]
    python train/dflash.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``, the same data as EAGLE-3): target
info, draft vocab, tokenised data (to check the mask token never occurs) and hidden-state
shards. Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to ``RUN_DIR/metrics.jsonl``.
"""

# An entry script run as a file (`accelerate launch train/dflash.py`), so its imports are absolute;
# the method itself lives in train/method_dflash.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_dflash import DFlashMethod


def main(argv: list[str] | None = None) -> int:
    return train_main(DFlashMethod, "train/dflash.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
