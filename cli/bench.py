"""``draftsmith bench <what>``: the benchmarks of draftsmith itself, in the checkout's top-level
benchmarks/ folder (outside the installed package; modules imported on use only)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHES: dict[str, str] = {
    "memory": "peak training memory of the recipe's step beside the dry run's estimate (fake tensors: any machine)",
    "step": "ops, matmul FLOPs, bytes and an H100 / H200 roofline time of the recipe's step (fake tensors: any machine)",
    "gpu": "the real training step on a GPU: tok/s, MFU, CUDA peak memory; the target's capture",
    "hidden-states": "hidden-state capture throughput and the capture's host memory",
    "regenerate": "regeneration tok/s per engine (in-process, vLLM offline, vLLM server)",
    "data-memory": "host memory of the training data loader per rank",
    "muon": "the training step's time with Muon (its Newton-Schulz dtype) against AdamW, interleaved",
}


def main(argv: list[str]) -> int:
    """``draftsmith bench NAME ...``: ``python -m benchmarks.<name>`` of the checkout this package runs from."""
    from . import _run_as

    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        lines = [f"  {k:14s} {v}" for k, v in BENCHES.items()]
        print("usage: draftsmith bench {" + ",".join(BENCHES) + "} [...]\n\nbenchmarks:\n" + "\n".join(lines),
              file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "benchmarks" / "__init__.py").is_file():
        print(f"draftsmith bench: no benchmarks/ folder beside {checkout}; the benchmarks ship with the "
              "repository, not the wheel: run them from a checkout (pip install -e .)", file=sys.stderr)
        return 2
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    return _run_as(f"draftsmith bench {argv[0]}", "benchmarks." + argv[0].replace("-", "_"), argv[1:])
