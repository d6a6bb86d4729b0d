"""GuideLLM (``guidellm`` on PyPI, the benchmark tool of the seeds' study) as serve-bench's
alternative load generator (``serve-bench --load-generator guidellm``).

GuideLLM does not install beside vLLM: guidellm 0.8.1 pins click and multidict below the
versions vLLM's environment holds (8.5.1 -> 8.4.2, 7.2.1 -> 6.9.1; aiohttp uses multidict), so it
lives in its own virtual environment and runs as a command (docs/measuring.md, "GuideLLM as the
load generator"). It only talks HTTP to the OpenAI server, so the two never share a process.

Per concurrency level this module writes a GuideLLM scenario (openai_http backend on the
level's server, chat endpoint, concurrent profile with ``streams = concurrency``, ``max_requests
= number of prompts``, the level's prompts as a JSONL data file, ``max_tokens`` and the
temperature in every request), runs ``guidellm run --scenario FILE`` and turns its JSON report
into the result vLLM's ``bench serve`` saves (:func:`bench_result`), so that
:func:`draftsmith.eval.serving.metrics.level_metrics` gives the same figures:

- output / total tok/s and requests/s: GuideLLM's token counts (the server's ``usage``) over
  GuideLLM's benchmark duration, as vLLM's benchmark divides by its own;
- TTFT, TPOT and request latency (ms): GuideLLM's per-request timings (its ``inter_token_latency_ms``
  of a request is (last token - first token) / (output tokens - 1), vLLM's TPOT), mean and
  linear-interpolated percentiles as numpy (and vLLM's benchmark) compute them;
- ITL: ``None``; GuideLLM keeps no per-chunk timestamps, and vLLM's ITL is the gap between
  streamed chunks (several tokens each under speculation).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .metrics import BENCH_PERCENTILES
from ...vllm_bridge.server import command_log, log_tail, stop_process_group

ENV_VAR = "DRAFTSMITH_GUIDELLM"
HOW_TO_POINT = f"--guidellm PATH, ${ENV_VAR} or `guidellm` on PATH"
VERSION_TIMEOUT_S = 120.0


class GuideLLMError(RuntimeError):
    """GuideLLM is missing, or a run of it failed; the message is one line."""


@dataclass(frozen=True)
class GuideLLM:
    """A ``guidellm`` executable, its version and where it was found (``--guidellm``, the
    environment variable or PATH)."""

    executable: Path
    version: str
    source: str

    @property
    def name(self) -> str:
        """``"guidellm <version>"``: the ``load_generator`` written into results.json."""
        return f"guidellm {self.version}"


def find_guidellm(flag: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> GuideLLM:
    """The ``guidellm`` to run: ``flag`` (``--guidellm PATH``), else ``$DRAFTSMITH_GUIDELLM``,
    else ``guidellm`` on PATH; its version from ``guidellm --version``.

    Raises:
        GuideLLMError: none of the three names an executable, or it does not answer ``--version``
            (one line, naming the flag and the environment variable).
    """
    env = os.environ if env is None else env
    if flag:
        candidate, source = str(flag), "--guidellm"
    elif env.get(ENV_VAR):
        candidate, source = env[ENV_VAR], f"${ENV_VAR}"
    else:
        candidate, source = "guidellm", "PATH"
    found = shutil.which(candidate, path=env.get("PATH")) if source == "PATH" else shutil.which(candidate)
    if found is None:
        where = "no `guidellm` on PATH" if source == "PATH" else f"{source} = {candidate} is not an executable"
        raise GuideLLMError(f"guidellm not found ({where}); give {HOW_TO_POINT} — install it in its own "
                            "venv: python3 -m venv VENV && VENV/bin/pip install guidellm==0.8.1 (docs/measuring.md)")
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                             env=_child_env(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuideLLMError(f"{found} (from {source}) did not run: {exc}") from None
    m = re.search(r"(\d+\.\d+(?:\.\d+)?\S*)", out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise GuideLLMError(f"{found} (from {source}) --version failed (exit {out.returncode}): {last[0]}")
    return GuideLLM(Path(found), m[1], source)


def _child_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The environment GuideLLM runs in: ours without the Python path and virtual environment
    of this one (GuideLLM's own venv must not import this environment's packages)."""
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def scenario(port: int, model: str, data: Path, num_requests: int, concurrency: int, max_tokens: int,
             temperature: float, report: Path, tokenizer: str | None = None) -> dict[str, Any]:
    """GuideLLM 0.8.1's scenario (the ``spec`` of ``guidellm run --scenario FILE``) for one level:
    ``concurrency`` streams, ``num_requests`` requests of at most ``max_tokens`` output tokens
    at ``temperature`` against ``http://127.0.0.1:port``, the JSON report written to ``report``.
    ``tokenizer`` (default ``model``): the Hugging Face tokenizer GuideLLM loads for its data."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": f"http://127.0.0.1:{port}", "model": model,
                    "request_format": "/v1/chat/completions", "max_tokens": max_tokens,
                    "extras": {"body": {"temperature": temperature}}},
        "profile": {"kind": "concurrent", "streams": [concurrency]},
        "constraints": [{"kind": "max_requests", "count": num_requests}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer or model},
        "data": [{"kind": "json_file", "path": str(data)}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}


def command(guidellm: GuideLLM, scenario_path: Path) -> list[str]:
    """``guidellm run`` on a scenario file, without the interactive progress display (the
    result tables still go to the log)."""
    return [str(guidellm.executable), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]


def run_guidellm(guidellm: GuideLLM, spec: dict[str, Any], scenario_path: Path, log_path: Path,
                 timeout_s: float) -> dict[str, Any]:
    """Write ``spec`` to ``scenario_path``, run GuideLLM on it in its own process group (killed
    with its workers on timeout or interruption) and return its JSON report.

    Raises:
        GuideLLMError: it exited non-zero, ran past ``timeout_s`` seconds or wrote no report
            (one line: the exit, its last log line, the log path and where the executable came from).
    """
    scenario_path.parent.mkdir(parents=True, exist_ok=True)
    scenario_path.write_text(json.dumps(spec, indent=1))
    report = Path(spec["spec"]["outputs"][0]["path"])
    report.unlink(missing_ok=True)
    cmd = command(guidellm, scenario_path)
    with command_log(log_path, cmd) as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_child_env(os.environ))
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout_s:g} s"
        finally:
            if proc.poll() is None:
                stop_process_group(proc, grace_s=10.0)
    if rc != 0 or not report.is_file():
        lines = [ln.strip() for ln in log_tail(log_path).splitlines() if ln.strip()]
        why = f"exit {rc}" if isinstance(rc, int) else rc
        raise GuideLLMError(f"guidellm run failed ({why}): {lines[-1] if lines else 'no output'} — log {log_path}; "
                            f"{guidellm.executable} from {guidellm.source} ({HOW_TO_POINT})")
    try:
        return json.loads(report.read_text())
    except ValueError as exc:
        raise GuideLLMError(f"guidellm report {report} is not JSON ({exc}) — log {log_path}") from None


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default, which vLLM's benchmark uses)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    """vLLM's ``mean_/median_/pNN_<name>_ms`` keys over ``values`` (ms); none without values."""
    if not values:
        return {}
    out = {f"mean_{name}_ms": sum(values) / len(values), f"median_{name}_ms": percentile(values, 50)}
    out.update({f"p{p}_{name}_ms": percentile(values, p) for p in BENCH_PERCENTILES})
    return out


