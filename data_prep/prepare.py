"""Data preparation CLI: conversations -> token ids + loss masks -> draft vocab -> hidden states.

    draftsmith prepare RECIPE.yaml --run-dir runs/x [--stage STAGE] [--set k=v]

Stages (each reruns alone and skips finished work): ``target`` (resolve / dequantise the
target), ``regenerate`` (target replies, cached), ``tokenize`` (chat template + assistant
mask), ``vocab`` (draft vocab d2t/t2d), ``hidden-states`` (aux + final states, sharded).
Everything lands under ``RUN_DIR/data``. The hidden-states stage captures with
``data.hidden_states_engine`` (transformers hooks or vLLM's ``extract_hidden_states``) and
splits its shards across processes launched with ``RANK``/``WORLD_SIZE`` (torchrun,
``accelerate launch``; each process binds its local rank's GPU through ``CUDA_VISIBLE_DEVICES``
before CUDA or vLLM starts, :func:`bind_local_device`):

    torchrun --nproc-per-node 8 -m draftsmith.data_prep.prepare RECIPE.yaml --run-dir runs/x --stage hidden-states

The plan (engines, devices, shards, disk) is printed first; ``--dry-run`` prints it alone.
Before anything is written the run directory's data is compared with the recipe
(:mod:`draftsmith.data_prep.agreement`): data prepared with other keys (aux layer ids, max
length, storage dtype ...) is refused with one line, or deleted first with ``--overwrite-data``.
Shards already on disk are kept only when they check out (``--verify-shards``: hashed too).
Inside a training launch the stages run in child processes (``--node`` / ``--capture-share``,
:mod:`draftsmith.data_prep.launch`); docs/data_stage.md describes both.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors.torch import save_file

from . import conversations as conv
from . import hidden_states as hs
from .agreement import (
    check_run_dir,
    hidden_states_keys,
    recipe_arg,
    record_stage,
    remove_data,
    target_keys,
    tokenize_keys,
    vocab_keys,
)
from .capture import CaptureEngine, LazyCapture, TransformersCapture
from .plan import Cluster, DataPlan, PlanError, build_plan, parse_share
from .shards import MANIFEST, ShardError, ShardSpec, atomic_write_bytes, distributed_rank
from . import regenerate as regen
from . import target as tgt
from ..models.common import text_config
from . import vocab
from ..cli import add_recipe_arguments, recipe_from_args, setup_logging
from ..layout import DataPaths, RunLayout, read_tokenized
from ..recipe import Recipe, dump_recipe

log = logging.getLogger("draftsmith.prepare")
STAGES = ["target", "regenerate", "tokenize", "vocab", "hidden-states"]


def stage_target(recipe: Recipe, paths: DataPaths) -> dict:
    """Resolve the target and fix the aux layer ids; writes ``target.json``."""
    path = tgt.resolve_target(recipe.target.name_or_path, recipe.target.trust_remote_code)
    config = tgt.load_target_config(path, recipe.target.trust_remote_code)
    text = text_config(config)
    n = tgt.num_decoder_layers(config)
    ids = recipe.data.aux_layer_ids or tgt.default_aux_layer_ids(n)
    ids = tgt.validate_aux_layer_ids(ids, n)
    info = {
        "name_or_path": recipe.target.name_or_path,
        "verifier": tgt.verifier_name(recipe.target.name_or_path),
        "path": str(path),
        "architectures": list(getattr(config, "architectures", None) or []),
        "num_hidden_layers": n,
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "aux_layer_ids": ids,
    }
    paths.root.mkdir(parents=True, exist_ok=True)
    record_stage(paths, "target", target_keys(recipe, ids))
    atomic_write_bytes(paths.target_info, json.dumps(info, indent=1).encode())  # every node's child may write it
    log.info("target %s: %d layers, H=%d, V=%d, aux layers %s", path, n, info["hidden_size"], info["vocab_size"], ids)
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
                    plan: DataPlan | None = None, record: Path | None = None):
    """``() -> ChatEngine`` for ``data.regenerate.engine`` (``auto`` resolved by
    :func:`~draftsmith.data_prep.regenerate.resolve_engine`): in-process vLLM or the vLLM
    server (with ``log_path`` for its log) with the recipe's ``vllm`` at the ``plan``'s
    tensor / data parallel sizes, or transformers on ``device``
    (:func:`draftsmith.data_prep.target.default_device`). The factory's ``engine`` attribute
    names the resolved engine; building it is noted in ``record`` (:func:`note_engine`)."""
    cfg = recipe.data.regenerate
    engine = regen.resolve_engine(cfg.engine, recipe.vllm)
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
            return regen.VllmChatEngine(target_dir, recipe.seed, vllm_cfg,
                                        trust_remote_code=recipe.target.trust_remote_code)
        if engine == "vllm-server":
            return regen.ServerChatEngine(target_dir, recipe.seed, vllm_cfg, concurrency=cfg.concurrency,
                                          max_retries=cfg.max_retries, server_urls=cfg.server_urls,
                                          log_path=log_path, trust_remote_code=recipe.target.trust_remote_code)
        model, tok = tgt.load_target(target_dir, getattr(torch, recipe.target.dtype), recipe.target.trust_remote_code,
                                     device=device)
        return regen.TransformersChatEngine(model, tok, recipe.seed)

    make.engine, make.built = engine, None
    return make


def node_cache(paths: DataPaths, node: int, nodes: int) -> Path:
    """The regeneration cache node ``node`` of ``nodes`` writes (merged into ``regen.jsonl``)."""
    return paths.root / f"regen.node-{node:03d}-of-{nodes:03d}.jsonl"


def stage_regenerate(recipe: Recipe, paths: DataPaths, info: dict, device: str | None = None,
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

        tok = AutoTokenizer.from_pretrained(info["path"], trust_remote_code=recipe.target.trust_remote_code)
        # only harmony (gpt-oss) templates read reasoning_effort
        harmony = conv.is_harmony_template(tok) if cfg.reasoning_effort else False
        suffix = "" if share is None else f".node-{share[0]:03d}"
        factory = _engine_factory(recipe, Path(info["path"]), device, log_path=paths.root / f"regen_server{suffix}.log",
                                  plan=plan, record=record)
        base = {"target": regen.target_id(info["name_or_path"], info["path"]),
                "chat_template_sha256": regen.chat_template_sha256(tok),
                "engine": regen.ENGINE_FAMILY[factory.engine]}
        if cfg.samples_per_prompt > 1:
            records = regen.repeat_prompts(records, cfg.samples_per_prompt)
        records = regen.iter_regenerated(
            records, paths.regen if share is None else node_cache(paths, *share), factory, cfg.temperatures,
            cfg.max_new_tokens, cfg.batch_size, reasoning_effort=cfg.reasoning_effort, harmony=harmony,
            seed=recipe.seed, fingerprint_base=base, share=share,
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


class _TokenizeRow:
    """The tokenize stage's per-row function (``datasets.map``; picklable for ``num_proc``): one
    ``{"record": JSON}`` row -> the tokenised columns plus ``status`` (``ok`` or the skip reason),
    ``error``, ``truncated`` (counted as truncated) and ``assistant_tokens``."""

    def __init__(self, tok, max_len: int, channels, vocab_size: int, overlong: str):
        self.tok, self.max_len, self.channels, self.vocab_size, self.overlong = tok, max_len, channels, vocab_size, overlong

    def __call__(self, row: dict) -> dict:
        r = json.loads(row["record"])
        out = {"id": str(r["id"]), "input_ids": [], "loss_mask": [], "length": 0, "status": "ok", "error": None,
               "truncated": False, "assistant_tokens": 0}
        try:
            if "input_ids" in r:
                ids, mask = r["input_ids"], r["loss_mask"]
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise conv.DataError(
                        f"row {r['id']}: token id {bad[0]} outside the target vocab of {self.vocab_size} "
                        "(tokenised with another tokenizer?)"
                    )
                is_long = len(ids) > self.max_len
                t = {"input_ids": ids[: self.max_len], "loss_mask": mask[: self.max_len], "truncated": is_long}
            else:
                conv.validate_messages(r["messages"], f"row {r['id']}")
                if not conv.has_assistant_turn(r):
                    return dict(out, status="no_assistant_turn")
                # gpt-oss: the effort the reply was regenerated at (data.regenerate.reasoning_effort)
                t = conv.tokenize_conversation(self.tok, r["messages"], self.max_len, self.channels,
                                               r.get("reasoning_effort"), cut=bool(r.get("cut")))
        except conv.DataError as exc:
            return dict(out, status="invalid", error=str(exc))
        if t["truncated"]:
            if self.overlong == "drop":
                return dict(out, status="overlong_dropped")
            out["truncated"] = True
        n_asst = int(sum(t["loss_mask"]))
        if n_asst < 2:
            return dict(out, status="no_assistant_turn")
        return dict(out, input_ids=[int(x) for x in t["input_ids"]], loss_mask=[int(x) for x in t["loss_mask"]],
                    length=len(t["input_ids"]), assistant_tokens=n_asst)


def stage_tokenize(recipe: Recipe, paths: DataPaths, info: dict, records: Iterable[dict], reports: list[str]):
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

    tok = AutoTokenizer.from_pretrained(info["path"], trust_remote_code=recipe.target.trust_remote_code)
    record_stage(paths, "tokenize", tokenize_keys(recipe, regen.chat_template_sha256(tok)))
    max_len = recipe.data.max_length
    channels = tuple(recipe.data.harmony_channels) if conv.is_harmony_template(tok) else None
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
                         "truncated": datasets.Value("bool"), "assistant_tokens": datasets.Value("int64")})
        num_proc = min(recipe.data.num_proc, max(1, len(raw)))
        mapped = raw.map(_TokenizeRow(tok, max_len, channels, info["vocab_size"], recipe.data.overlong),
                         remove_columns=["record"], features=features, num_proc=num_proc if num_proc > 1 else None,
                         new_fingerprint=uuid.uuid4().hex, desc="tokenize")
        meta = mapped.select_columns(["status", "truncated", "assistant_tokens", "length"]).with_format("numpy")[:]
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
    }
    paths.stats.write_text(json.dumps(stats, indent=1))
    log.info("tokenised %d sequences, %d tokens (%d assistant); truncated %d; skipped %s",
             n_seq, n_tok, n_asst, truncated, skipped)
    return read_tokenized(paths)


def stage_vocab(recipe: Recipe, paths: DataPaths, info: dict, records) -> dict:
    """Draft vocab from ``records`` (the memory-mapped tokenised dataset, counted in batches)."""
    V = info["vocab_size"]
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


def stage_hidden_states(recipe: Recipe, paths: DataPaths, info: dict, records, device: str | None = None,
                        share: tuple[int, int] | None = None, plan: DataPlan | None = None,
                        record: Path | None = None, verify: str = "header") -> dict:
    """Capture the shards with ``data.hidden_states_engine``: this process's share of them,
    ``share=(index, count)`` (shards ``i % count == index``; default: ``RANK`` / ``WORLD_SIZE``,
    :func:`~draftsmith.data_prep.shards.distributed_rank`). The transformers engine runs the
    target on ``device`` (default: this process's accelerator,
    :func:`draftsmith.data_prep.target.default_device`); vLLM runs with the recipe's ``vllm`` at
    ``target.dtype`` and the ``plan``'s tensor-parallel size, its context raised to
    ``data.max_length`` if shorter, its per-request files under ``hidden_states/.vllm-work``.
    Shards already on disk are kept when they check out (``verify``: ``header``, or ``full`` to
    hash them too) and recomputed otherwise, one log line naming each.

    Raises:
        DiskFullError: the file system holding the shards has less free space than the shards
            left to capture need.
    """
    from . import vllm_hidden_states as vhs
    from .shards import bytes_per_token, check_free_space

    engine = vhs.resolve_engine(recipe.data.hidden_states_engine)
    log.info("hidden-states engine: %s (data.hidden_states_engine=%s)", engine, recipe.data.hidden_states_engine)
    target_dir = Path(info["path"])
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
            return vhs.VllmHiddenStateCapture(target_dir, info["aux_layer_ids"], v, recipe.seed,
                                              work_dir=paths.hidden_states / ".vllm-work",
                                              trust_remote_code=recipe.target.trust_remote_code,
                                              batch_tokens=recipe.data.capture_batch_tokens)
        model, _ = tgt.load_target(target_dir, getattr(torch, recipe.target.dtype), recipe.target.trust_remote_code,
                                   device=device)
        return TransformersCapture(model, info["aux_layer_ids"], recipe.data.capture_batch_tokens)

    spec = ShardSpec(info["hidden_size"], info["aux_layer_ids"], recipe.data.hidden_states_dtype)
    record_stage(paths, "hidden-states", hidden_states_keys(recipe, spec.aux_layer_ids))
    # refuse before any forward when the disk cannot hold this process's share (an even split
    # of the tokens; on a shared file system the others' shares come on top)
    need = int(hs._record_lengths(records).sum()) * bytes_per_token(spec.hidden_size, spec.dtype) // world
    check_free_space(paths.hidden_states if paths.hidden_states.exists() else paths.root, need,
                     "the hidden-state shards" + (f" of share {rank}/{world}" if world > 1 else ""))
    manifest = hs.generate_hidden_states(
        LazyCapture(engine, make), records, paths.hidden_states, spec, recipe.data.sequences_per_shard,
        recipe.data.capture_batch_tokens, target_id=info["name_or_path"], rank=rank, world_size=world,
        shard_bytes=recipe.data.shard_bytes, verify=verify,
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


def data_plan(recipe: Recipe, run_dir: Path, info: dict | None = None, stages: list[str] | None = None,
              cluster: Cluster | None = None, tokens: int | None = None) -> DataPlan:
    """The plan of the data stage (:func:`draftsmith.data_prep.plan.build_plan`) for the stages
    left to run: the target's ``config.json`` from ``info`` (``target.json``) when the target
    stage ran, else from :func:`~draftsmith.data_prep.target.load_config_json` (shipped copies
    of the GPU targets' configs, no download)."""
    stages = stages or STAGES
    if info is not None:
        config_json = json.loads((Path(info["path"]) / "config.json").read_text())
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
            accelerator, :func:`draftsmith.data_prep.target.default_device`).
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
    from .shards import check_free_space

    stages = stages or STAGES
    check_run_dir(recipe, run_dir, stages)  # before the first write
    paths = RunLayout(run_dir).data
    paths.root.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    t0 = time.perf_counter()
    info = stage_target(recipe, paths) if "target" in stages or not paths.target_info.is_file() else json.loads(paths.target_info.read_text())
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


