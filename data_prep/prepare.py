"""Data preparation CLI: conversations -> token ids + loss masks -> draft vocab -> hidden states.

    draftsmith prepare RECIPE.yaml --run-dir runs/x [--stage STAGE] [--set k=v]

Stages (each reruns alone and skips finished work): ``target`` (resolve / dequantise the
target), ``regenerate`` (target replies, cached), ``tokenize`` (chat template + assistant
mask), ``vocab`` (draft vocab d2t/t2d), ``hidden-states`` (aux + final states, sharded).
Everything lands under ``RUN_DIR/data``. The hidden-states stage captures with
``data.hidden_states_engine`` (transformers hooks or vLLM's ``extract_hidden_states``) and
splits its shards across processes launched with ``RANK``/``WORLD_SIZE`` (torchrun,
``accelerate launch``; each process binds its local rank's GPU through ``CUDA_VISIBLE_DEVICES``
before CUDA or vLLM starts, :func:`~draftsmith.data_prep.ranks.bind_local_device`; the per-rank
and per-node orchestration is :mod:`draftsmith.data_prep.ranks`):

    torchrun --nproc-per-node 8 -m draftsmith.cli.prepare RECIPE.yaml --run-dir runs/x --stage hidden-states

The plan (engines, devices, shards, disk) is printed first; ``--dry-run`` prints it alone.
Before anything is written the run directory's data is compared with the recipe
(:mod:`draftsmith.data_prep.agreement`): data prepared with other keys (aux layer ids, max
length, storage dtype ...) is refused with one line, or deleted first with ``--overwrite-data``.
Shards already on disk are kept only when they check out (``--verify-shards``: hashed too).
Inside a training launch the stages run in child processes (``--node`` / ``--capture-share``,
:mod:`draftsmith.data_prep.launch`); docs/data_stage.md describes both.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import save_file

from . import conversations as conv
from . import hidden_states as hs
from .agreement import (
    CONTENT_KEY,
    check_run_dir,
    read_spec,
    source_contents,
    hidden_states_keys,
    record_stage,
    target_keys,
    tokenize_keys,
    vocab_keys,
)
from ..target.capture import CaptureEngine, LazyCapture, TransformersCapture
from .plan import Cluster, DataPlan, build_plan
from .preflight import preflight_run  # noqa: F401 (the CLI's checks before any stage)
from ..fileio import atomic_write_bytes
from .shards import MANIFEST, ShardSpec, distributed_rank
from . import chat_engines
from . import regenerate as regen
from . import served_turns
from .token_rows import TokenizeRow, history_counts
from .. import target as tgt
from ..target import TargetInfo, text_config
from . import vocab
from ..layout import DataPaths, RunLayout, read_tokenized
from ..recipe import Recipe

log = logging.getLogger("draftsmith.prepare")
STAGES = ["target", "regenerate", "tokenize", "vocab", "hidden-states"]


def stage_target(recipe: Recipe, paths: DataPaths) -> TargetInfo:
    """Resolve the target and fix the aux layer ids; writes ``target.json``."""
    path = tgt.resolve_target(recipe.target.name_or_path, recipe.target.trust_remote_code)
    config = tgt.load_target_config(path, recipe.target.trust_remote_code)
    text = text_config(config)
    n = tgt.num_decoder_layers(config)
    ids = tgt.aux_layer_ids(recipe.data.aux_layer_ids, n)
    info = TargetInfo(
        name_or_path=recipe.target.name_or_path,
        verifier=tgt.verifier_name(recipe.target.name_or_path),
        path=str(path),
        architectures=list(getattr(config, "architectures", None) or []),
        num_hidden_layers=n,
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        aux_layer_ids=ids,
    )
    paths.root.mkdir(parents=True, exist_ok=True)
    record_stage(paths, "target", target_keys(recipe, ids))
    atomic_write_bytes(paths.target_info, info.to_json().encode())  # every node's child may write it
    log.info("target %s: %d layers, H=%d, V=%d, aux layers %s", path, n, info.hidden_size, info.vocab_size, ids)
    return info


def iter_sources(recipe: Recipe, reports: list[str] | None = None) -> Iterator[dict]:
    """Every source's records in order, read lazily, and no more than ``data.max_samples`` of
    them in all: a source is read only as far as the budget left reaches (and each no further
    than its own ``max_rows``). With more than one source, each id is prefixed with its
    source's index (``"{i}:{id}"``), so two sources that both number their rows from 0 keep all
    their rows (in the regeneration cache, too); within one source,
    :func:`~draftsmith.data_prep.conversations.iter_records` already renames repeated ids.
    Each finished source's :meth:`~draftsmith.data_prep.conversations.LoadReport.summary` is
    logged and appended to ``reports``.

    Raises:
        DataError: a source with no usable row (strict mode: the first bad row), naming it.
    """
    left = recipe.data.max_samples
    multi = len(recipe.data.sources) > 1
    for i, src in enumerate(recipe.data.sources):
        if left is not None and left <= 0:
            log.info("data.max_samples=%d reached: source %d (%s) and later ones not read",
                     recipe.data.max_samples, i, src.path)
            break
        cap = src.max_rows if left is None else min(left, src.max_rows or left)
        report = conv.LoadReport(source=src.path)
        for r in conv.iter_records(src.path, src.format, src.split, cap, recipe.data.strict, report):
            yield dict(r, id=f"{i}:{r['id']}") if multi else r
        if left is not None:
            left -= report.kept
        log.info(report.summary())
        if reports is not None:
            reports.append(report.summary())


def load_sources(recipe: Recipe) -> tuple[list[dict], list[str]]:
    """:func:`iter_sources` as a list, with the sources' reports."""
    reports: list[str] = []
    records = list(iter_sources(recipe, reports))
    return records, reports


