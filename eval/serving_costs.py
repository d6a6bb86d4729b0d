"""The serving machine's step costs: seconds per decode step by batch size and K, measured in vLLM.

For every K in ``ks`` one vLLM engine (K = 0: the target alone; K > 0: the draft's
``--speculative-config`` at that K) runs, for every batch size ``b``, ``b`` requests of the same
prompt length together (``max_num_seqs`` = the largest ``b``, every request submitted at once):

``max_tokens=N`` with ``ignore_eos``. vLLM's per-request engine timestamps split the pass into the
prefill of the ``b`` prompts (first scheduling to the last first token: ``prefill_s``, the draft's
own prefill included) and the decode (from there to the last token); where the engine keeps no
timestamps, a ``max_tokens=1`` pass of the same prompts times the prefill instead (prefix caching
is off, so it is paid again).

The decode steps are ``N - 1`` at K = 0 (one token per step after the prefill's); with a draft
they are the verify steps, read from vLLM's own counter: ``num_drafts`` counts one draft per
running request per step, so a step of ``b`` requests adds ``b`` and ``steps = num_drafts / b``
(the last steps, where some requests have finished, count as fractions). Then
``T(b, K) = decode seconds / steps``: one target verification of ``b * (K + 1)`` positions
plus ``K`` draft steps, with the engine's scheduling and sampling included, as served.

The draft's acceptance changes how many steps a request needs, not what a step costs, so the
table is measured on any prompts; the acceptance lengths come from the speculation profile.
What the CPU engine cannot tell apart is the verify and the draft part of a step (vLLM 0.33's
``vllm bench forward`` times them separately on a GPU); the table records the sum.
Each engine runs in its own subprocess (as ``draftsmith acceptance`` does), so its memory is
returned before the next K starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ..procs import bound_command, install_child_reaper
from ..recipe import VllmConfig
from .serving_plan import CostTable, StepCost


def steps_of(k: int, batch_size: int, new_tokens: int, num_drafts: int) -> float:
    """Decode steps of a run of ``batch_size`` requests of ``new_tokens`` tokens each: ``new_tokens
    - 1`` without a draft, ``num_drafts / batch_size`` with one (vLLM counts a draft per running
    request per step).

    Raises:
        ValueError: a speculative run that counted no draft (the engine did not speculate).
    """
    if k == 0:
        return float(max(new_tokens - 1, 1))
    if num_drafts <= 0:
        raise ValueError(f"K={k}, batch {batch_size}: vLLM counted no drafts (the engine did not speculate)")
    return num_drafts / batch_size


def prefill_and_decode(stats: Sequence[Any]) -> tuple[float, float] | None:
    """``(prefill seconds, decode seconds)`` of requests that ran together, from vLLM's per-request
    engine timestamps (``RequestOutput.metrics``: ``scheduled_ts``, ``first_token_ts``,
    ``last_token_ts``, one monotonic clock): the prefill from the first scheduling to the last
    first token, the decode from there to the last token. None when the engine kept no timestamps
    (stats logging off)."""
    if not stats or any(not getattr(s, "first_token_ts", 0) or not getattr(s, "last_token_ts", 0) for s in stats):
        return None
    first = max(s.first_token_ts for s in stats)
    return first - min(s.scheduled_ts for s in stats), max(s.last_token_ts for s in stats) - first


def synthetic_prompt(i: int, length: int, vocab: int, method: str | None) -> list[int]:
    """Prompt ``i`` of ``length`` token ids below ``vocab``. For ngram a 16-token cycle repeated,
    so that the prompt lookup finds a match and drafts at every step (a step without a draft
    would be timed but not counted, ``num_drafts``); otherwise a sequence without repeats."""
    period = 16 if method == "ngram" else length
    return [(17 + 31 * i + 7 * (j % period)) % (vocab - 1) + 1 for j in range(length)]


SCHEDULED_OFF = -1
"""K = 0 scheduled inside the draft's engine (``off`` in the worker's ``--worker-ks``)."""


def worker(args: argparse.Namespace) -> None:
    """Runs inside the subprocess (``draftsmith plan --worker``, :func:`measure_costs`): one engine
    per entry of ``args.worker_ks`` in turn (a K, or ``off``: K = 0 inside the draft's engine; each
    shut down before the next starts), every batch size, the figures to ``args.result``."""
    from ..vllm_bridge.engine import configure_vllm_env

    engine = VllmConfig.model_validate_json(args.engine_json)
    configure_vllm_env(engine)
    install_child_reaper()  # each engine's EngineCore and worker die with this process, SIGKILL included
    spec = json.loads(args.spec_json) if args.spec_json else None
    rows = []
    for k in (SCHEDULED_OFF if k == "off" else int(k) for k in args.worker_ks.split(",")):
        if k == SCHEDULED_OFF:  # K = 0 for every batch size, inside the draft's engine
            off = {**spec, "num_speculative_tokens": 1,
                   "num_speculative_tokens_per_batch_size": [[1, max(args.batch_sizes), 0]]}
            rows += [{**r, "scheduled_off": True} for r in _measure_k(args, engine, off, 0)]
        else:
            rows += _measure_k(args, engine, {**spec, "num_speculative_tokens": k} if spec and k > 0 else None, k)
    Path(args.result).write_text(json.dumps(rows))


def _measure_k(args: argparse.Namespace, engine: VllmConfig, spec: dict[str, Any] | None, k: int) -> list[dict[str, Any]]:
    """One engine at ``k`` draft tokens (``spec`` None: the target alone): every batch size's row."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ..vllm_bridge.engine import llm_kwargs
    from .acceptance import _counter_delta, _spec_counters

    sizes = [int(b) for b in args.batch_sizes]
    llm = LLM(**llm_kwargs(engine.model_copy(update={"max_num_seqs": max(sizes)}), model=str(args.target),
                           speculative_config=spec, disable_log_stats=False, seed=0,
                           enable_prefix_caching=False))  # a cached prefill would shrink the second pass
    try:
        vocab = llm.get_tokenizer().vocab_size
        prompts = [TokensPrompt(prompt_token_ids=synthetic_prompt(i, args.prompt_tokens, vocab, (spec or {}).get("method")))
                   for i in range(max(sizes))]
        first = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(prompts[:1], full, use_tqdm=False)  # warm-up: the first step's one-off costs
        rows = []
        for b in sizes:
            runs: list[tuple[float, float, float, float]] = []
            for _ in range(max(1, args.repeats)):  # the fastest of a few: the machine's noise only adds time
                if repeats_settled([r[0] for r in runs]):
                    break
                before = _spec_counters(llm)
                t0 = time.perf_counter()
                outputs = llm.generate(prompts[:b], full, use_tqdm=False)
                t_all = time.perf_counter() - t0
                drafts = _counter_delta(_spec_counters(llm), before).get("drafts", 0) if spec else 0
                steps = steps_of(k, b, args.new_tokens, int(drafts))
                split = prefill_and_decode([o.metrics for o in outputs])
                if split is None:  # no per-request timestamps: time a prefill-only pass of the same prompts
                    t0 = time.perf_counter()
                    llm.generate(prompts[:b], first, use_tqdm=False)
                    t_prefill = time.perf_counter() - t0
                    split = (t_prefill, t_all - t_prefill)
                runs.append((max(split[1], 1e-9) / steps, steps, split[0], t_all))
            step_s, steps, t_prefill, t_all = min(runs)
            rows.append({"batch_size": b, "k": k, "step_s": step_s, "steps": max(1, round(steps)),
                         "step_s_runs": [r[0] for r in runs], "prefill_s": t_prefill, "total_s": t_all})
        return rows
    finally:  # the engine core's process and the model go before the next K's engine starts
        with contextlib.suppress(Exception):  # no grace period: nothing of the engine is needed any more (its
            llm.llm_engine.engine_core.shutdown(timeout=0)  # worker dies with it, draftsmith.procs)
        del llm
        gc.collect()


