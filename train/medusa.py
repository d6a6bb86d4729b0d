"""Train Medusa-1 heads on the target's final hidden states.

    accelerate launch train/medusa.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=1e-3]
    python train/medusa.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``draftsmith prepare``): target info and hidden-state
shards (only ``final_hidden_states`` is used) or, with ``data.hidden_states_mode: online``,
token ids with the target run in the job. Head k learns x_{t+k+2} with cross-entropy
against the (regenerated) reply tokens, weighted ``draft.head_decay**k`` (Medusa-1,
arXiv:2401.10774). Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics
(``loss_{k}``, ``acc_{k}`` per head) to ``RUN_DIR/metrics.jsonl``.
"""

# An entry script run as a file (`accelerate launch train/medusa.py`), so its imports are absolute;
# the method itself lives in train/method_medusa.py.
import sys

from draftsmith.train.method_base import train_main
from draftsmith.train.method_medusa import MedusaMethod


def main(argv: list[str] | None = None) -> int:
    return train_main(MedusaMethod, "train/medusa.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
