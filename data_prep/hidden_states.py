"""The hidden-states stage: run a capture engine over tokenized records into the shard store.

Engines and hooks are in :mod:`draftsmith.target.capture`, the shard format, fp8 codec and
manifests in :mod:`draftsmith.data_prep.shards`; this module drives them shard by shard
(resumable, several ranks without overlap). The shard tools' command line is
:mod:`draftsmith.cli.hidden_states`:

    python -m draftsmith.cli.hidden_states convert SRC_DIR DST_DIR --dtype float8_e4m3fn
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..fileio import ShardError, atomic_write_bytes, check_free_space
from ..target.capture import TransformersCapture
from .scores import scores_entry
from .shards import (
    FORMAT_VERSION,
    HEADER_KEYS,
    MANIFEST,
    ShardSpec,
    ShardWriter,
    bytes_per_token,
    check_shard,
    distributed_rank,
    load_manifest,
    part_manifest_name,
    shard_bounds,
)

log = logging.getLogger(__name__)


def generate_hidden_states(
    model: Any,
    records: Any,
    out_dir: Path,
    spec: ShardSpec,
    sequences_per_shard: int = 64,
    batch_tokens: int = 4096,
    target_id: str = "",
    progress: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    shard_bytes: int | None = None,
    verify: str = "header",
    scorer: Any = None,
) -> dict:
    """Capture aux + final hidden states for ``records`` (``input_ids``/``loss_mask``) into shards.

    ``records``: the memory-mapped tokenised dataset (:func:`draftsmith.layout.read_tokenized`;
    each rank reads only the index ranges of its own shards) or a list of dicts.

    Records are cut into shards in record order by :func:`~draftsmith.data_prep.shards.shard_bounds`
    (at most ``sequences_per_shard`` records and, with ``shard_bytes``, at most that many bytes
    at the storage dtype), from the record lengths alone; a shard already listed in the manifest
    with a matching spec is kept when it checks out (``verify="header"``: its size and
    safetensors header against the manifest, as training opens it; ``"full"`` also its sha256)
    and holds the records the tokenised data now puts there; a damaged or stale one is
    recomputed, with one log line naming it. Reruns only compute what is missing. With
    ``world_size > 1`` (see ``distributed_rank``) this process computes only the shards
    ``i % world_size == rank`` and writes its part-manifest (module docstring of ``shards``).

    Each shard is streamed to disk by a :class:`~draftsmith.data_prep.shards.ShardWriter` on a
    background thread while the engine computes the next records (at most
    ``WRITE_QUEUE_DEPTH`` records wait for it), storing the sequences in the order the engine
    yields them. Host memory is bounded by the shard size, not by the data: about
    ``shard_tokens * (bytes_per_token - 3H * itemsize)`` for the buffered final states, ids
    and mask of the shard being written, plus ``WRITE_QUEUE_DEPTH + 2`` records' states
    (queued, being written, and the one the engine just yielded).
    The engine's ``close()`` (when it has one) is called when this returns or raises.

    Args:
        model: a transformers causal LM (wrapped in ``TransformersCapture``, batching by length
            up to ``batch_tokens`` padded tokens) or any ``CaptureEngine``.
        shard_bytes: bytes per shard (``data.shard_bytes``); ``None``: ``sequences_per_shard``
            alone decides.
        scorer: a :class:`~draftsmith.data_prep.scores.SequenceScorer`: each captured sequence's
            scores (the target's entropy and flatness over the draft vocab, for ``data.select``)
            are computed on the engine's device from its final states and written in its shard's
            manifest entry (``"scores"``); None: no scores (a kept shard keeps what it has).

    Returns:
        The manifest dict (the union over ranks), also written to ``out_dir/manifest.json`` once
        every shard exists; it records this process's capture throughput (tokens/s) under
        ``"throughput_tok_s"`` (``None`` when it captured nothing).

    Raises:
        ValueError: ``shard_bytes`` cannot hold the longest record (raised before any capture).
        ShardError: an existing manifest was written for different layers / size / dtype /
            shard size, or the engine returned wrong shapes or not every record.
        DiskFullError: the disk filled up; finished shards and the manifest are kept, so a
            rerun after freeing space resumes.
    """
    engine = model if hasattr(model, "capture") else TransformersCapture(model, spec.aux_layer_ids, batch_tokens)
    try:
        return _capture_shards(engine, records, out_dir, spec, sequences_per_shard, shard_bytes, target_id, progress,
                               *distributed_rank(rank, world_size), verify=verify, scorer=scorer)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _capture_shards(engine: Any, records: Any, out_dir: Path, spec: ShardSpec, sequences_per_shard: int,
                    shard_bytes: int | None, target_id: str, progress: bool, rank: int, world: int,
                    verify: str = "header", scorer: Any = None) -> dict:
    """``generate_hidden_states`` with the engine built (the caller closes it)."""
    from tqdm.auto import tqdm

    lengths_all = _record_lengths(records)
    bounds = shard_bounds(lengths_all, sequences_per_shard, shard_bytes,
                          bytes_per_token(spec.hidden_size, spec.dtype))
    n_shards = len(bounds) - 1
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "format_version": FORMAT_VERSION,
        "target": target_id,
        "hidden_size": spec.hidden_size,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "dtype": spec.dtype,
        "num_records": len(records),
        "sequences_per_shard": sequences_per_shard,
        "shard_bytes": shard_bytes,
        "num_shards": n_shards,
        "engine": engine.name,
    }
    if spec.encoding is not None:
        header["encoding"] = spec.encoding
    manifest = load_manifest(out_dir)
    if manifest is not None:
        for key in HEADER_KEYS:
            if manifest.get(key) != header[key]:
                raise ShardError(
                    f"{out_dir / MANIFEST}: existing shards have {key}={manifest.get(key)!r}, this run wants "
                    f"{header[key]!r}; nothing was written: use a fresh --run-dir, or start the run's data over "
                    f"with draftsmith prepare RECIPE --run-dir RUN_DIR --overwrite-data"
                )
        done = {s["index"]: s for s in manifest["shards"]}
    else:
        done = {}
    mine = [i for i in range(n_shards) if i % world == rank]
    own_manifest = out_dir / (MANIFEST if world == 1 else part_manifest_name(rank, world))
    kept = [i for i in mine if i in done]
    ids_all = _record_ids(records) if kept else []
    for i in kept:  # a shard listed in the manifest is kept only when it is whole and of these records
        problem = _kept_shard_problem(out_dir, header, done[i], ids_all[bounds[i]:bounds[i + 1]],
                                      int(lengths_all[bounds[i]:bounds[i + 1]].sum()), verify)
        if problem is not None:
            log.warning("hidden states: %s: recomputing it", problem)
            del done[i]
    todo = [i for i in mine if i not in done]
    for i in todo:  # temp files of writes a killed run did not finish (this rank's shards only)
        for stale in out_dir.glob(f".shard-{i:05d}.safetensors.tmp-*"):
            stale.unlink(missing_ok=True)
    log.info("hidden states: %d of %d shards already on disk (kept, not recomputed); computing %d",
             len(mine) - len(todo), len(mine), len(todo))
    bar = tqdm(total=sum(int(lengths_all[bounds[i]:bounds[i + 1]].sum()) for i in todo),
               unit="tok", desc=f"hidden states ({engine.name})", disable=not progress)
    captured_tokens, t0 = 0, time.perf_counter()

    def write_own() -> None:
        shards = [done[i] for i in sorted(done) if world == 1 or i in mine]
        atomic_write_bytes(own_manifest, json.dumps(dict(header, shards=shards), indent=1).encode())

    def publish(index: int, writer: ShardWriter, ids: list, scores: list) -> None:  # on the writer thread
        nonlocal captured_tokens
        sha, size = writer.finish()
        done[index] = {"index": index, "file": writer.path.name, "num_sequences": writer.num_sequences,
                       "num_tokens": writer.num_tokens, "ids": ids, "sha256": sha, "bytes": size}
        if scorer is not None:  # the host read of the scores happens here, off the capture thread
            done[index]["scores"] = scores_entry(scorer.vocab, scores)
        write_own()
        captured_tokens += writer.num_tokens

    def add(writer: ShardWriter, record: dict, aux: torch.Tensor, fin: torch.Tensor) -> None:
        writer.add(record["input_ids"], record["loss_mask"], aux, fin)
        bar.update(len(record["input_ids"]))

    writers: list[ShardWriter] = []
    # a writer thread overlaps the copy-out and the write with the next forward on an accelerator;
    # on a CPU it would take cores from the forward itself (measured 7% slower on the 2-core demo)
    behind = _WriteBehind(WRITE_QUEUE_DEPTH if torch.accelerator.is_available() else 0)
    try:
        for index in todo:
            chunk = _shard_records(records, bounds[index], bounds[index + 1])
            writer = ShardWriter(out_dir / f"shard-{index:05d}.safetensors", spec,
                                 [len(r["input_ids"]) for r in chunk])
            writers.append(writer)
            check_free_space(out_dir, writer.size, f"shard {index} ({len(chunk)} sequences)")
            order: list[int] = []
            scores: dict[int, torch.Tensor] = {}
            for j, aux, fin in engine.capture(chunk):
                n = len(chunk[j]["input_ids"])
                if aux.shape != (n, 3 * spec.hidden_size) or fin.shape != (n, spec.hidden_size):
                    raise ShardError(f"{engine.name} engine returned aux {tuple(aux.shape)} / final "
                                     f"{tuple(fin.shape)} for record {chunk[j]['id']} of {n} tokens "
                                     f"(H={spec.hidden_size})")
                order.append(j)
                if scorer is not None:  # (len(SCORES),) on the engine's device, read on the writer thread
                    scores[j] = scorer(fin, chunk[j]["loss_mask"])
                behind.submit(add, writer, chunk[j], aux, fin)
            missing = sorted(set(range(len(chunk))) - set(order))  # a record twice overflows the writer
            if missing:
                raise ShardError(f"{engine.name} engine returned no states for records "
                                 f"{[chunk[j]['id'] for j in missing[:5]]}")
            behind.submit(publish, index, writer, [chunk[j]["id"] for j in order],
                          [scores[j] for j in order if j in scores])
        behind.close()
    finally:
        behind.close(raise_error=False)  # after an error: let the queued writes end, then drop what is unfinished
        for writer in writers:
            writer.abort()
        bar.close()
    elapsed = time.perf_counter() - t0
    if world > 1:
        write_own()  # also when this rank had nothing to do: its part records that it finished
        shards = load_manifest(out_dir)["shards"]
    else:
        shards = [done[i] for i in sorted(done)]
    manifest = dict(header, shards=shards)
    manifest["num_tokens"] = sum(s["num_tokens"] for s in shards)
    if world > 1 and len(shards) == n_shards:  # the last rank to finish merges
        atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    manifest["throughput_tok_s"] = captured_tokens / elapsed if captured_tokens else None
    if world == 1:
        atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


WRITE_QUEUE_DEPTH = 2  # records waiting for the shard writer thread


class _WriteBehind:
    """Runs submitted calls in submission order on one background thread, at most ``depth`` of
    them waiting (``submit`` blocks beyond that); ``depth=0`` runs each call inside ``submit``.
    The first exception a call raises is raised again by the next ``submit`` or by ``close``;
    the calls queued after it are skipped."""

    def __init__(self, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._inline = depth == 0
        if not self._inline:
            self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._error is None:
                try:
                    job()
                except BaseException as exc:  # handed to the submitting thread
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, fn: Any, *args: Any) -> None:
        self._raise()
        if self._inline:
            fn(*args)
        else:
            self._queue.put(functools.partial(fn, *args))

    def close(self, raise_error: bool = True) -> None:
        """Wait for every submitted call (idempotent); then raise the first error unless told not to."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if raise_error:
            self._raise()


def _is_dataset(records: Any) -> bool:
    return hasattr(records, "column_names") and hasattr(records, "select")


def _record_lengths(records: Any) -> np.ndarray:
    """Tokens per record: the ``length`` column of a tokenised dataset (no rows read), else
    ``len(input_ids)`` of each dict."""
    if _is_dataset(records):
        return np.asarray(records.select_columns(["length"]).with_format("numpy")[:]["length"], dtype=np.int64)
    return np.array([len(r["input_ids"]) for r in records], dtype=np.int64)


def _record_ids(records: Any) -> list[str]:
    """The ``id`` of every record, in order (of a tokenised dataset: the ``id`` column alone)."""
    if _is_dataset(records):
        return [str(i) for i in records.select_columns(["id"]).with_format(None)["id"]]
    return [str(r.get("id")) for r in records]


def _kept_shard_problem(out_dir: Path, header: dict, entry: dict, ids: list[str], num_tokens: int,
                        verify: str = "header") -> str | None:
    """Why the finished shard ``entry`` of the manifest cannot be kept (None: it can): its file
    is missing, or its size or safetensors header disagrees with the manifest
    (:func:`~draftsmith.data_prep.shards.check_shard`, the check training opens shards with,
    reading the header and offsets only; ``verify="full"``: its sha256 too), or it holds other
    records than ``ids`` / ``num_tokens`` (the tokenised data changed since it was captured)."""
    try:
        check_shard(out_dir, header, entry, verify)
    except ShardError as exc:
        return str(exc)
    if entry.get("num_tokens") != num_tokens or sorted(map(str, entry.get("ids") or [])) != sorted(ids):
        return (f"{out_dir / entry['file']}: holds {entry.get('num_sequences')} sequences / {entry.get('num_tokens')} "
                f"tokens, the tokenised data now puts {len(ids)} / {num_tokens} there (the data changed since capture)")
    return None


def _shard_records(records: Any, lo: int, hi: int) -> list[dict]:
    """Records ``lo:hi`` (one shard) as ``{"id", "input_ids", "loss_mask"}`` dicts; from a
    tokenised dataset only this index range is read (one shard in memory at a time)."""
    if _is_dataset(records):
        cols = records.with_format(None)[lo:hi]
        return [{"id": i, "input_ids": ids, "loss_mask": m}
                for i, ids, m in zip(cols["id"], cols["input_ids"], cols["loss_mask"])]
    return records[lo:hi]