def _engine_factory(recipe: Recipe, target_dir: Path, device: str | None = None, log_path: Path | None = None,
                    plan: DataPlan | None = None, record: Path | None = None, thinking: bool = False):
    """``() -> ChatEngine`` for ``data.regenerate.engine`` (``auto`` resolved by
    :func:`~draftsmith.data_prep.chat_engines.resolve_engine`): in-process vLLM or the vLLM
    server (with ``log_path`` for its log) with the recipe's ``vllm`` at the ``plan``'s
    tensor / data parallel sizes, or transformers on ``device``
    (:func:`draftsmith.target.default_device`). The factory's ``engine`` attribute
    names the resolved engine; building it is noted in ``record`` (:func:`note_engine`). Every
    engine renders with ``data.chat_template_kwargs``; ``thinking``: the server engine splits each
    reply's reasoning from its answer before the next turn's request."""
    cfg = recipe.data.regenerate
    kwargs = dict(recipe.data.chat_template_kwargs)
    engine = chat_engines.resolve_engine(cfg.engine, recipe.vllm)
    log.info("regeneration engine: %s (data.regenerate.engine=%s)", engine, cfg.engine)
    vllm_cfg = recipe.vllm
    if plan is not None and plan.regenerate is not None and plan.cluster.gpus_per_node:
        vllm_cfg = vllm_cfg.model_copy(update={"tensor_parallel_size": plan.regenerate["tensor_parallel_size"],
                                               "data_parallel_size": plan.regenerate["data_parallel_size"]})

    def make():
        note_engine(record, "regenerate", engine)
        make.built = _make()
        return make.built

    def _make():
        if engine == "vllm":
            return chat_engines.VllmChatEngine(target_dir, recipe.seed, vllm_cfg,
                                               trust_remote_code=recipe.target.trust_remote_code,
                                               template_kwargs=kwargs)
        if engine == "vllm-server":
            return chat_engines.ServerChatEngine(target_dir, recipe.seed, vllm_cfg, concurrency=cfg.concurrency,
                                                 max_retries=cfg.max_retries, server_urls=cfg.server_urls,
                                                 log_path=log_path, trust_remote_code=recipe.target.trust_remote_code,
                                                 template_kwargs=kwargs, thinking=thinking)
        model, tok = tgt.load_target(target_dir, getattr(torch, recipe.target.dtype), recipe.target.trust_remote_code,
                                     device=device)
        return chat_engines.TransformersChatEngine(model, tok, recipe.seed, template_kwargs=kwargs)

    make.engine, make.built = engine, None
    return make


def node_cache(paths: DataPaths, node: int, nodes: int) -> Path:
    """The regeneration cache node ``node`` of ``nodes`` writes (merged into ``regen.jsonl``)."""
    return paths.root / f"regen.node-{node:03d}-of-{nodes:03d}.jsonl"


