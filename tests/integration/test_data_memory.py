"""Peak memory per rank does not grow with the corpus: the tokenised data is a memory-mapped
Arrow dataset read by index, never Python lists of the whole corpus. Two torchrun CPU ranks
each iterate their share (DistributedSampler) of a ~1M-token and a ~100k-token synthetic
corpus through TokenizedDataset; ``pytest -s`` prints the figures."""

from __future__ import annotations

import pytest

from benchmarks.data_memory import build_corpus, measure

pytestmark = pytest.mark.integration  # torchrun launches of two processes


def test_peak_rss_per_rank_does_not_grow_with_the_corpus(tmp_path):
    results = {}
    for tokens, port in ((100_000, 29741), (1_000_000, 29743)):
        build_corpus(tmp_path / f"c{tokens}", tokens, vocab_size=512)  # the tiny target's vocab
        results[tokens] = measure(tmp_path / f"c{tokens}", ranks=2, port=port)
    print(f"\n{'tokens':>10} {'rank':>4} {'rows':>6} {'peak RSS MB':>12} {'growth MB':>10} {'iterate MB':>10}")
    for tokens, rows in results.items():
        for r in rows:
            print(f"{tokens:>10} {r['rank']:>4} {r['rows']:>6} {r['peak_rss_mb']:>12.1f} {r['growth_mb']:>10.1f} "
                  f"{r['iter_growth_mb']:>10.1f}")
    small, big = results[100_000], results[1_000_000]
    assert sum(r["rows"] for r in big) >= 10 * sum(r["rows"] for r in small) * 0.8  # every row read, 10x data
    for s, b in zip(small, big):
        assert b["growth_mb"] < s["growth_mb"] + 20, (s, b)  # the 1M-token corpus as lists: +30 MB per rank
        assert b["peak_rss_mb"] < max(1.3 * s["peak_rss_mb"], s["peak_rss_mb"] + 50), (s, b)
