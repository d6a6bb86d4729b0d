"""Train a DFlash2 draft (DFlash with grouped dynamic convolutions and a candidate selector).

    accelerate launch train/dflash2.py RECIPE.yaml --run-dir runs/x [--resume]
    python train/dflash2.py RECIPE.yaml --run-dir runs/x

Reads and writes what ``train/dflash.py`` does (the same prepared ``RUN_DIR/data``, with the
draft vocab equal to the target's).
"""

# An entry script run as a file (`accelerate launch train/dflash2.py`), so its imports are absolute;
# the method itself lives in train/method_dflash2.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_dflash2 import DFlash2Method


def main(argv: list[str] | None = None) -> int:
    return train_main(DFlash2Method, "train/dflash2.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
