"""Benchmarks of draftsmith itself (speed and memory of its own stages), kept outside the
installed package: they ship with the repository, not the wheel. Run them from a checkout's root,
``python -m benchmarks.<name>`` (``make bench*``), or through ``draftsmith bench <name>``:

- :mod:`.memory`: peak training memory of a recipe's step at the target's geometry (fake tensors);
- :mod:`.gpu`: the real training step on a GPU (tok/s, MFU, CUDA peak memory) and the capture;
- :mod:`.hidden_states`: hidden-state capture throughput and the capture's host memory;
- :mod:`.regenerate`: regeneration tok/s per engine;
- :mod:`.data_memory`: host memory of the training data loader per rank;
- :mod:`.step`: ops, FLOPs, bytes and a roofline GPU time of a recipe's step (fake tensors);
- :mod:`.lengths`: the sequence lengths the training benchmarks batch (a run's data, or a default);
- :mod:`.muon`: the training step's time with Muon against AdamW.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose root holds benchmarks/


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout's root first on ``PYTHONPATH``, so a child
    started as ``python -m benchmarks.<name>`` finds the benchmarks wherever it runs; ``extra``
    variables added."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
