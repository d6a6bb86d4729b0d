"""Train an IBM MLP speculator (arXiv:2404.19124), stage 1 then optionally stage 2.

    accelerate launch train/mlp_speculator.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=1e-3]
    python train/mlp_speculator.py RECIPE.yaml --run-dir runs/x

Stage 1 trains on the prepared data (``RUN_DIR/data``: final hidden states from the shards,
or from the target in online mode) with teacher forcing: stage i at position t reads
x_{t+1+i} and predicts x_{t+2+i}. From optimizer step ``draft.stage2_start_step``
on (stage 2), each batch is replaced by sequences the frozen target generates itself: the
prompt part of each row (up to its first assistant token) is continued for
``stage2_new_tokens`` tokens (greedy, or sampled at ``stage2_temperature``), the target is run
on the result for its final normed hidden states, and the loss covers the generated tokens.
Per-stage cross-entropy weighted ``draft.head_decay**i``; metrics ``loss_{i}``, ``acc_{i}``.
"""

# An entry script run as a file (`accelerate launch train/mlp_speculator.py`), so its imports are absolute;
# the method itself lives in train/method_mlp_speculator.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_mlp_speculator import MLPSpeculatorMethod


def main(argv: list[str] | None = None) -> int:
    return train_main(MLPSpeculatorMethod, "train/mlp_speculator.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
