"""The offline hidden-state shard store: format, manifests, writing, reading and re-encoding.

Shard layout (``<dir>/shard-00000.safetensors``), one row per token, sequences concatenated:
``aux_hidden_states [N, 3H]``, ``final_hidden_states [N, H]`` (storage dtype),
``input_ids [N]`` int32, ``loss_mask [N]`` uint8, ``offsets [S+1]`` int64. Shards written by
:class:`ShardWriter` store the sequences in the order the capture engine produced them (the
manifest's ``ids`` follow that order) and put ``aux_hidden_states`` first in the data section;
readers go by the safetensors header, so any order of the tensors in the file reads the same.
With ``dtype: float8_e4m3fn`` the states are stored row-scaled
(:mod:`draftsmith.data_prep.state_codec`, ``encode_fp8``) and two
more tensors hold the scales: ``aux_hidden_states_scale [N, 3]`` and
``final_hidden_states_scale [N, 1]`` (float32); the manifest's ``encoding`` names the scheme
(absent in shards written before it existed = plain). Readers decode fp8 to float32 on the
CPU by default, or hand out the fp8 payload and scales for
:func:`~draftsmith.data_prep.state_codec.decode_states` to decode
on the device after the host-to-device copy (``ShardReader(decode_dtype=None)``).
Which records go into which shard is fixed by the record lengths alone
(:func:`shard_bounds`): at most ``sequences_per_shard`` records and, with ``shard_bytes``, at
most that many bytes (:func:`bytes_per_token` per token), so every rank and node derives the
same shards. ``manifest.json`` lists every finished shard with its sequence/token counts,
``sha256`` and ``bytes`` (file size), both computed from the bytes as they are written (no
re-read); its header records ``shard_bytes`` and ``num_shards`` (older manifests without them
have ``ceil(num_records / sequences_per_shard)`` shards). Shards and the manifest are written
atomically (temp file, fsync, rename: :mod:`draftsmith.fileio`), so a killed run resumes at the
first missing shard, and a full disk raises :class:`~draftsmith.fileio.DiskFullError` with the
temp file removed and earlier shards intact. A shard that disagrees with its manifest raises
:class:`~draftsmith.fileio.ShardError`.

Opening a shard directory (:class:`ShardReader`) checks every shard cheaply by default
(``verify="header"``: the file exists, its size is the manifest's ``bytes``, and its safetensors
header holds the expected tensors, shapes, dtypes and sequence count; only the header and the
small ``offsets`` tensor are read); ``verify="full"`` also hashes every file against its
``sha256`` (``--verify-shards`` on training, ``draftsmith verify RUN_DIR``).

Several ranks (torchrun / accelerate: ``RANK``/``WORLD_SIZE``) split the shards without
overlap: rank r computes shards ``i % world_size == r`` and records them in its own
part-manifest ``manifest.rank-0000r-of-0000w.json`` (no two processes ever write one file);
``load_manifest`` reads the union of ``manifest.json`` and all part-manifests, and whichever
rank finds the union complete writes the merged ``manifest.json``. No barrier is needed and
a killed rank resumes like a single process does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from safetensors import safe_open

from ..fileio import ShardError, atomic_write_bytes, removed_on_error, temp_path, write_all
from ..layout import safe_path
from .state_codec import FP8_ENCODING, SCALE_SUFFIX, STATE_KEYS, decode_fp8, encode_states

MANIFEST = "manifest.json"
PART_MANIFEST_GLOB = "manifest.rank-*-of-*.json"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


@dataclass
class ShardSpec:
    hidden_size: int
    aux_layer_ids: list[int]
    dtype: str  # storage dtype name, one of STORAGE_DTYPES

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"hidden-state storage dtype {self.dtype!r} not one of {STORAGE_DTYPES}")

    @property
    def encoding(self) -> dict | None:
        return FP8_ENCODING if self.dtype == "float8_e4m3fn" else None


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes one token takes in a shard of storage ``dtype``: aux ``3H`` and final ``H`` states,
    fp8's four float32 row scales, the int32 token id and the uint8 loss mask (the header and
    the 8 bytes per sequence of ``offsets`` come on top)."""
    states = 4 * hidden_size * getattr(torch, dtype).itemsize
    scales = 4 * 4 if dtype == "float8_e4m3fn" else 0
    return states + scales + 4 + 1