def stage_regenerate(recipe: Recipe, paths: DataPaths, info: TargetInfo, device: str | None = None,
                     share: tuple[int, int] | None = None, plan: DataPlan | None = None,
                     record: Path | None = None, stats: dict | None = None) -> tuple[Iterator[dict], list[str]]:
    """The sources with the target's replies (``data.regenerate``), cached in ``regen.jsonl``
    with a fingerprint per row (:func:`~draftsmith.data_prep.regenerate.iter_regenerated`).
    Streams: returns an iterator over the records and the list the sources' reports are
    appended to as each source is read to its end; the engine (and the server it may have
    started) is shut down before the last records are handed on. ``share=(node, nodes)``:
    only that node's conversations, cached in :func:`node_cache`. ``stats`` receives the
    measured throughput (``regenerate_tok_s``, ``regenerate_tok_s_per_gpu``) at the end."""
    reports: list[str] = []
    records = iter_sources(recipe, reports)
    cfg = recipe.data.regenerate
    if cfg.enabled:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(info.path, trust_remote_code=recipe.target.trust_remote_code)
        # only harmony (gpt-oss) templates read reasoning_effort
        harmony = conv.is_harmony_template(tok) if cfg.reasoning_effort else False
        _check_template_kwargs(tok, recipe)
        thinking = served_turns.is_thinking_template(tok)
        suffix = "" if share is None else f".node-{share[0]:03d}"
        factory = _engine_factory(recipe, Path(info.path), device, log_path=paths.root / f"regen_server{suffix}.log",
                                  plan=plan, record=record, thinking=thinking)
        base = {"target": regen.target_id(info.name_or_path, info.path),
                "chat_template_sha256": regen.chat_template_sha256(tok),
                "engine": chat_engines.ENGINE_FAMILY[factory.engine],
                "chat_template_kwargs": dict(recipe.data.chat_template_kwargs) or None}
        if cfg.samples_per_prompt > 1:
            records = regen.repeat_prompts(records, cfg.samples_per_prompt)
        records = regen.iter_regenerated(
            records, paths.regen if share is None else node_cache(paths, *share), factory, cfg.temperatures,
            cfg.max_new_tokens, cfg.batch_size, reasoning_effort=cfg.reasoning_effort, harmony=harmony,
            seed=recipe.seed, fingerprint_base=base, share=share, thinking=thinking,
        )
        gpus = plan.regenerate["gpus"] if plan is not None and plan.regenerate else 0
        records = _measured(records, factory, gpus, stats if stats is not None else {})
    return records, reports


def _measured(records: Iterator[dict], factory: Any, gpus: int, stats: dict) -> Iterator[dict]:
    """``records`` passed through; once they are exhausted, the regeneration throughput (tokens the
    engine reports generating, per second of the stage and per GPU) goes into ``stats`` and the log."""
    t0 = time.perf_counter()
    yield from records
    tokens = getattr(factory.built, "completion_tokens", None)
    if tokens:
        rate = tokens / (time.perf_counter() - t0)
        stats["regenerate_tok_s"] = rate
        if gpus:
            stats["regenerate_tok_s_per_gpu"] = rate / gpus
        log.info("regeneration: %d tokens at %.0f tok/s%s", tokens, rate,
                 f" ({rate / gpus:.0f} tok/s per GPU over {gpus} GPUs)" if gpus else "")


def _check_template_kwargs(tok: Any, recipe: Recipe) -> None:
    """``data.chat_template_kwargs`` against the target's chat template
    (:func:`~draftsmith.data_prep.served_turns.check_template_kwargs`).

    Raises:
        DataError: a kwarg the template never reads, named ``data.chat_template_kwargs.<name>``.
    """
    try:
        served_turns.check_template_kwargs(tok, dict(recipe.data.chat_template_kwargs))
    except served_turns.TemplateError as exc:
        raise conv.DataError(str(exc)) from None