def prepare_node(recipe: Recipe, run_dir: Path, stages: list[str], node: int, nodes: int, session: str,
                 plan: DataPlan | None = None, record: Path | None = None, poll_s: float = 5.0,
                 timeout_s: float = 48 * 3600.0) -> dict:
    """One node's share of the data stage (the data-stage child of
    :mod:`draftsmith.data_prep.launch`; one process per node, seeing all of the node's GPUs).

    - ``target``: every node resolves the target (its weights must be on the node) and writes
      the same ``target.json``.
    - ``regenerate``: the conversations ``i % nodes == node`` into :func:`node_cache` (with the
      plan's engine: vLLM's server at data parallel x tensor parallel over the node's GPUs);
      a ``.regen.node-*.done`` marker then says this node is finished.
    - ``tokenize`` / ``vocab``: node 0 waits for every node's marker, merges the caches into
      ``regen.jsonl`` and runs them; the others wait for its ``.early-stages.done`` marker.
    - ``hidden-states`` (node placement only): the shards ``i % nodes == node``, with vLLM at
      tensor parallel over the node's GPUs.

    Every marker carries ``session`` (the launch's id), so a marker of an earlier run never
    releases a node.

    Raises:
        TimeoutError: waited ``timeout_s`` for another node; names the files.
    """
    check_run_dir(recipe, run_dir, stages)  # before the first write
    paths = RunLayout(run_dir).data
    early = [st for st in stages if st != "hidden-states"]
    summary: dict = {}
    info = stage_target(recipe, paths) if "target" in stages or not paths.target_info.is_file() \
        else json.loads(paths.target_info.read_text())
    if plan is None:
        plan = data_plan(recipe, run_dir, info, stages, Cluster.detect(nodes=nodes))
        log_plan(plan, paths if node == 0 else None)
    early = [st for st in early if st != "target"]
    if early:
        if nodes == 1:
            summary = prepare(recipe, run_dir, early, plan=plan, record=record)
        else:
            if "regenerate" in early and recipe.data.regenerate.enabled:
                t = time.perf_counter()
                raw, _ = stage_regenerate(recipe, paths, info, share=(node, nodes), plan=plan, record=record,
                                          stats=summary)
                collections.deque(raw, maxlen=0)
                summary["regenerate_s"] = time.perf_counter() - t
            write_marker(paths.root / f".regen.node-{node:03d}-of-{nodes:03d}.done", session)
            if node == 0:
                wait_for_markers([paths.root / f".regen.node-{n:03d}-of-{nodes:03d}.done" for n in range(nodes)],
                                 session, "every node's regeneration", poll_s, timeout_s)
                merge_node_caches(paths, nodes)
                rest = [st for st in early if st in ("tokenize", "vocab")]  # tokenize reads the merged cache
                if rest:
                    summary.update(prepare(recipe, run_dir, rest, plan=plan, record=record))
    if node == 0:
        write_marker(paths.root / EARLY_DONE, session)
    if "hidden-states" in stages:
        wait_for_markers([paths.root / EARLY_DONE], session, "node 0's tokenize / vocab", poll_s, timeout_s)
        summary.update(prepare(recipe, run_dir, ["hidden-states"], capture_share=(node, nodes), plan=plan,
                               record=record))
    return summary