def shard_bounds(lengths: Sequence[int] | np.ndarray, sequences_per_shard: int, shard_bytes: int | None = None,
                 token_bytes: int = 1) -> list[int]:
    """Cut records into shards, in record order: each shard takes records until the next one
    would make it exceed ``sequences_per_shard`` records or (``shard_bytes`` set)
    ``shard_bytes`` bytes at ``token_bytes`` per token (:func:`bytes_per_token`). Depends on
    the lengths alone, so every rank and node computes the same shards.

    Args:
        lengths: tokens per record, ``(R,)``.

    Returns:
        ``num_shards + 1`` record indices: shard i holds records ``[b[i], b[i + 1])``.

    Raises:
        ValueError: ``shard_bytes`` cannot hold the longest record, naming ``data.shard_bytes``
            and the bytes that record needs.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if shard_bytes is None:
        return list(range(0, len(lengths), sequences_per_shard)) + [len(lengths)]
    longest = int(lengths.max(initial=0))
    if longest * token_bytes > shard_bytes:
        raise ValueError(f"data.shard_bytes={shard_bytes} cannot hold one sequence of the longest record "
                         f"({longest} tokens x {token_bytes} bytes = {longest * token_bytes} bytes); "
                         f"raise it to at least {longest * token_bytes}")
    bounds, count, size = [0], 0, 0
    for i, n in enumerate((lengths * token_bytes).tolist()):
        if count and (count == sequences_per_shard or size + n > shard_bytes):
            bounds.append(i)
            count, size = 0, 0
        count, size = count + 1, size + n
    if count:
        bounds.append(len(lengths))
    return bounds


def num_shards(manifest: dict) -> int:
    """Shards a finished directory holds: the manifest's ``num_shards``, else (manifests written
    before it was recorded) ``ceil(num_records / sequences_per_shard)``."""
    if manifest.get("num_shards") is not None:
        return int(manifest["num_shards"])
    return -(-manifest["num_records"] // manifest["sequences_per_shard"])


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
              torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


class ShardWriter:
    """One shard streamed to disk as its sequences arrive, without assembling it in memory.

    The sizes are known up front (``lengths``), so the safetensors header is written first;
    then each :meth:`add` encodes that sequence's states
    (:func:`~draftsmith.data_prep.state_codec.encode_states`, on the device they are on), copies
    them to the host and appends the ``aux_hidden_states`` rows to the file at once, hashing
    every byte as it goes out. The rest (final states, fp8 scales, ids, mask, offsets;
    ``N * (bytes_per_token - 3H * itemsize)`` bytes) waits in preallocated host
    buffers until :meth:`finish` appends it, fsyncs and renames the temp file into place.
    Sequences are stored in the order they are added.

    Data section order: ``aux_hidden_states``, then the others by descending element size
    (``offsets``, the scales, ``input_ids``, ``final_hidden_states``, ``loss_mask``), so each
    starts aligned to its element size when ``3H`` is a multiple of 8.

    Not thread-safe: one thread calls :meth:`add` / :meth:`finish` / :meth:`abort`.

    Raises (any method):
        DiskFullError: the disk filled up; the temp file is removed.
        ShardError: more sequences or tokens than announced, or :meth:`finish` before all.
    """

    def __init__(self, path: Path, spec: ShardSpec, lengths: Sequence[int]):
        self.path, self.spec = Path(path), spec
        self.num_sequences, self.num_tokens = len(lengths), int(sum(lengths))
        N, H = self.num_tokens, spec.hidden_size
        state = getattr(torch, spec.dtype)
        self._tail: dict[str, torch.Tensor] = {  # host buffers, filled in the order sequences arrive
            "final_hidden_states": torch.empty(N, H, dtype=state),
            "input_ids": torch.empty(N, dtype=torch.int32),
            "loss_mask": torch.empty(N, dtype=torch.uint8),
            "offsets": torch.zeros(self.num_sequences + 1, dtype=torch.int64),
        }
        if spec.encoding is not None:
            self._tail["aux_hidden_states_scale"] = torch.empty(N, 3, dtype=torch.float32)
            self._tail["final_hidden_states_scale"] = torch.empty(N, 1, dtype=torch.float32)
        order = sorted(self._tail, key=lambda k: (-self._tail[k].element_size(), k))
        layout = [("aux_hidden_states", state, [N, 3 * H])] + [(k, self._tail[k].dtype, list(self._tail[k].shape))
                                                              for k in order]
        header, start = {}, 0
        for name, dtype, shape in layout:
            end = start + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [start, end]}
            start = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # the data section starts 8-byte aligned
        self.size = 8 + len(raw) + start  # the file's bytes
        self._order = order
        self._tokens = self._sequences = 0
        self._sha = hashlib.sha256()
        self._tmp = temp_path(self.path)
        self._fd: int | None = None
        with self._guard():
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write(memoryview(len(raw).to_bytes(8, "little") + raw))

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """On error: close the file, then remove it (a full disk frees its space only then)."""
        with removed_on_error(self._tmp, self.path, self.size):
            try:
                yield
            except BaseException:
                self._close()
                raise

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tail = {}

    def _write(self, data: memoryview) -> None:
        self._sha.update(data)
        write_all(self._fd, data)

    def _write_tensor(self, t: torch.Tensor) -> None:
        host = t.detach().to("cpu").contiguous().reshape(-1)
        self._write(memoryview(host.view(torch.uint8).numpy()))

    def add(self, input_ids: Sequence[int] | torch.Tensor, loss_mask: Sequence[int] | torch.Tensor,
            aux: torch.Tensor, final: torch.Tensor) -> None:
        """Append one sequence: ``input_ids`` / ``loss_mask`` ``(T,)``, ``aux (T, 3H)`` and
        ``final (T, H)`` in any float dtype, on any device (encoded there, then copied)."""
        n = len(input_ids)
        a, b = self._tokens, self._tokens + n
        with self._guard():
            if self._sequences == self.num_sequences or b > self.num_tokens:
                raise ShardError(f"{self.path}: sequence {self._sequences + 1} of {n} tokens does not fit the "
                                 f"{self.num_sequences} sequences / {self.num_tokens} tokens announced")
            states = encode_states(aux, final, self.spec.dtype)
            self._write_tensor(states.pop("aux_hidden_states"))
            for key, t in states.items():
                self._tail[key][a:b].copy_(t)
            self._tail["input_ids"][a:b] = torch.as_tensor(input_ids, dtype=torch.int32)
            self._tail["loss_mask"][a:b] = torch.as_tensor(loss_mask, dtype=torch.uint8)
            self._sequences += 1
            self._tokens = b
            self._tail["offsets"][self._sequences] = b

    def finish(self) -> tuple[str, int]:
        """Write the buffered tensors, fsync, and rename the temp file to ``path``.

        Returns:
            ``(sha256 hex, bytes)`` of the file.
        """
        with self._guard():
            if self._sequences != self.num_sequences:
                raise ShardError(f"{self.path}: finished after {self._sequences} of {self.num_sequences} sequences")
            for key in self._order:
                self._write_tensor(self._tail[key])
            os.fsync(self._fd)
            self._close()
            os.replace(self._tmp, self.path)
        return self._sha.hexdigest(), self.size

    def abort(self) -> None:
        """Drop an unfinished shard: close and remove the temp file (no-op once finished)."""
        if self._fd is not None:
            self._close()
            self._tmp.unlink(missing_ok=True)


def _read_json(f: Path) -> dict:
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ShardError(f"{f}: corrupt manifest ({exc})") from exc


HEADER_KEYS = ("hidden_size", "aux_layer_ids", "dtype", "num_records", "sequences_per_shard", "shard_bytes")


def load_manifest(directory: Path) -> dict | None:
    """The shard directory's manifest: ``manifest.json`` united with any per-rank
    part-manifests (shards keyed by index); ``None`` when there is neither.

    Raises:
        ShardError: a manifest is not JSON, or two of them disagree on a header key.
    """
    files = [directory / MANIFEST] if (directory / MANIFEST).is_file() else []
    files += sorted(directory.glob(PART_MANIFEST_GLOB))
    if not files:
        return None
    merged: dict | None = None
    shards: dict[int, dict] = {}
    for f in files:
        m = _read_json(f)
        if merged is None:
            merged = {k: v for k, v in m.items() if k != "shards"}
        else:
            for key in HEADER_KEYS:
                if m.get(key) != merged.get(key):
                    raise ShardError(f"{f}: {key}={m.get(key)!r} disagrees with {files[0].name} ({merged.get(key)!r})")
        shards.update({s["index"]: s for s in m["shards"]})
    merged["shards"] = [shards[i] for i in sorted(shards)]
    return merged


def distributed_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else ``RANK``/``WORLD_SIZE`` from the environment
    (both torchrun and ``accelerate launch`` set them), else ``(0, 1)``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
    """
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    r = rank if rank is not None else int(os.environ.get("RANK", "0"))
    if world < 1 or not 0 <= r < world:
        raise ValueError(f"rank {r} outside world_size {world}")
    return r, world