def stage_tokenize(recipe: Recipe, paths: DataPaths, info: TargetInfo, records: Iterable[dict], reports: list[str]):
    """Tokenise, mask, and apply the over-long policy with ``datasets.map`` (``data.num_proc``
    processes) over ``records`` streamed into an Arrow dataset (``reports``: the sources'
    summaries, complete once ``records`` is exhausted); writes the Arrow dataset ``tokenized/`` (atomically: saved to a temporary
    directory, then renamed into place) and stats. Returns the dataset, memory-mapped.

    Raises:
        DataError: the data yields zero trainable (assistant) tokens; in strict mode, the first
            invalid row.
    """
    import uuid

    import datasets
    import numpy as np
    from transformers import AutoTokenizer

    from ..layout import remove_stale_tokenized_temps, save_tokenized, tokenized_features, tokenized_temp_dir

    tok = AutoTokenizer.from_pretrained(info.path, trust_remote_code=recipe.target.trust_remote_code)
    keys = tokenize_keys(recipe, regen.chat_template_sha256(tok), history=False)  # added once known to matter
    keys[CONTENT_KEY] = source_contents(recipe, read_spec(paths).get("tokenize", {}).get(CONTENT_KEY))
    record_stage(paths, "tokenize", keys)
    max_len = recipe.data.max_length
    channels = tuple(recipe.data.harmony_channels) if conv.is_harmony_template(tok) else None
    _check_template_kwargs(tok, recipe)
    if channels is not None:
        log.info("harmony chat template: loss on assistant channels %s", channels)
    remove_stale_tokenized_temps(paths)  # of a killed run: never taken as a finished dataset
    tmp = tokenized_temp_dir(paths)
    try:
        def rows():
            for r in records:
                yield {"record": json.dumps(r, default=str)}

        cache = str(tmp / "cache")
        try:
            raw = datasets.Dataset.from_generator(rows, features=datasets.Features({"record": datasets.Value("string")}),
                                                  cache_dir=cache, fingerprint=uuid.uuid4().hex)
        except datasets.exceptions.DatasetGenerationError as exc:
            # the records stream (a source, the regeneration) failed: raise its own error
            if exc.__cause__ is not None:
                raise exc.__cause__ from None
            raise
        features = tokenized_features().copy()
        features.update({"status": datasets.Value("string"), "error": datasets.Value("string"),
                         "truncated": datasets.Value("bool"), "assistant_tokens": datasets.Value("int64"),
                         "turn": datasets.Value("int64"), "unlabelled": datasets.Value("int64")})
        num_proc = min(recipe.data.num_proc, max(1, len(raw)))
        mapped = raw.map(TokenizeRow(tok, max_len, channels, info.vocab_size, recipe.data.overlong,
                                     recipe.data.chat_template_kwargs, recipe.data.history_turns),
                         batched=True, remove_columns=["record"], features=features,
                         num_proc=num_proc if num_proc > 1 else None, new_fingerprint=uuid.uuid4().hex, desc="tokenize")
        meta = mapped.select_columns(["status", "truncated", "assistant_tokens", "length", "turn", "unlabelled"]
                                     ).with_format("numpy")[:]
        status = np.asarray(meta["status"]).astype(str)
        ok = status == "ok"
        skipped = {k: int((status == k).sum()) for k in ("no_assistant_turn", "invalid", "overlong_dropped")}
        invalid = np.flatnonzero(status == "invalid")
        first_bad = mapped[int(invalid[0])]["error"] if len(invalid) else None
        if recipe.data.strict and first_bad is not None:
            raise conv.DataError(first_bad)
        truncated = int(np.asarray(meta["truncated"]).sum())
        n_seq = int(ok.sum())
        n_tok = int(np.asarray(meta["length"])[ok].sum())
        n_asst = int(np.asarray(meta["assistant_tokens"])[ok].sum())
        if n_asst == 0:
            raise conv.DataError(f"the data yields zero trainable assistant tokens (skipped: {skipped}; first: {first_bad})")
        history = history_counts(recipe.data.history_turns, meta, ok)
        if history["conversations"]:  # the template rewrote history: the data depends on data.history_turns
            record_stage(paths, "tokenize", dict(keys, **tokenize_keys(recipe, keys["chat_template_sha256"])))
        kept = mapped.select(np.flatnonzero(ok)).select_columns(list(tokenized_features()))
        save_tokenized(paths, kept, tmp)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    stats = {
        "sources": reports,
        "sequences": n_seq,
        "tokens": n_tok,
        "assistant_tokens": n_asst,
        "truncated": truncated,
        "skipped": skipped,
        "first_skipped_reason": first_bad,
        "history_turns": history,
    }
    paths.stats.write_text(json.dumps(stats, indent=1))
    log.info("tokenised %d sequences, %d tokens (%d assistant); truncated %d; skipped %s",
             n_seq, n_tok, n_asst, truncated, skipped)
    return read_tokenized(paths)