def merge_node_caches(paths: DataPaths, nodes: int) -> int:
    """Append every node's regeneration cache (:func:`node_cache`) to ``regen.jsonl`` (a torn last
    line of a killed writer is dropped) and remove them; returns the rows merged. Rows appended
    later win over older rows of the same id, as in one process's cache."""
    rows = 0
    parts = [node_cache(paths, n, nodes) for n in range(nodes)]
    if paths.regen.is_file():
        regen._drop_torn_tail(paths.regen)  # a killed writer's last line would swallow the first merged row
    with paths.regen.open("ab") as out:
        for part in parts:
            if not part.is_file():
                continue
            with part.open("rb") as fh:
                for line in fh:
                    if line.endswith(b"\n"):
                        out.write(line)
                        rows += 1
        out.flush()
        os.fsync(out.fileno())
    for part in parts:
        part.unlink(missing_ok=True)
    log.info("merged %d regenerated rows of %d node(s) into %s", rows, nodes, paths.regen)
    return rows


def write_marker(path: Path, session: str, **fields) -> None:
    """A done marker: ``{"session": ..., **fields}``, written atomically."""
    atomic_write_bytes(path, json.dumps({"session": session, **fields}).encode())


def wait_for_markers(files: list[Path], session: str | None, what: str, poll_s: float = 5.0,
                     timeout_s: float = 48 * 3600.0) -> None:
    """Poll the file system until every file in ``files`` exists and (``session`` given) carries
    ``session``; logs once a minute. Polling, not a collective: the data stage can outlast any
    process-group timeout.

    Raises:
        TimeoutError: after ``timeout_s``, naming the files still missing or stale.
    """
    t0, last = time.monotonic(), -60.0
    while True:
        missing = [f for f in files if not _marker_ok(f, session)]
        if not missing:
            return
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise TimeoutError(f"waited {waited:.0f} s for {what}; still missing: " + ", ".join(map(str, missing)))
        if waited - last >= 60:
            log.info("waiting for %s (%.0f s)", what, waited)
            last = waited
        time.sleep(poll_s)