def _prompt_of(record: dict[str, Any]) -> str | None:
    """The user text of a GuideLLM request record (its ``request_args`` body, as sent)."""
    try:
        args = record["request_args"]
        body = (json.loads(args) if isinstance(args, str) else args)["body"]
        content = next(m["content"] for m in body["messages"] if m["role"] == "user")
    except (KeyError, TypeError, ValueError, StopIteration):
        return None
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def bench_result(report: dict[str, Any], prompts: list[str] | None = None) -> dict[str, Any]:
    """GuideLLM's JSON report (one benchmark: one level) as the result dict vLLM's ``bench serve``
    saves (the keys :func:`~draftsmith.eval.serving.metrics.level_metrics` reads): counts,
    ``duration`` (s), throughputs (tokens/s, requests/s), ``mean/median/p50/p95/p99`` of TTFT,
    TPOT and request latency (``e2el``) in ms; no ITL keys (module docstring). With ``prompts``,
    ``generated_texts`` in their order (for the comparison with the baseline's texts).

    Raises:
        ValueError: not a GuideLLM report of exactly one benchmark, or no duration.
    """
    benchmarks = report.get("benchmarks") if isinstance(report, dict) else None
    if not isinstance(benchmarks, list) or len(benchmarks) != 1:
        raise ValueError(f"expected a GuideLLM report with one benchmark, got "
                         f"{len(benchmarks) if isinstance(benchmarks, list) else 'none'}")
    b = benchmarks[0]
    totals, metrics = b["metrics"]["request_totals"], b["metrics"]
    duration = b.get("duration") or 0.0
    if duration <= 0:
        raise ValueError("GuideLLM report has no benchmark duration")
    ok = b["requests"]["successful"]
    out_tokens = metrics["output_token_count"]["successful"]["total_sum"]
    in_tokens = metrics["prompt_token_count"]["successful"]["total_sum"]
    out: dict[str, Any] = {
        "num_prompts": totals["total"], "completed": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"], "duration": duration,
        "total_output_tokens": int(out_tokens), "total_input_tokens": int(in_tokens),
        "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "request_throughput": totals["successful"] / duration,
    }
    if len(ok) == totals["successful"]:  # every request's timings kept (no sampling): latencies from them
        out.update(_stats("ttft", [r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None]))
        out.update(_stats("tpot", [r["inter_token_latency_ms"] for r in ok
                                   if (r.get("output_tokens") or 0) > 1 and r.get("inter_token_latency_ms") is not None]))
        out.update(_stats("e2el", [1000 * r["request_latency"] for r in ok if r.get("request_latency") is not None]))
    if prompts is not None:
        by_prompt = {_prompt_of(r): r.get("output") for r in ok}
        texts = [by_prompt.get(p) for p in prompts]
        out["generated_texts"] = texts if all(t is not None for t in texts) else None
    return out