def part_manifest_name(rank: int, world_size: int) -> str:
    return f"manifest.rank-{rank:05d}-of-{world_size:05d}.json"


VERIFY_MODES = ("header", "full")
_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """``(tensor name -> {dtype, shape, data_offsets}, data start)`` of a safetensors file,
    reading only its header (8-byte length + JSON).

    Raises:
        ShardError: the header is cut short, not JSON, or points outside the file.
    """
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ShardError(f"{path}: unreadable shard (file of {size} bytes has no safetensors header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100 << 20):
            raise ShardError(f"{path}: unreadable shard (header length {n} does not fit a {size}-byte file)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        header.pop("__metadata__", None)
        tensors = {k: {"dtype": str(v["dtype"]), "shape": [int(x) for x in v["shape"]],
                       "data_offsets": [int(x) for x in v["data_offsets"]]} for k, v in header.items()}
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ShardError(f"{path}: unreadable shard (corrupt safetensors header: {exc})") from None
    end = max((t["data_offsets"][1] for t in tensors.values()), default=0)
    if 8 + n + end != size:
        raise ShardError(f"{path}: unreadable shard (header describes {8 + n + end} bytes, file has {size}; "
                         "truncated or corrupt)")
    for name, t in tensors.items():
        a, b = t["data_offsets"]
        numel = 1
        for d in t["shape"]:
            numel *= d
        if not 0 <= a <= b or (t["dtype"] in _ST_ITEMSIZE and b - a != numel * _ST_ITEMSIZE[t["dtype"]]):
            raise ShardError(f"{path}: unreadable shard (tensor {name}: {b - a} bytes for shape {t['shape']} "
                             f"{t['dtype']})")
    return tensors, 8 + n


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_shard(directory: Path, manifest: dict, s: dict, verify: str = "header") -> list[int]:
    """Check shard entry ``s`` of ``manifest`` against its file; returns its sequence offsets
    (``num_sequences + 1`` values). ``verify="header"`` reads the header and the ``offsets``
    tensor only; ``"full"`` also hashes the file against ``sha256``.

    Raises:
        ShardError: naming the file and what differs.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: one of {VERIFY_MODES}")
    try:  # the manifest is data: a file name in it must not point outside the directory
        path = safe_path(directory, s["file"], key=f"{directory / MANIFEST}: shard {s['index']} file")
    except ValueError as exc:
        raise ShardError(str(exc)) from None
    if not path.is_file():
        raise ShardError(f"{path}: listed in the manifest but missing")
    size = path.stat().st_size
    if s.get("bytes") is not None and size != s["bytes"]:
        raise ShardError(f"{path}: size {size} bytes, manifest says {s['bytes']} (truncated or corrupt shard)")
    tensors, data_start = read_safetensors_header(path)
    H, T = manifest["hidden_size"], s["num_tokens"]
    scaled = manifest.get("encoding") is not None

    def want(name: str, shape: list[int], dtype: str | None) -> None:
        t = tensors.get(name)
        if t is None:
            raise ShardError(f"{path}: no tensor {name!r} (has {sorted(tensors)})")
        if t["shape"] != shape:
            raise ShardError(f"{path}: {name} shape {t['shape']}, manifest says {shape}")
        if dtype is not None and t["dtype"] != dtype:
            raise ShardError(f"{path}: {name} dtype {t['dtype']}, want {dtype}")

    want("aux_hidden_states", [T, 3 * H], None)
    if _st_dtype(manifest["dtype"]) != tensors["aux_hidden_states"]["dtype"]:
        raise ShardError(f"{path}: dtype {tensors['aux_hidden_states']['dtype']}, manifest says {manifest['dtype']}")
    want("final_hidden_states", [T, H], _st_dtype(manifest["dtype"]))
    if scaled:
        t = tensors.get("aux_hidden_states_scale")
        if t is None or t["shape"] != [T, 3]:
            raise ShardError(f"{path}: aux_hidden_states_scale shape {t and t['shape']}, want [{T}, 3]")
        want("final_hidden_states_scale", [T, 1], "F32")
    want("input_ids", [T], "I32")
    want("loss_mask", [T], "U8")
    n_seq = s.get("num_sequences")
    if n_seq is None:
        n_seq = tensors.get("offsets", {"shape": [1]})["shape"][0] - 1
    want("offsets", [n_seq + 1], "I64")
    a, b = tensors["offsets"]["data_offsets"]
    with path.open("rb") as fh:
        fh.seek(data_start + a)
        raw = fh.read(b - a)
    offsets = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    if not offsets or offsets[0] != 0 or offsets[-1] != T or any(x > y for x, y in zip(offsets, offsets[1:])):
        raise ShardError(f"{path}: offsets {offsets[:4]}...{offsets[-1:]} do not split {T} tokens into "
                         f"{n_seq} sequences (corrupt shard)")
    if verify == "full" and file_sha256(path) != s["sha256"]:
        raise ShardError(f"{path}: checksum mismatch (corrupt or truncated shard)")
    return offsets


def _verify_mode(verify: bool | str) -> str:
    if verify is True:
        return "full"
    if verify is False:
        return "header"
    return verify


class ShardReader:
    """A finished shard directory opened for reading; item i is one sequence:

    ``{"input_ids" (T,) long, "loss_mask" (T,) long, "aux_hidden_states" (T, 3H),
    "final_hidden_states" (T, H)}``: plain shards in their storage dtype, fp8 shards decoded
    to ``decode_dtype`` (default float32, on the CPU). With ``decode_dtype=None`` fp8 shards
    are handed out undecoded: the states as stored (float8_e4m3fn) plus their scales,
    ``"aux_hidden_states_scale" (T, 3)`` and ``"final_hidden_states_scale" (T, 1)`` float32,
    which collate and pack like any other key; :func:`~draftsmith.data_prep.state_codec.decode_states`
    decodes the batch after it is moved to the device (plain shards are unaffected). Shards are memory-mapped and
    sliced per sequence; the manifest may be the union of per-rank parts.

    ``verify``: ``"header"`` (default; also ``False``) checks each shard's size against the
    manifest's ``bytes`` (when recorded) and its safetensors header (tensor names, shapes,
    dtypes, sequence offsets) without reading the tensor data; ``"full"`` (also ``True``)
    hashes every file against its ``sha256`` as well.

    Raises:
        ShardError: missing manifest or shard, incomplete shard set, or a size / header /
            (``verify="full"``) checksum that disagrees with the manifest; the message names
            the shard file.
    """

    def __init__(self, directory: Path | str, verify: bool | str = "header", max_length: int | None = None,
                 decode_dtype: torch.dtype | None = torch.float32):
        self.dir = Path(directory)
        verify = _verify_mode(verify)
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: one of {VERIFY_MODES}")
        manifest = load_manifest(self.dir)
        if manifest is None:
            raise ShardError(f"{self.dir}: no {MANIFEST}; run the hidden-states stage first")
        self.manifest = manifest
        expected = num_shards(manifest)
        if len(manifest["shards"]) != expected:
            raise ShardError(
                f"{self.dir}: manifest lists {len(manifest['shards'])} of {expected} shards; "
                "the hidden-states stage did not finish (rerun it to resume)"
            )
        self.max_length = max_length
        self.scaled = manifest.get("encoding") is not None
        if self.scaled and manifest["encoding"].get("name") != FP8_ENCODING["name"]:
            raise ShardError(f"{self.dir / MANIFEST}: unknown encoding {manifest['encoding']!r}")
        self.decode_dtype = decode_dtype
        self.index: list[tuple[str, int, int]] = []  # (file, start, end)
        for s in manifest["shards"]:
            offsets = check_shard(self.dir, manifest, s, verify)
            for a, b in zip(offsets[:-1], offsets[1:]):
                self.index.append((s["file"], a, b))
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self) -> list[int]:
        return [min(b - a, self.max_length or b - a) for _, a, b in self.index]

    def _fh(self, file: str):
        fh = self._handles.get(file)
        if fh is None:
            fh = self._handles[file] = safe_open(self.dir / file, framework="pt")
        return fh

    def _states(self, fh: Any, key: str, a: int, b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``a:b`` of state ``key``: as stored, fp8 decoded to ``dtype``."""
        x = fh.get_slice(key)[a:b]
        if not self.scaled:
            return x
        return decode_fp8(x, fh.get_slice(key + SCALE_SUFFIX)[a:b], dtype)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        file, a, b = self.index[i]
        if self.max_length:
            b = min(b, a + self.max_length)
        fh = self._fh(file)
        item = {"input_ids": fh.get_slice("input_ids")[a:b].long(), "loss_mask": fh.get_slice("loss_mask")[a:b].long()}
        for key in STATE_KEYS:
            if self.scaled and self.decode_dtype is None:  # decoded on the device (decode_states)
                item[key] = fh.get_slice(key)[a:b]
                item[key + SCALE_SUFFIX] = fh.get_slice(key + SCALE_SUFFIX)[a:b]
            else:
                item[key] = self._states(fh, key, a, b, self.decode_dtype)
        return item

    def __getstate__(self):  # safe_open handles do not pickle (dataloader workers)
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def _st_dtype(name: str) -> str:
    return _ST_DTYPES[getattr(torch, name)]


def convert_shards(src: Path, dst: Path, dtype: str, progress: bool = True) -> dict:
    """Re-encode a finished shard directory into storage ``dtype`` (e.g. bf16 -> fp8), sequence
    by sequence through a :class:`ShardWriter`, with the same token ids, masks, offsets, order
    and shard boundaries; resumable like ``generate_hidden_states`` (a shard already in
    ``dst``'s manifest is kept).

    Returns:
        The new manifest (also ``dst/manifest.json``) with ``bytes_per_token`` of both sides.

    Raises:
        ShardError: ``src`` is incomplete or corrupt, or ``dst`` holds shards of another spec.
        DiskFullError: ``dst``'s disk filled up (finished shards are kept; rerun to resume).
    """
    from tqdm.auto import tqdm

    source = ShardReader(src, verify="full")
    m = source.manifest
    spec = ShardSpec(m["hidden_size"], m["aux_layer_ids"], dtype)
    header = {k: v for k, v in m.items() if k not in ("shards", "num_tokens", "throughput_tok_s", "encoding")}
    header["dtype"] = dtype
    if spec.encoding is not None:
        header["encoding"] = spec.encoding
    header["converted_from"] = {"dir": str(src), "dtype": m["dtype"]}
    dst.mkdir(parents=True, exist_ok=True)
    existing = load_manifest(dst)
    if existing is not None and any(existing.get(k) != header[k] for k in HEADER_KEYS):
        raise ShardError(f"{dst / MANIFEST}: holds shards of another spec; use a fresh directory")
    done = {s["index"]: s for s in existing["shards"]} if existing else {}
    for s in tqdm(m["shards"], desc=f"convert -> {dtype}", disable=not progress):
        if s["index"] in done and (dst / s["file"]).is_file():
            continue
        fh = source._fh(s["file"])
        offsets = fh.get_tensor("offsets").tolist()
        writer = ShardWriter(dst / s["file"], spec, [b - a for a, b in zip(offsets, offsets[1:])])
        try:
            for a, b in zip(offsets, offsets[1:]):
                writer.add(fh.get_slice("input_ids")[a:b], fh.get_slice("loss_mask")[a:b],
                           source._states(fh, "aux_hidden_states", a, b), source._states(fh, "final_hidden_states", a, b))
            sha, size = writer.finish()
        finally:
            writer.abort()
        done[s["index"]] = dict(s, sha256=sha, bytes=size)
        atomic_write_bytes(dst / MANIFEST, json.dumps(dict(header, shards=[done[i] for i in sorted(done)]),
                                                      indent=1).encode())
    manifest = dict(header, shards=[done[i] for i in sorted(done)])
    manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
    atomic_write_bytes(dst / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def verify_shards(directory: Path | str, progress: bool = True) -> dict:
    """Fully check every shard of ``directory`` (size, header, sha256), not stopping at the
    first bad one.

    Returns:
        ``{"shards", "bytes", "seconds", "bad": [{"file", "error"}], "problems": [...]}``;
        ``problems`` holds directory-level errors (no / corrupt / incomplete manifest).
    """
    import time

    from tqdm.auto import tqdm

    directory = Path(directory)
    t0 = time.perf_counter()
    out: dict = {"dir": str(directory), "shards": 0, "bytes": 0, "seconds": 0.0, "bad": [], "problems": []}
    try:
        manifest = load_manifest(directory)
    except ShardError as exc:
        manifest = None
        out["problems"].append(str(exc))
    if manifest is None:
        if not out["problems"]:
            out["problems"].append(f"{directory}: no {MANIFEST}; run the hidden-states stage first")
        return out
    expected = num_shards(manifest)
    if len(manifest["shards"]) != expected:
        out["problems"].append(f"{directory}: manifest lists {len(manifest['shards'])} of {expected} shards "
                               "(the hidden-states stage did not finish)")
    total = sum(int(s.get("bytes") or 0) for s in manifest["shards"])
    bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="verify shards", disable=not progress)
    for s in manifest["shards"]:
        out["shards"] += 1
        try:
            check_shard(directory, manifest, s, "full")
            size = (directory / s["file"]).stat().st_size
            out["bytes"] += size
        except ShardError as exc:
            out["bad"].append({"file": str(s.get("file")), "error": str(exc)})
            size = int(s.get("bytes") or 0)
        bar.update(int(s.get("bytes") or 0) if total else 0)
    bar.close()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def shard_bytes_per_token(directory: Path | str) -> float:
    """Disk bytes of all shards / tokens (the manifest excluded)."""
    m = load_manifest(Path(directory))
    if m is None:
        raise ShardError(f"{directory}: no {MANIFEST}")
    total = sum((Path(directory) / s["file"]).stat().st_size for s in m["shards"])
    return total / max(1, sum(s["num_tokens"] for s in m["shards"]))
