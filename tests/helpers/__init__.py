"""What several test modules share, importable from every test folder (``tests/conftest.py``
puts ``tests/`` on ``sys.path``): ``from helpers.tiny import build_tiny_target``.

- ``tiny``: tiny targets, tokenizers, draft geometries, records and checkpoints built in code (no
  network);
- ``recipes``: the shipped recipes' paths, the tiny target's recipes and prompts, and a trained,
  exported tiny draft;
- ``drafts``: random drafts of every method and their reference proposers;
- ``rope_targets``: targets with Llama-3.1's and gpt-oss's rotary embeddings, and drafts built on them;
- ``data_parallel``: torchrun launches of a tiny run on CPU and their comparison with one process;
- ``sharded_runs``: what the FSDP2 and DeepSpeed launcher tests share (resume, export, launchers);
- ``faults``: fault injectors and run readers of the resume tests;
- ``procs``: liveness and clean-up of the processes a test started;
- ``fake_inputs``: made-up secrets, traffic-log lines and conversations;
- ``vllm_parity``: vLLM's distributed state and stand-ins for the parity tests;
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