def _marker_ok(path: Path, session: str | None) -> bool:
    if not path.is_file():
        return False
    if session is None:
        return True
    try:
        return json.loads(path.read_text()).get("session") == session
    except (OSError, ValueError, AttributeError):
        return False


EARLY_DONE = ".early-stages.done"  # RUN_DIR/data marker: the main process finished the early stages


def prepare_distributed(recipe: Recipe, run_dir: Path, stages: list[str] | None = None, device: str | None = None,
                        poll_s: float = 5.0, timeout_s: float = 48 * 3600.0, record: Path | None = None,
                        verify_shards: bool = False) -> dict:
    """:func:`prepare`, rank-safe under a distributed launcher (``RANK`` / ``WORLD_SIZE``; one
    process: just :func:`prepare`).

    Rank 0 runs ``target`` / ``regenerate`` / ``tokenize`` / ``vocab`` (it first removes the done
    marker ``RUN_DIR/data/.early-stages.done`` of an earlier run, then all ranks pass one short
    barrier) while the others poll the file system for the marker it writes when those stages
    are finished (not a collective: a regeneration can outlast any process-group timeout; stale
    stage outputs never release them); then every rank captures its own
    hidden-state shards on its own device (``device``, else
    :func:`draftsmith.data_prep.target.default_device`: one per local rank) and all wait until the shard manifest is complete. Only rank 0 writes ``summary.json``.
    The run directory must be on a file system every node sees.

    Raises:
        TimeoutError: waited ``timeout_s`` for files; the message names them.
    """
    stages = [s for s in STAGES if s in (stages or STAGES)]
    rank, world = distributed_rank()
    if world == 1:
        return prepare(recipe, run_dir, stages, device, record=record, verify_shards=verify_shards)
    paths = RunLayout(run_dir).data
    outputs = stage_outputs(recipe, paths)
    marker = paths.root / EARLY_DONE
    early = [s for s in stages if s != "hidden-states"]
    summary: dict = {}

    if early:
        if rank == 0:
            paths.root.mkdir(parents=True, exist_ok=True)
            marker.unlink(missing_ok=True)  # a marker from an earlier run must not release the others
        _barrier()  # no rank looks for the marker before the stale one is gone
        if rank == 0:
            summary = prepare(recipe, run_dir, early, device, record=record)
            atomic_write_bytes(marker, json.dumps({"stages": early}).encode())
        else:
            wait_for_markers([marker], None, f"rank 0 to run {', '.join(early)} (rank {rank})", poll_s, timeout_s)
    if "hidden-states" in stages:
        t = time.perf_counter()
        summary.update(prepare(recipe, run_dir, ["hidden-states"], device, record=record,  # this rank's shards
                               verify_shards=verify_shards))
        wait_for_markers(outputs["hidden-states"], None, f"the other ranks' hidden-state shards (rank {rank})",
                         poll_s, timeout_s)
        if "hidden_states" in summary:  # this rank's throughput; the tokens of every rank's shards
            from .shards import load_manifest

            m = load_manifest(paths.hidden_states)
            summary["hidden_states"]["tokens"] = sum(sh["num_tokens"] for sh in m["shards"])
        summary["seconds"] = summary.get("seconds", 0.0) + time.perf_counter() - t
    if rank == 0:
        paths.summary.write_text(json.dumps(summary, indent=1))
    return summary