#: two passes of a (batch size, K) entry within this fraction of each other settle it: a further pass
#: of the fastest-of-``repeats`` would change the entry by less than the machine's noise
SETTLED = 0.02


def repeats_settled(step_s: Sequence[float], tolerance: float = SETTLED) -> bool:
    """Whether the passes so far settle an entry: its two fastest seconds per step within
    ``tolerance`` (a fraction) of each other. Fewer than two passes never do."""
    if len(step_s) < 2:
        return False
    a, b = sorted(step_s)[:2]
    return b - a <= tolerance * a


def measure_costs(target: Path, speculative_config: dict[str, Any] | None, ks: Sequence[int],
                  batch_sizes: Sequence[int], *, prompt_tokens: int = 256, new_tokens: int = 64, repeats: int = 3,
                  temperature: float = 0.0, engine: VllmConfig | None = None, draft: str | None = None,
                  method: str | None = None, log_dir: Path | None = None,
                  timeout_s: float | None = None, one_process: bool | None = None,
                  scheduled_off: bool | None = None) -> CostTable:
    """The cost table of ``target`` (and the draft of ``speculative_config``, without
    ``num_speculative_tokens``) at every K of ``ks`` and batch size of ``batch_sizes``; each entry
    the fastest of at most ``repeats`` passes (another process on the machine only adds time),
    stopping at two that agree within :data:`SETTLED` (:func:`repeats_settled`).

    ``one_process``: every K's engine in turn in one subprocess (each shut down before the next:
    one Python and vLLM import instead of one per K, about 10 s each on 2 CPU cores); False: a
    subprocess per K, so that all of an engine's memory is returned to the system before the next
    starts (what a GPU needs: its caching allocator keeps freed blocks). None: one process where
    no CUDA device is visible.

    ``scheduled_off``: also measure K = 0 inside the draft's engine (a per-batch-size schedule of
    K = 0 everywhere; the entries marked ``scheduled_off``): what a plan's K = 0 range costs, which
    is more than the target alone where the drafter still runs (EAGLE keeps its KV cache current).
    None: where the installed vLLM reads per-batch-size K.

    Raises:
        ValueError: a K > 0 without a speculative config, or a batch size below 1.
        RuntimeError: an engine failed (one line naming K and the log).
        subprocess.TimeoutExpired: one engine ran past ``timeout_s``.
    """
    from ..vllm_bridge.engine import engine_env
    from .acceptance import vllm_version

    engine = engine or VllmConfig()
    if any(k > 0 for k in ks) and not speculative_config:
        raise ValueError("K > 0 needs the draft's speculative config (--draft)")
    if min(batch_sizes) < 1:
        raise ValueError(f"batch sizes {list(batch_sizes)}: each must be at least 1")
    if one_process is None:
        import torch

        one_process = not torch.cuda.is_available()
    ks = sorted(set(ks))
    if scheduled_off is None:
        from ..vllm_bridge.releases import installed_vllm_version, release_line
        from .serving_plan import PER_BATCH_SIZE_FROM

        installed = installed_vllm_version()
        scheduled_off = bool(installed) and release_line(installed) >= release_line(PER_BATCH_SIZE_FROM)
    if speculative_config and 0 in ks and scheduled_off:
        ks.append(SCHEDULED_OFF)
    groups = [ks] if one_process else [[k] for k in ks]
    costs: list[StepCost] = []
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            name = "_".join("off" if k == SCHEDULED_OFF else str(k) for k in group)
            result = Path(tmp) / f"k{name}.json"
            cmd = [sys.executable, "-m", "draftsmith.cli.plan", "--worker", "--result", str(result),
                   "--target", str(target), "--worker-ks", name.replace("_", ","), "--batch-sizes", ",".join(map(str, batch_sizes)),
                   "--engine-json", engine.model_dump_json(),
                   "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens), "--repeats", str(repeats),
                   "--temperature", str(temperature), "--spec-json", json.dumps(speculative_config) if speculative_config else ""]
            log = Path(log_dir or tmp) / f"costs_k{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("w") as fh:
                proc = subprocess.run(bound_command(cmd), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1", **engine_env(engine)))
            if proc.returncode != 0 or not result.is_file():
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
                raise RuntimeError(f"cost measurement at K={name.replace('_', ',')} failed (exit {proc.returncode}): {tail[0]} "
                                   f"(log: {log if log_dir else 'pass --log-dir to keep it'})")
            costs += [StepCost(**{key: r[key] for key in ("batch_size", "k", "step_s", "steps", "prefill_s")},
                               scheduled_off=bool(r.get("scheduled_off")))
                      for r in json.loads(result.read_text())]
    return CostTable(source="measured: vllm engine (offline LLM, every request submitted at once)",
                     machine={"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count()},
                     target=str(target), draft=draft, method=method, engine_version=vllm_version(),
                     prompt_tokens=prompt_tokens, output_tokens=new_tokens, costs=costs)
