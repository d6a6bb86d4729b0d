"""What several test modules share, importable from every test folder (``tests/conftest.py``
puts ``tests/`` on ``sys.path``): ``from helpers.tiny import build_tiny_target``.

- ``tiny``: tiny targets, tokenizers and draft checkpoints built in code (no network);
- ``recipes``: the tiny target's recipes and prompts, and a trained, exported tiny draft;
- ``sharded_runs``: the multi-process launches (torchrun, FSDP2, DeepSpeed) and their comparisons;
- ``faults``: fault injectors and run readers of the resume tests;
- ``reference_losses``: the unchunked reference losses the training paths are checked against.

Fixtures (the tiny target, the prepared tiny run, ...) are in ``tests/conftest.py``.
"""

import hashlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root (the draftsmith package)


def folder_digest(folder: Path) -> str:
    """sha256 over the names and bytes of every file under ``folder``."""
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()