def _barrier() -> None:
    """One short barrier over the launched processes: the job's process group when there is
    one, else a temporary gloo group (torchrun sets ``MASTER_ADDR`` / ``MASTER_PORT``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return
    if not (dist.is_available() and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        log.warning("no process group and no MASTER_ADDR/MASTER_PORT: ranks start without a barrier")
        return
    dist.init_process_group("gloo")
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def bind_local_device(env: dict | None = None) -> str | None:
    """Under a launcher with several processes per node, restrict this process to its own GPU
    (``CUDA_VISIBLE_DEVICES`` = the ``LOCAL_RANK``-th of the visible devices, or ``LOCAL_RANK``)
    so that an engine it builds, and the processes vLLM starts for it, land there and not all on
    device 0. Must run before CUDA or vLLM is initialised (``prepare``'s ``main`` calls it
    first). Returns the value set, or None outside a multi-process launch."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if local_world <= 1 or "LOCAL_RANK" not in env:
        return None
    env["CUDA_VISIBLE_DEVICES"] = local_device(int(env["LOCAL_RANK"]), env)
    return env["CUDA_VISIBLE_DEVICES"]


def local_device(local_rank: int, env: dict | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of local rank ``local_rank``: the ``local_rank``-th of the
    devices visible in ``env`` (this process's environment by default), or ``local_rank`` when
    none are listed."""
    env = os.environ if env is None else env
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[local_rank % len(visible)] if visible else str(local_rank)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``data_prep/prepare.py`` (``draftsmith prepare``)."""
    from ..cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", required=True, type=Path, help="run directory; the data lands in RUN_DIR/data")
    p.add_argument("--stage", action="append", choices=STAGES, help="run only these stages (repeatable; default: all)")
    p.add_argument("--device", help=tgt.DEVICE_HELP)
    p.add_argument("--dry-run", action="store_true",
                   help="print the data plan (engines, devices, shards, disk, read bandwidth) and exit; no weights")
    p.add_argument("--nodes", type=int, help="with --dry-run: nodes of the job (default: this one)")
    p.add_argument("--gpus-per-node", type=int, help="with --dry-run: GPUs per node (default: the GPUs seen here)")
    p.add_argument("--device-memory-gib", type=float, help="with --dry-run: memory of one GPU (default: GPU 0's, or 80)")
    p.add_argument("--node", metavar="N/NODES",
                   help="run node N's share of the data stage (the data-stage child of a multi-node launch: "
                        "regeneration of conversations i %% NODES == N, and with --stage hidden-states its shards)")
    p.add_argument("--capture-share", metavar="I/COUNT",
                   help="capture only the hidden-state shards i %% COUNT == I (a rank's capture child)")
    p.add_argument("--session", help="launch id written into the done markers (set by the launching ranks)")
    p.add_argument("--verify-shards", action="store_true",
                   help="hash the hidden-state shards already on disk against their manifest sha256 before keeping "
                        "them (default: their size and safetensors header are checked); a bad one is recomputed")
    p.add_argument("--overwrite-data", action="store_true",
                   help="delete RUN_DIR/data first and prepare it afresh (a run directory whose data was prepared "
                        "with other recipe keys is otherwise refused before anything is written)")
    return p


def main(argv: list[str] | None = None) -> int:
    bind_local_device()  # before anything can initialise CUDA or import vLLM
    args = build_parser().parse_args(argv)
    setup_logging()
    recipe = recipe_from_args(args)
    from ..procs import install_child_reaper
    from .shards import DiskFullError

    try:
        if args.dry_run:
            cluster = Cluster.detect(args.nodes, args.gpus_per_node, args.device_memory_gib)
            print(data_plan(recipe, args.run_dir, None, args.stage, cluster).format())
            return 0
        install_child_reaper()  # engine processes die with this one, SIGKILL included
        child = bool(args.node or args.capture_share)  # the launching ranks checked the run directory
        if args.overwrite_data and not child and distributed_rank()[0] == 0:
            if remove_data(args.run_dir):
                log.warning("--overwrite-data: removed %s; preparing it afresh", RunLayout(args.run_dir).data.root)
        elif not args.overwrite_data:
            # before this process writes anything (its record, the recipe, any stage)
            check_run_dir(recipe, args.run_dir, [s for s in STAGES if s in (args.stage or STAGES)], recipe_arg(args))
        args.run_dir.mkdir(parents=True, exist_ok=True)
        paths = RunLayout(args.run_dir).data
        if args.node or args.capture_share:
            node = parse_share(args.node, "--node") if args.node else None
            share = parse_share(args.capture_share, "--capture-share") if args.capture_share else None
            role = f"node-{node[0]}" if node else f"capture-{share[0]}"
            record = process_record(paths, role, node=node and node[0], share=share and share[0])
            stages = [s for s in STAGES if s in (args.stage or STAGES)]
            if node:
                summary = prepare_node(recipe, args.run_dir, stages, node[0], node[1], args.session or "", record=record)
            else:
                summary = prepare(recipe, args.run_dir, stages, args.device, capture_share=share, record=record)
        else:
            if distributed_rank()[0] == 0:
                dump_recipe(recipe, RunLayout(args.run_dir).recipe)
            record = process_record(paths, f"rank-{distributed_rank()[0]}", rank=distributed_rank()[0])
            summary = prepare_distributed(recipe, args.run_dir, args.stage, args.device, record=record,
                                          verify_shards=args.verify_shards)
    except (conv.DataError, ShardError, DiskFullError, PlanError, FileNotFoundError, ValueError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if distributed_rank()[0] == 0:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
