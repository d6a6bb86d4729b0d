"""The hidden-state capture's peak memory does not grow with the number of tokens captured."""

from __future__ import annotations

import pytest
from benchmarks.hidden_states import measure_capture_rss


@pytest.mark.integration
def test_capture_peak_memory_does_not_grow_with_the_tokens_captured(tmp_path):
    """H=1024, bf16, 32 MiB shards: 32k and 128k tokens (10 and 37 shards, 0.27 / 1.07 GB
    written), glibc's mmap threshold fixed (``measure_capture_rss``: otherwise the peak measures
    the allocator's retained heap). The peak over the start is the shard being assembled (final
    states, ids, mask: ~8 MB) and the record being encoded (8 MB of float32 states plus its
    encoded copy): ~26 MB either way; the writer before streaming held parts, their concatenation
    and the serialised bytes: ~200-235 MB and growing. Slack: 10% plus 8 MB for allocator noise."""
    kw = dict(hidden_size=1024, shard_bytes=32 << 20, seq_len=512, out_dir=str(tmp_path))
    small, large = measure_capture_rss(32768, **kw), measure_capture_rss(131072, **kw)
    assert large["shards"] >= 4 * small["shards"] - 4
    assert large["peak_growth_mb"] <= 1.1 * small["peak_growth_mb"] + 8, (small, large)
    assert large["peak_growth_mb"] < 4 * 32, (small, large)  # the old writer: ~200 MB here
