"""Peak memory per rank while reading the tokenised data: synthetic corpora of growing size,
2 CPU ranks (torchrun), each iterating its share of the rows through
:class:`~draftsmith.train.data.TokenizedDataset` and a ``DistributedSampler`` DataLoader.

    python -m benchmarks.data_memory [--tokens 100000 1000000] [--ranks 2] [--lists]

Prints one row per (corpus, rank): tokens, rank, rows read, peak RSS (``ru_maxrss``) and its
growth over the start (libraries imported), split into opening the dataset and iterating, in MB. The Arrow dataset is memory-mapped, so the growth stays flat
as the corpus grows; ``--lists`` adds the pre-Arrow reader (``tokenized.jsonl`` parsed into
Python lists on every rank) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from benchmarks import subprocess_env

JSONL = "tokenized.jsonl"  # the pre-Arrow layout, written beside the Arrow dataset for --lists


def rss_mb() -> float:
    """Peak resident set size of this process so far (``ru_maxrss``, KiB on Linux), in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def synthetic_rows(tokens: int, vocab_size: int, seed: int = 0, min_len: int = 256, max_len: int = 1024):
    """Rows of random ids below ``vocab_size``, lengths in ``[min_len, max_len]``, until ``tokens``."""
    rng = np.random.default_rng(seed)
    total, i = 0, 0
    while total < tokens:
        n = int(min(rng.integers(min_len, max_len + 1), max(tokens - total, 2)))
        mask = np.ones(n, dtype=np.int8)
        mask[: n // 4] = 0
        yield {"id": f"s{i}", "input_ids": rng.integers(0, vocab_size, n).tolist(), "loss_mask": mask.tolist()}
        total, i = total + n, i + 1


def build_corpus(data_dir: Path, tokens: int, vocab_size: int = 512, seed: int = 0, jsonl: bool = False) -> None:
    """Write the tokenised Arrow dataset of ``tokens`` synthetic tokens under ``data_dir``
    (:attr:`~draftsmith.layout.DataPaths.tokenized`); ``jsonl``: also the legacy JSONL."""
    from draftsmith.layout import DataPaths, write_tokenized_rows

    paths = DataPaths(Path(data_dir))
    write_tokenized_rows(paths, synthetic_rows(tokens, vocab_size, seed))
    if jsonl:
        with (paths.root / JSONL).open("w") as fh:
            for r in synthetic_rows(tokens, vocab_size, seed):
                fh.write(json.dumps(r) + "\n")


def worker(data_dir: Path, out: Path, mode: str, batch_size: int) -> None:
    """One rank (``RANK`` / ``WORLD_SIZE`` from torchrun): read every row of its share."""
    import torch

    from draftsmith.layout import DataPaths
    from draftsmith.train.data import TokenizedDataset, collate

    import datasets  # noqa: F401  (libraries in the baseline: the growth is the data's)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    base = max(rss_mb(), current_rss_mb())
    paths = DataPaths(Path(data_dir))
    if mode == "arrow":
        ds = TokenizedDataset(paths)
    else:  # the pre-Arrow reader: every row as Python lists
        class Lists(torch.utils.data.Dataset):
            def __init__(self):
                with (paths.root / JSONL).open() as fh:
                    self.rows = [(r["input_ids"], r["loss_mask"]) for r in map(json.loads, fh)]

            def __len__(self):
                return len(self.rows)

            def __getitem__(self, i):
                ids, m = self.rows[i]
                return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(m)}

        ds = Lists()
    opened = max(rss_mb(), current_rss_mb())
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    rows = tokens = 0
    for batch in loader:
        rows += batch["input_ids"].shape[0]
        tokens += int(batch["attention_mask"].sum())
    peak = rss_mb()
    result = {"rank": rank, "world": world, "mode": mode, "rows": rows, "tokens_read": tokens,
              "peak_rss_mb": round(peak, 1), "growth_mb": round(peak - base, 1),
              "open_growth_mb": round(opened - base, 1), "iter_growth_mb": round(peak - opened, 1),
              "rss_at_start_mb": round(base, 1)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def measure(data_dir: Path, ranks: int = 2, mode: str = "arrow", port: int = 29731, batch_size: int = 8) -> list[dict]:
    """Launch ``ranks`` torchrun CPU processes reading ``data_dir``; returns their results."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(port), "-m", "benchmarks.data_memory", "--worker", str(data_dir), "--out", tmp,
               "--mode", mode, "--batch-size", str(batch_size)]
        env = subprocess_env(OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[100_000, 1_000_000], help="corpus sizes")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512, help="ids are drawn below this")
    p.add_argument("--lists", action="store_true", help="also measure the pre-Arrow reader (JSONL into lists)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="arrow", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out, args.mode, args.batch_size)
        return 0
    modes = ["arrow"] + (["lists"] if args.lists else [])
    print(f"{'reader':<7} {'tokens':>10} {'rank':>4} {'rows':>6} {'peak RSS MB':>12} {'growth MB':>10} "
          f"{'open MB':>8} {'iterate MB':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tokens:
            data = Path(tmp) / f"corpus-{n}"
            build_corpus(data, n, args.vocab_size, jsonl=args.lists)
            for mode in modes:
                for r in measure(data, args.ranks, mode, batch_size=args.batch_size):
                    print(f"{mode:<7} {n:>10} {r['rank']:>4} {r['rows']:>6} {r['peak_rss_mb']:>12.1f} "
                          f"{r['growth_mb']:>10.1f} {r['open_growth_mb']:>8.1f} {r['iter_growth_mb']:>10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
