"""The benchmark client: each concurrency level's prompt set (vLLM's custom-dataset JSONL) and
vLLM's own ``bench serve`` run in a subprocess against a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .metrics import BENCH_PERCENTILES, LATENCY_METRICS
from ...vllm_bridge.server import command_log, log_tail

def load_prompt_texts(path: str) -> list[str]:
    """First user turn of every usable record of ``path`` (any format
    :func:`draftsmith.data_prep.conversations.load_records` reads: builtin:eval, MT-bench, ...).

    Raises:
        DataError: no usable rows (from ``load_records``).
    """
    from ...data_prep.conversations import load_records

    records, _ = load_records(path)
    texts = []
    for r in records:
        user = next((m["content"] for m in r.get("messages", []) if m["role"] == "user"), None)
        if user:
            texts.append(user)
    return texts


def split_prompts(prompts: list[str], levels: list[int], per_level: int, source: str = "prompts") -> dict[int, list[str]]:
    """Give each concurrency level its own ``per_level`` prompts, in file order, no prompt
    shared between levels (a level must not be served from a prefix cache warmed by another).

    Raises:
        ValueError: fewer than ``len(levels) * per_level`` prompts, or duplicate levels.
    """
    if len(set(levels)) != len(levels):
        raise ValueError(f"concurrency levels must be distinct, got {levels}")
    need = len(levels) * per_level
    if len(prompts) < need:
        raise ValueError(f"{source}: {len(prompts)} prompts, need {need} ({per_level} per level x "
                         f"{len(levels)} levels {levels}); lower --num-prompts-per-level")
    return {c: prompts[i * per_level:(i + 1) * per_level] for i, c in enumerate(levels)}


def write_custom_dataset(prompts: list[str], path: Path, output_tokens: int | None) -> Path:
    """The JSONL vLLM's ``--dataset-name custom`` reads: ``{"prompt": str, "output_tokens": int}`` per line.
    ``output_tokens`` None: ``{"prompt": str}`` only, what GuideLLM's ``json_file`` data reads (its column
    mapper takes ``prompt`` as the text; with no token-count column the request length comes from
    ``max_tokens`` and generation may stop at EOS, as in vLLM's benchmark)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if output_tokens is None else {"output_tokens": output_tokens}
    with path.open("w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p, **extra}) + "\n")
    return path


def bench_args(port: int, model: str, dataset: Path, num_prompts: int, concurrency: int, output_tokens: int,
               temperature: float, result_dir: Path, result_name: str) -> list[str]:
    """Arguments of vLLM's ``bench serve`` for one level (prompts already carry no chat
    template: the chat endpoint applies it, so ``--skip-chat-template``; ``--save-detailed``
    keeps the generated texts for the comparison with the baseline)."""
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--host", "127.0.0.1",
            "--port", str(port), "--model", model, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(num_prompts),
            "--custom-output-len", str(output_tokens), "--max-concurrency", str(concurrency),
            "--temperature", str(temperature), "--percentile-metrics", ",".join(LATENCY_METRICS),
            "--metric-percentiles", ",".join(str(p) for p in BENCH_PERCENTILES), "--num-warmups", "0",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name]


def run_bench(args: list[str], result_path: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run vLLM's serving benchmark in a subprocess (its asyncio loop and tokenizer stay out
    of this process) and return its saved result.

    Raises:
        RuntimeError: the benchmark failed or saved nothing (log tail in the message).
    """
    cmd = [sys.executable, "-m", "draftsmith.cli.serve_bench", "--bench-worker", *args]
    with command_log(log_path, cmd) as log_file:
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0 or not result_path.is_file():
        raise RuntimeError(f"benchmark failed (exit {proc.returncode}, log {log_path}):\n{log_tail(log_path)}")
    return json.loads(result_path.read_text())


def bench_worker(argv: list[str]) -> int:
    """``vllm bench serve`` with ``argv`` in this process (the subprocess :func:`run_bench` starts)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0
