"""Target hidden-state capture and the offline shard store.

Capture follows vLLM's EAGLE-3 convention (SPEC.md section 1): aux id ``L`` is the
residual stream *after L decoder layers*, i.e. the input of decoder layer ``L`` (``L=0``
is the embedding output); it is taken with a forward pre-hook on ``layers[L]``, which works
for any decoder stack (Llama, Qwen, gpt-oss). The final state is the base model's
``last_hidden_state`` (after the final norm); the target ``lm_head`` is never run.

Shard layout (``<dir>/shard-00000.safetensors``), one row per token, sequences concatenated:
``aux_hidden_states [N, 3H]``, ``final_hidden_states [N, H]`` (storage dtype),
``input_ids [N]`` int32, ``loss_mask [N]`` uint8, ``offsets [S+1]`` int64.
``manifest.json`` lists every finished shard with its sequence/token counts and sha256.
Shards and the manifest are written atomically (temp file, fsync, rename), so a killed run
resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class ShardError(RuntimeError):
    """A shard disagrees with its manifest (shape, dtype, checksum) or is unreadable."""


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers``)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}")
    return layers


class AuxHiddenStateCapture:
    """Context manager: pre-hooks on the aux layers record their input hidden states.

    ``captured[L]`` is ``(B, T, H)`` after a forward pass.
    """

    def __init__(self, model: Any, layer_ids: list[int]):
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "AuxHiddenStateCapture":
        for L in self.layer_ids:
            def hook(module, args, kwargs, L=L):
                self.captured[L] = args[0] if args else kwargs["hidden_states"]

            self._handles.append(self.layers[L].register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@torch.no_grad()  # not inference_mode: online training feeds these tensors to autograd
def capture_batch(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target's base model once.

    Args:
        input_ids / attention_mask: ``(B, T)``, right-padded.
        layer_ids: three ascending aux ids.

    Returns:
        ``(aux (B, T, 3H), final (B, T, H))``.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with AuxHiddenStateCapture(model, layer_ids) as cap:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    aux = torch.cat([cap.captured[L] for L in layer_ids], dim=-1)
    return aux, out.last_hidden_state


@dataclass
class ShardSpec:
    hidden_size: int
    aux_layer_ids: list[int]
    dtype: str  # storage dtype name, e.g. "bfloat16"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write a safetensors shard atomically; returns its sha256."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return _sha256(path)


def load_manifest(directory: Path) -> dict | None:
    f = directory / MANIFEST
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ShardError(f"{f}: corrupt manifest ({exc})") from exc


def generate_hidden_states(
    model: Any,
    records: list[dict],
    out_dir: Path,
    spec: ShardSpec,
    sequences_per_shard: int = 64,
    batch_tokens: int = 4096,
    target_id: str = "",
    progress: bool = True,
) -> dict:
    """Capture aux + final hidden states for ``records`` (``input_ids``/``loss_mask``) into shards.

    Records are assigned to shards by index (``sequences_per_shard`` each); a shard already
    listed in the manifest with a matching spec is skipped, so reruns only compute what is
    missing. Within a shard, sequences are batched by length up to ``batch_tokens`` padded
    tokens.

    Returns:
        The manifest dict, also written to ``out_dir/manifest.json``; it records the capture
        throughput (tokens/s) of this run under ``"throughput_tok_s"``.

    Raises:
        ShardError: an existing manifest was written for different layers / size / dtype.
    """
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "format_version": FORMAT_VERSION,
        "target": target_id,
        "hidden_size": spec.hidden_size,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "dtype": spec.dtype,
        "num_records": len(records),
        "sequences_per_shard": sequences_per_shard,
    }
    manifest = load_manifest(out_dir)
    if manifest is not None:
        for key in ("hidden_size", "aux_layer_ids", "dtype", "num_records", "sequences_per_shard"):
            if manifest.get(key) != header[key]:
                raise ShardError(
                    f"{out_dir / MANIFEST}: existing shards have {key}={manifest.get(key)!r}, this run wants "
                    f"{header[key]!r}; use a fresh directory"
                )
        done = {s["index"]: s for s in manifest["shards"]}
    else:
        done = {}
    dtype = getattr(torch, spec.dtype)
    device = next(model.parameters()).device
    n_shards = (len(records) + sequences_per_shard - 1) // sequences_per_shard
    captured_tokens, t0 = 0, time.perf_counter()
    todo = [i for i in range(n_shards) if i not in done or not (out_dir / done[i]["file"]).is_file()]
    bar = tqdm(total=sum(len(r["input_ids"]) for i in todo for r in _shard_records(records, i, sequences_per_shard)),
               unit="tok", desc="hidden states", disable=not progress)
    for index in todo:
        chunk = _shard_records(records, index, sequences_per_shard)
        aux_rows: list[torch.Tensor | None] = [None] * len(chunk)
        fin_rows: list[torch.Tensor | None] = [None] * len(chunk)
        for batch in _length_batches(chunk, batch_tokens):
            T = max(len(chunk[j]["input_ids"]) for j in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            att = torch.zeros(len(batch), T, dtype=torch.long)
            for b, j in enumerate(batch):
                n = len(chunk[j]["input_ids"])
                ids[b, :n] = torch.tensor(chunk[j]["input_ids"])
                att[b, :n] = 1
            aux, fin = capture_batch(model, ids.to(device), att.to(device), spec.aux_layer_ids)
            for b, j in enumerate(batch):
                n = len(chunk[j]["input_ids"])
                aux_rows[j] = aux[b, :n].to("cpu", dtype)
                fin_rows[j] = fin[b, :n].to("cpu", dtype)
            ntok = int(att.sum())
            captured_tokens += ntok
            bar.update(ntok)
        lengths = torch.tensor([len(r["input_ids"]) for r in chunk], dtype=torch.long)
        tensors = {
            "aux_hidden_states": torch.cat(aux_rows),
            "final_hidden_states": torch.cat(fin_rows),
            "input_ids": torch.tensor([t for r in chunk for t in r["input_ids"]], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in chunk for m in r["loss_mask"]], dtype=torch.uint8),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        }
        name = f"shard-{index:05d}.safetensors"
        sha = write_shard(out_dir / name, tensors)
        done[index] = {
            "index": index,
            "file": name,
            "num_sequences": len(chunk),
            "num_tokens": int(lengths.sum()),
            "ids": [r["id"] for r in chunk],
            "sha256": sha,
        }
        manifest = dict(header, shards=[done[i] for i in sorted(done)])
        atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    bar.close()
    elapsed = time.perf_counter() - t0
    manifest = dict(header, shards=[done[i] for i in sorted(done)])
    manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
    manifest["throughput_tok_s"] = captured_tokens / elapsed if captured_tokens else None
    atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def _shard_records(records: list[dict], index: int, per_shard: int) -> list[dict]:
    return records[index * per_shard : (index + 1) * per_shard]


def _length_batches(chunk: list[dict], batch_tokens: int) -> Iterator[list[int]]:
    order = sorted(range(len(chunk)), key=lambda j: len(chunk[j]["input_ids"]))
    batch: list[int] = []
    for j in order:
        T = len(chunk[j]["input_ids"])
        if batch and T * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(j)
    if batch:
        yield batch


class HiddenStateDataset(torch.utils.data.Dataset):
    """Map-style dataset over a shard directory; item i is one sequence:

    ``{"input_ids" (T,) long, "loss_mask" (T,) long, "aux_hidden_states" (T, 3H),
    "final_hidden_states" (T, H)}`` in the storage dtype. Shards are memory-mapped and
    sliced per sequence.

    Raises:
        ShardError: missing manifest or shard, incomplete shard set, or (``verify=True``)
            a checksum / shape / dtype that disagrees with the manifest.
    """

    def __init__(self, directory: Path | str, verify: bool = True, max_length: int | None = None):
        self.dir = Path(directory)
        manifest = load_manifest(self.dir)
        if manifest is None:
            raise ShardError(f"{self.dir}: no {MANIFEST}; run the hidden-states stage first")
        self.manifest = manifest
        expected = (manifest["num_records"] + manifest["sequences_per_shard"] - 1) // manifest["sequences_per_shard"]
        if len(manifest["shards"]) != expected:
            raise ShardError(
                f"{self.dir}: manifest lists {len(manifest['shards'])} of {expected} shards; "
                "the hidden-states stage did not finish (rerun it to resume)"
            )
        self.max_length = max_length
        self.index: list[tuple[str, int, int]] = []  # (file, start, end)
        H = manifest["hidden_size"]
        for s in manifest["shards"]:
            path = self.dir / s["file"]
            if not path.is_file():
                raise ShardError(f"{path}: listed in the manifest but missing")
            if verify and _sha256(path) != s["sha256"]:
                raise ShardError(f"{path}: checksum mismatch (corrupt or truncated shard)")
            try:
                with safe_open(path, framework="pt") as fh:
                    offsets = fh.get_tensor("offsets")
                    aux = fh.get_slice("aux_hidden_states")
                    shape, dtype = aux.get_shape(), aux.get_dtype()
            except Exception as exc:
                raise ShardError(f"{path}: unreadable shard ({exc})") from exc
            if shape != [s["num_tokens"], 3 * H]:
                raise ShardError(f"{path}: aux_hidden_states shape {shape}, manifest says [{s['num_tokens']}, {3 * H}]")
            if _st_dtype(manifest["dtype"]) != dtype:
                raise ShardError(f"{path}: dtype {dtype}, manifest says {manifest['dtype']}")
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
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

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        file, a, b = self.index[i]
        if self.max_length:
            b = min(b, a + self.max_length)
        fh = self._fh(file)
        return {
            "input_ids": fh.get_slice("input_ids")[a:b].long(),
            "loss_mask": fh.get_slice("loss_mask")[a:b].long(),
            "aux_hidden_states": fh.get_slice("aux_hidden_states")[a:b],
            "final_hidden_states": fh.get_slice("final_hidden_states")[a:b],
        }

    def __getstate__(self):  # safe_open handles do not pickle (dataloader workers)
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


class TokenizedDataset(torch.utils.data.Dataset):
    """Token ids and loss masks only (``tokenized.jsonl``), for online training where the
    target computes hidden states on the fly. Items: ``{"input_ids" (T,), "loss_mask" (T,)}``,
    in the same order and with the same lengths as the shards built from the same file."""

    def __init__(self, path: Path | str, max_length: int | None = None):
        import json

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} missing: run the tokenize stage first")
        with self.path.open(encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh]
        self.rows = [(r["input_ids"][:max_length], r["loss_mask"][:max_length]) if max_length else
                     (r["input_ids"], r["loss_mask"]) for r in rows]

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.rows]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.rows[i]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def _st_dtype(name: str) -> str:
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[name]


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences into ``(B, T, ...)`` tensors (padding has loss_mask 0) and
    add ``attention_mask (B, T)``: 1 on real tokens."""
    T = max(x["input_ids"].shape[0] for x in batch)
    out = {}
    for key in batch[0]:
        ref = batch[0][key]
        t = ref.new_zeros((len(batch), T, *ref.shape[1:]))
        for b, x in enumerate(batch):
            t[b, : x[key].shape[0]] = x[key]
        out[key] = t
    lengths = torch.tensor([x["input_ids"].shape[0] for x in batch])
    out["attention_mask"] = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (B, T)
    return out
