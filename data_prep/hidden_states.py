"""The hidden-states stage: run a capture engine over tokenized records into the shard store.

Engines and hooks are in :mod:`draftsmith.data_prep.capture`, the shard format, fp8 codec and
manifests in :mod:`draftsmith.data_prep.shards`; this module drives them shard by shard
(resumable, several ranks without overlap) and is the shard tools' command line:

    python -m draftsmith.data_prep.hidden_states convert SRC_DIR DST_DIR --dtype float8_e4m3fn
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .capture import TransformersCapture
from .shards import (
    FORMAT_VERSION,
    HEADER_KEYS,
    MANIFEST,
    STORAGE_DTYPES,
    ShardError,
    ShardSpec,
    atomic_write_bytes,
    convert_shards,
    distributed_rank,
    encode_states,
    load_manifest,
    part_manifest_name,
    shard_bytes_per_token,
    write_shard,
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
) -> dict:
    """Capture aux + final hidden states for ``records`` (``input_ids``/``loss_mask``) into shards.

    ``records``: the memory-mapped tokenised dataset (:func:`draftsmith.layout.read_tokenized`;
    each rank reads only the index ranges of its own shards) or a list of dicts.

    Records are assigned to shards by index (``sequences_per_shard`` each); a shard already
    listed in the manifest with a matching spec is skipped, so reruns only compute what is
    missing. With ``world_size > 1`` (see ``distributed_rank``) this process computes only the
    shards ``i % world_size == rank`` and writes its part-manifest (module docstring).

    Args:
        model: a transformers causal LM (wrapped in ``TransformersCapture``, batching by length
            up to ``batch_tokens`` padded tokens) or any ``CaptureEngine``.

    Returns:
        The manifest dict (the union over ranks), also written to ``out_dir/manifest.json`` once
        every shard exists; it records this process's capture throughput (tokens/s) under
        ``"throughput_tok_s"`` (``None`` when it captured nothing).

    Raises:
        ShardError: an existing manifest was written for different layers / size / dtype.
    """
    from tqdm.auto import tqdm

    engine = model if hasattr(model, "capture") else TransformersCapture(model, spec.aux_layer_ids, batch_tokens)
    rank, world = distributed_rank(rank, world_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "format_version": FORMAT_VERSION,
        "target": target_id,
        "hidden_size": spec.hidden_size,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "dtype": spec.dtype,
        "num_records": len(records),
        "sequences_per_shard": sequences_per_shard,
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
                    f"{header[key]!r}; use a fresh directory"
                )
        done = {s["index"]: s for s in manifest["shards"]}
    else:
        done = {}
    n_shards = (len(records) + sequences_per_shard - 1) // sequences_per_shard
    mine = [i for i in range(n_shards) if i % world == rank]
    own_manifest = out_dir / (MANIFEST if world == 1 else part_manifest_name(rank, world))
    captured_tokens, t0 = 0, time.perf_counter()
    todo = [i for i in mine if i not in done or not (out_dir / done[i]["file"]).is_file()]
    for i in todo:  # temp files of writes a killed run did not finish (this rank's shards only)
        for stale in out_dir.glob(f".shard-{i:05d}.safetensors.tmp-*"):
            stale.unlink(missing_ok=True)
    log.info("hidden states: %d of %d shards already on disk (kept, not recomputed); computing %d",
             len(mine) - len(todo), len(mine), len(todo))
    lengths_all = _record_lengths(records)
    bar = tqdm(total=sum(int(lengths_all[i * sequences_per_shard : (i + 1) * sequences_per_shard].sum()) for i in todo),
               unit="tok", desc=f"hidden states ({engine.name})", disable=not progress)

    def write_own() -> None:
        shards = [done[i] for i in sorted(done) if world == 1 or i in mine]
        atomic_write_bytes(own_manifest, json.dumps(dict(header, shards=shards), indent=1).encode())

    for index in todo:
        chunk = _shard_records(records, index, sequences_per_shard)
        lengths = torch.tensor([len(r["input_ids"]) for r in chunk], dtype=torch.long)
        parts: list[dict[str, torch.Tensor] | None] = [None] * len(chunk)
        for j, aux, fin in engine.capture(chunk):
            n = len(chunk[j]["input_ids"])
            if aux.shape != (n, 3 * spec.hidden_size) or fin.shape != (n, spec.hidden_size):
                raise ShardError(f"{engine.name} engine returned aux {tuple(aux.shape)} / final {tuple(fin.shape)} "
                                 f"for record {chunk[j]['id']} of {n} tokens (H={spec.hidden_size})")
            parts[j] = encode_states(aux, fin, spec.dtype)  # row-wise: same bytes as encoding the shard at once
        missing = [chunk[j]["id"] for j, p in enumerate(parts) if p is None]
        if missing:
            raise ShardError(f"{engine.name} engine returned no states for records {missing[:5]}")
        tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        tensors.update({
            "input_ids": torch.tensor([t for r in chunk for t in r["input_ids"]], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in chunk for m in r["loss_mask"]], dtype=torch.uint8),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        })
        name = f"shard-{index:05d}.safetensors"
        sha, size = write_shard(out_dir / name, tensors)
        done[index] = {
            "index": index,
            "file": name,
            "num_sequences": len(chunk),
            "num_tokens": int(lengths.sum()),
            "ids": [r["id"] for r in chunk],
            "sha256": sha,
            "bytes": size,
        }
        captured_tokens += int(lengths.sum())
        bar.update(int(lengths.sum()))
        write_own()
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


def _is_dataset(records: Any) -> bool:
    return hasattr(records, "column_names") and hasattr(records, "select")


def _record_lengths(records: Any) -> np.ndarray:
    """Tokens per record: the ``length`` column of a tokenised dataset (no rows read), else
    ``len(input_ids)`` of each dict."""
    if _is_dataset(records):
        return np.asarray(records.select_columns(["length"]).with_format("numpy")[:]["length"], dtype=np.int64)
    return np.array([len(r["input_ids"]) for r in records], dtype=np.int64)


def _shard_records(records: Any, index: int, per_shard: int) -> list[dict]:
    """The records of shard ``index`` as ``{"id", "input_ids", "loss_mask"}`` dicts; from a
    tokenised dataset only this index range is read (one shard in memory at a time)."""
    lo, hi = index * per_shard, min((index + 1) * per_shard, len(records))
    if _is_dataset(records):
        cols = records.with_format(None)[lo:hi]
        return [{"id": i, "input_ids": ids, "loss_mask": m}
                for i, ids, m in zip(cols["id"], cols["input_ids"], cols["loss_mask"])]
    return records[lo:hi]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Hidden-state shard tools.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="re-encode a shard directory (e.g. bf16 -> row-scaled fp8)")
    c.add_argument("src", type=Path)
    c.add_argument("dst", type=Path)
    c.add_argument("--dtype", default="float8_e4m3fn", choices=STORAGE_DTYPES)
    args = p.parse_args(argv)
    try:
        m = convert_shards(args.src, args.dst, args.dtype)
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"shards": len(m["shards"]), "tokens": m["num_tokens"], "dtype": m["dtype"],
                      "src_bytes_per_token": round(shard_bytes_per_token(args.src), 1),
                      "dst_bytes_per_token": round(shard_bytes_per_token(args.dst), 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