def stage_vocab(recipe: Recipe, paths: DataPaths, info: TargetInfo, records) -> dict:
    """Draft vocab from ``records`` (the memory-mapped tokenised dataset, counted in batches)."""
    V = info.vocab_size
    Vd = min(recipe.data.draft_vocab_size, V)
    if recipe.data.draft_vocab_size > V:
        log.warning("draft_vocab_size %d > target vocab %d: capped at %d", recipe.data.draft_vocab_size, V, V)
    counts = vocab.count_assistant_tokens(records)
    d2t, t2d = vocab.build_draft_vocab(counts, V, Vd)
    record_stage(paths, "vocab", vocab_keys(recipe, V))
    save_file({"d2t": d2t, "t2d": t2d}, str(paths.vocab))
    cov = vocab.coverage(counts, t2d)
    log.info("draft vocab: %d of %d target ids, covering %.2f%% of assistant tokens", Vd, V, 100 * cov)
    return {"draft_vocab_size": Vd, "coverage": cov, "distinct_assistant_tokens": len(counts)}


def stage_hidden_states(recipe: Recipe, paths: DataPaths, info: TargetInfo, records, device: str | None = None,
                        share: tuple[int, int] | None = None, plan: DataPlan | None = None,
                        record: Path | None = None, verify: str = "header") -> dict:
    """Capture the shards with ``data.hidden_states_engine``: this process's share of them,
    ``share=(index, count)`` (shards ``i % count == index``; default: ``RANK`` / ``WORLD_SIZE``,
    :func:`~draftsmith.data_prep.shards.distributed_rank`). The transformers engine runs the
    target on ``device`` (default: this process's accelerator,
    :func:`draftsmith.target.default_device`); vLLM runs with the recipe's ``vllm`` at
    ``target.dtype`` and the ``plan``'s tensor-parallel size, its context raised to
    ``data.max_length`` if shorter, its per-request files under ``hidden_states/.vllm-work``.
    Shards already on disk are kept when they check out (``verify``: ``header``, or ``full`` to
    hash them too) and recomputed otherwise, one log line naming each. Each captured sequence is
    scored (the target's entropy and flatness over the draft vocab, ``data.select``;
    :mod:`draftsmith.data_prep.scores`) when the vocab stage's file exists.

    Raises:
        DiskFullError: the file system holding the shards has less free space than the shards
            left to capture need.
    """
    from ..target import vllm_capture as vhs
    from ..fileio import check_free_space
    from .scores import SequenceScorer
    from .shards import bytes_per_token

    engine = vhs.resolve_engine(recipe.data.hidden_states_engine)
    log.info("hidden-states engine: %s (data.hidden_states_engine=%s)", engine, recipe.data.hidden_states_engine)
    target_dir = Path(info.path)
    rank, world = share or distributed_rank()

    def make() -> CaptureEngine:  # built on first use: nothing starts when every shard exists
        note_engine(record, "capture", engine)
        if engine == "vllm":
            v = recipe.vllm
            tp = plan.capture["tensor_parallel_size"] if plan is not None and plan.capture else v.tensor_parallel_size
            # the states must be those of the dtype the transformers engine would capture at
            v = v.model_copy(update={"dtype": recipe.target.dtype, "tensor_parallel_size": tp, "data_parallel_size": 1,
                                     "max_model_len": None if v.max_model_len is None
                                     else max(v.max_model_len, recipe.data.max_length)})
            return vhs.VllmHiddenStateCapture(target_dir, info.aux_layer_ids, v, recipe.seed,
                                              work_dir=paths.hidden_states / ".vllm-work",
                                              trust_remote_code=recipe.target.trust_remote_code,
                                              batch_tokens=recipe.data.capture_batch_tokens)
        model, _ = tgt.load_target(target_dir, getattr(torch, recipe.target.dtype), recipe.target.trust_remote_code,
                                   device=device)
        return TransformersCapture(model, info.aux_layer_ids, recipe.data.capture_batch_tokens)

    spec = ShardSpec(info.hidden_size, info.aux_layer_ids, recipe.data.hidden_states_dtype)
    record_stage(paths, "hidden-states", hidden_states_keys(recipe, spec.aux_layer_ids))
    # refuse before any forward when the disk cannot hold this process's share (an even split
    # of the tokens; on a shared file system the others' shares come on top)
    need = int(hs._record_lengths(records).sum()) * bytes_per_token(spec.hidden_size, spec.dtype) // world
    check_free_space(paths.hidden_states if paths.hidden_states.exists() else paths.root, need,
                     "the hidden-state shards" + (f" of share {rank}/{world}" if world > 1 else ""))
    manifest = hs.generate_hidden_states(
        LazyCapture(engine, make), records, paths.hidden_states, spec, recipe.data.sequences_per_shard,
        recipe.data.capture_batch_tokens, target_id=info.name_or_path, rank=rank, world_size=world,
        shard_bytes=recipe.data.shard_bytes, verify=verify,
        scorer=SequenceScorer.for_target(target_dir, paths.vocab),  # data.select's scores, at capture
    )
    rate = manifest["throughput_tok_s"]
    log.info("hidden states: %d shards, %d tokens%s", len(manifest["shards"]), manifest["num_tokens"],
             f", captured at {rate:.0f} tok/s" if rate else " (all shards already on disk)")
    return manifest


def note_engine(record: Path | None, stage: str, engine: str) -> None:
    """Note in ``record`` (this process's JSON under ``RUN_DIR/data/procs``, :func:`process_record`)
    that it built a target engine: which stage, which engine, and the ``CUDA_VISIBLE_DEVICES``
    it was built under (what the engine's processes inherit)."""
    if record is None:
        return
    data = json.loads(record.read_text()) if record.is_file() else {}
    data.setdefault("engines", []).append({"stage": stage, "engine": engine,
                                           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")})
    atomic_write_bytes(record, json.dumps(data, indent=1).encode())


def process_record(paths: DataPaths, role: str, **fields) -> Path:
    """Write ``RUN_DIR/data/procs/<role>.<pid>.json``: which process ran which part of the data
    stage (``role``, ``pid``, parent pid, node / rank fields given, ``CUDA_VISIBLE_DEVICES``);
    :func:`note_engine` adds the engines it built. Returns the file."""
    d = paths.root / "procs"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{role}.{os.getpid()}.json"
    atomic_write_bytes(path, json.dumps({"role": role, "pid": os.getpid(), "ppid": os.getppid(), **fields,
                                         "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                         "engines": []}, indent=1).encode())
    return path


def data_plan(recipe: Recipe, run_dir: Path, info: TargetInfo | None = None, stages: list[str] | None = None,
              cluster: Cluster | None = None, tokens: int | None = None) -> DataPlan:
    """The plan of the data stage (:func:`draftsmith.data_prep.plan.build_plan`) for the stages
    left to run: the target's ``config.json`` from ``info`` (``target.json``) when the target
    stage ran, else from :func:`~draftsmith.target.load_config_json` (shipped copies
    of the GPU targets' configs, no download)."""
    stages = stages or STAGES
    if info is not None:
        config_json = json.loads((Path(info.path) / "config.json").read_text())
    else:
        config_json, _ = tgt.load_config_json(recipe, None)
    return build_plan(recipe, config_json, cluster or Cluster.detect(), run_dir=run_dir,
                      regenerate=recipe.data.regenerate.enabled and "regenerate" in stages,
                      capture="hidden-states" in stages, tokens=tokens)


def log_plan(plan: DataPlan, paths: DataPaths | None = None) -> None:
    """Print the plan (log lines) and keep it as ``data/plan.json``."""
    for line in plan.format().splitlines():
        log.info(line)
    if paths is not None:
        paths.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(paths.root / "plan.json", json.dumps(plan.to_dict(), indent=1, default=str).encode())


def stage_outputs(recipe: Recipe, paths: DataPaths) -> dict[str, list[Path]]:
    """The files each stage leaves behind when it has finished (``regenerate``'s cache is
    completed by rerunning it, so it counts as done once ``tokenize`` is)."""
    return {
        "target": [paths.target_info],
        "regenerate": [paths.tokenized_done],
        "tokenize": [paths.tokenized_done],
        "vocab": [paths.vocab],
        "hidden-states": [] if recipe.data.hidden_states_mode == "online" else [paths.hidden_states / MANIFEST],
    }


def missing_stages(recipe: Recipe, run_dir: Path) -> list[str]:
    """The stages to run so that ``run_dir/data`` is ready for training: the first stage whose
    output is missing and every stage after it (in :data:`STAGES` order); ``[]`` when ready."""
    paths = RunLayout(run_dir).data
    outputs = stage_outputs(recipe, paths)

    for i, stage in enumerate(STAGES):
        if not all(p.is_file() for p in outputs[stage]):
            return STAGES[i:]
    return []


def prepare(recipe: Recipe, run_dir: Path, stages: list[str] | None = None, device: str | None = None,
            capture_share: tuple[int, int] | None = None, plan: DataPlan | None = None,
            record: Path | None = None, verify_shards: bool = False) -> dict:
    """Run the data stages in order; returns a summary dict (also saved as ``data/summary.json``).

    Args:
        device: where the transformers engines run the target (default: this process's
            accelerator, :func:`draftsmith.target.default_device`).
        capture_share: ``(index, count)`` of the hidden-state shards this process captures
            (default: ``RANK`` / ``WORLD_SIZE``).
        plan: the data plan (default: made here, after the target stage, and printed).
        record: this process's record under ``data/procs`` (:func:`process_record`).
        verify_shards: hash the shards already on disk against their manifest sha256 before
            keeping them (default: their size and header are checked).

    Raises:
        RunDirMismatchError: ``RUN_DIR/data`` was prepared with other recipe keys
            (:func:`~draftsmith.data_prep.agreement.check_run_dir`); raised before anything is written.
        PlanError: the plan refuses the recipe (e.g. ``data.shard_bytes`` below one sequence).
        DiskFullError: the shards need more space than the file system has free.
    """
    from ..fileio import check_free_space

    stages = stages or STAGES
    check_run_dir(recipe, run_dir, stages)  # before the first write
    paths = RunLayout(run_dir).data
    paths.root.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    t0 = time.perf_counter()
    info = stage_target(recipe, paths) if "target" in stages or not paths.target_info.is_file() else TargetInfo.read(paths.target_info)
    if plan is None:
        plan = data_plan(recipe, run_dir, info, stages)
        log_plan(plan, paths if distributed_rank()[0] == 0 else None)
    if plan.disk["need_bytes"] and "hidden-states" in stages and capture_share is None and distributed_rank()[1] == 1:
        check_free_space(paths.root, plan.disk["need_bytes"], f"the hidden-state shards ({plan.disk['tokens_source']})")
    records = None
    if "regenerate" in stages or "tokenize" in stages:
        t = time.perf_counter()
        raw, reports = stage_regenerate(recipe, paths, info, device, plan=plan, record=record, stats=summary)
        if "tokenize" in stages:  # regeneration streams into tokenisation: one time for both
            records = stage_tokenize(recipe, paths, info, raw, reports)
            summary["regenerate_tokenize_s"] = time.perf_counter() - t
        else:
            collections.deque(raw, maxlen=0)
            summary["regenerate_s"] = time.perf_counter() - t
    if "vocab" in stages:
        records = records if records is not None else read_tokenized(paths)
        summary["vocab"] = stage_vocab(recipe, paths, info, records)
    if "hidden-states" in stages and recipe.data.hidden_states_mode == "online":
        log.info("hidden_states_mode=online: no shards; the trainer runs the target on each batch")
    elif "hidden-states" in stages:
        records = records if records is not None else read_tokenized(paths)
        t = time.perf_counter()
        m = stage_hidden_states(recipe, paths, info, records, device, share=capture_share, plan=plan, record=record,
                                verify="full" if verify_shards else "header")
        summary["hidden_states"] = {"tokens": m["num_tokens"], "throughput_tok_s": m["throughput_tok_s"],
                                    "seconds": time.perf_counter() - t}
    summary["seconds"] = time.perf_counter() - t0
    if distributed_rank()[0] == 0 and capture_share is None:  # one writer when several processes capture
        paths.summary.write_text(json.dumps(summary, indent=1))
    return summary
