"""``draftsmith bench memory``: the training memory of a recipe's draft, measured by running it.

    draftsmith bench memory RECIPE.yaml [--target-config config.json] [--batch-size B]
        [--max-length T [T ...]] [--device-memory-gib G] [--launcher L.yaml] [--json]

The recipe's method builds its real draft model at the target's true geometry (the target's
``config.json``: ``--target-config``, else the copy shipped under ``recipes/targets/``, see
:func:`draftsmith.target.bundled_target_config`) with random weights, and trains it on a
random batch shaped like the method's real one (``input_ids``, ``loss_mask``,
``attention_mask``, the aux / final hidden states in ``data.hidden_states_dtype``, position /
document ids under ``train.packing``) through its real ``compute_loss``: forward, loss,
backward, gradient clipping and the step of ``train.optimizer`` (AdamW; Muon + AdamW) under the
trainer's non-finite guard, on the launcher's precision path (bf16 autocast
with fp32 master weights and accelerate's fp32 output upcast; bf16 weights under DeepSpeed;
fp32 without mixed precision). Nothing is downloaded.

By default everything runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`:
tensors carry shapes, dtypes and storages but no data and no compute, so the recipe's full
``B x T`` costs seconds on any machine. :class:`MemoryTracker` (a ``TorchDispatchMode``) counts
the bytes of every live *storage* (views share their base's storage and are not counted
again; a storage is freed when its last tensor is, autograd's saved tensors included), and
keeps the peak of each phase. Index / mask tensors computed from the batch (token ids, loss
masks, sampled anchors) stay real, so data-dependent code paths take their real shapes; a
value read from a fake tensor (a metric) reads as 1. ``--device cuda`` (or ``cpu``) runs
the same step for real instead, and on CUDA also reports ``torch.cuda.max_memory_allocated``.

Two optimizer steps run; the second is measured, so the optimizer state (AdamW's moments; Muon's
momentum and the guard's copies, see :class:`~draftsmith.train.components.nonfinite.NonFiniteGuard`) exists as
it does at every step of a run. The step is measured in one process; the per-GPU figure applies the launcher's
sharding by arithmetic (:func:`draftsmith.train.dry_run.state_bytes_per_gpu`): measured peak
- (trainable weights + gradients + optimizer state as held by the one process) + those states
as one rank of the launcher holds them. Activations, transients, the batch and the frozen
buffers (target embedding, teacher head) are per process already and stay as measured; in
the optimizer phase the update's transients are divided like the optimizer state.

The dry run's estimate (:func:`draftsmith.train.dry_run.memory_estimate`) is printed beside
each measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

GiB = 1024**3
LARGEST_GROUPS = 16  # groups of storages at the peak listed in --json (largest_at_peak)
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# the tracker


@dataclass
class PhasePeak:
    """The peak bytes of one phase; ``start`` / ``end``: the phase's span in the tracker's event
    log, ``live_at_start`` the storages (serials) live when it began (:meth:`MemoryTracker.weighted_peak`
    replays it)."""

    bytes: int = 0
    serials: frozenset[int] = frozenset()
    start: int = 0
    end: int | None = None
    live_at_start: frozenset[int] = frozenset()


class MemoryTracker(TorchDispatchMode):
    """Live bytes of the storages the dispatched ops create, and their peak.

    Every tensor an op returns has its storage registered once (a view's storage is its base's:
    not counted again) with a weak reference; the bytes are released when the storage is
    freed (its last tensor, including one autograd saved, is gone). :meth:`track` registers
    tensors created outside the mode; :meth:`exclude` takes storages out of the count (host
    tensors); with ``device``, only storages on that device type are counted. :meth:`phase`
    keeps the peak of a code region; :meth:`weighted_peak` replays the region's allocations and
    frees to find the peak of a weighted count (and the storages live at it).

    Under ``fake`` (a :class:`FakeTensorMode` entered *before* this mode), ops whose tensor
    inputs are all real run for real (integer / bool factories, and any factory given a
    ``generator``, too): index and mask tensors computed from a real batch keep their values, so
    boolean indexing, ``nonzero`` and host reads on them work; a boolean index over fake data
    is applied as if every element were True, and a scalar read from a fake tensor is 1.
    """

    def __init__(self, fake: Any | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.fake = fake
        self.device_type = None if device is None else torch.device(device).type  # None: every device
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> serial
        self._bytes: dict[int, int] = {}  # live serial -> bytes
        self._size: dict[int, int] = {}  # every serial -> bytes (peaks are broken down after the fact)
        self._origin: dict[int, str] = {}  # serial -> "op shape dtype" of the tensor that created it
        self._op = "outside"
        self._seen: set[str] = set()  # the names of the ops dispatched under the tracker
        self.grad_serials: set[int] = set()
        self._excluded: set[int] = set()
        self._serials = itertools.count()
        self.current = 0
        self.peak = 0
        self._phases: dict[str, PhasePeak] = {}
        self._open: list[str] = []
        self._events: list[tuple[int, int]] = []  # (serial, +1 allocated / -1 freed or excluded)

    # -- accounting
    def _register(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or (self.device_type is not None and t.device.type != self.device_type):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st in self._live:
            return
        serial = next(self._serials)
        n = int(st.nbytes())
        self._live[st] = serial
        self._bytes[serial] = self._size[serial] = n
        self._events.append((serial, 1))
        self._origin[serial] = f"{self._op} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        self.current += n
        weakref.finalize(st, self._release, serial)
        self._update_peak()

    def _release(self, serial: int) -> None:
        n = self._bytes.pop(serial, 0)
        if serial in self._excluded:
            self._excluded.discard(serial)
        else:
            self.current -= n
            self._events.append((serial, -1))

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
        for name in self._open:
            ph = self._phases[name]
            if self.current > ph.bytes:
                ph.bytes = self.current

    def track(self, tensors: Any) -> None:
        """Register the storages of the tensors in ``tensors`` (any pytree; modules' state too)."""
        for t in _tensors(tensors):
            self._register(t)

    def exclude(self, tensors: Any) -> None:
        """Stop counting the storages of ``tensors`` (host-side tensors)."""
        for t in _tensors(tensors):
            self._register(t)
            serial = self.serial(t)
            if serial is not None and serial not in self._excluded:
                self._excluded.add(serial)
                self.current -= self._bytes[serial]
                self._events.append((serial, -1))

    def ran(self, op: str) -> bool:
        """Whether an op whose name starts with ``op`` was dispatched under the tracker."""
        return any(name.startswith(op) for name in self._seen)

    def serial(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage (None: not registered)."""
        try:
            return self._live.get(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None

    def bytes_of(self, serials: Any) -> int:
        return sum(self._bytes.get(s, 0) for s in serials)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhasePeak]:
        """Keep the peak of the enclosed region as ``phases[name]`` (starting from the bytes live
        on entry)."""
        live = frozenset(s for s in self._bytes if s not in self._excluded)
        ph = self._phases[name] = PhasePeak(self.current, live, len(self._events), None, live)
        self._open.append(name)
        try:
            yield ph
        finally:
            self._open.remove(name)
            ph.end = len(self._events)

    def weighted_peak(self, name: str, weight: dict[int, float], default: float = 1.0) -> tuple[float, frozenset[int]]:
        """The peak over phase ``name`` of the live bytes with storage ``s`` counted
        ``weight.get(s, default)`` times (e.g. 0 for the trainable state a launcher shards, whose
        per-rank bytes are added by arithmetic), and the storages live at that moment: replayed
        from the event log, so it may fall at another moment than the plain peak."""
        ph = self._phases[name]
        events = self._events[ph.start:ph.end]
        w = lambda s: weight.get(s, default) * self._size[s]  # noqa: E731
        cur = best = sum(w(s) for s in ph.live_at_start)
        at = 0
        for i, (s, sign) in enumerate(events, start=1):
            cur += sign * w(s)
            if cur > best:
                best, at = cur, i
        live = set(ph.live_at_start)
        for s, sign in events[:at]:
            (live.add if sign > 0 else live.discard)(s)
        return best, frozenset(live)

    @property
    def phases(self) -> dict[str, PhasePeak]:
        return self._phases

    # -- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs) if self.fake is not None else func(*args, **kwargs)
        self._op = func.__name__
        self._seen.add(self._op)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._register(t)
        return out

    def _run(self, func, args, kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        flat = pytree.tree_leaves((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        fake_in = any(isinstance(a, FakeTensor) for a in tensors)
        if not fake_in and _runs_real(func, tensors, kwargs):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            return _scalar_stand_in(args[0].dtype)
        if func in (aten.nonzero.default, aten.argwhere.default):  # every element counted as True
            x = args[0]
            return torch.zeros((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if func is aten.masked_select.default:
            x, mask = args[0], args[1]
            n = torch.broadcast_shapes(x.shape, mask.shape).numel()
            return torch.empty(n, dtype=x.dtype, device=x.device)
        if func in _INDEX_OPS and any(_is_mask(i) for i in args[1] if i is not None):
            args = (args[0], _long_indices(args[1]), *args[2:])
        return func(*args, **kwargs)

    # -- reporting
    def breakdown(self, serials: frozenset[int], categories: dict[str, set[int]]) -> dict[str, int]:
        """Bytes of the storages ``serials`` by category (``categories``: name -> serials); the
        rest is ``"activations"``; ``"total"``: all of them."""
        out, seen = {}, set()
        for cat, members in categories.items():
            mine = (serials & members) - seen
            seen |= mine
            out[cat] = self._bytes_at_peak(mine)
        out["activations"] = self._bytes_at_peak(serials - seen)
        out["total"] = self._bytes_at_peak(serials)
        return out

    def largest(self, serials: frozenset[int], n: int = 20) -> list[tuple[int, int, str]]:
        """The storages ``serials`` grouped by the op, shape and dtype that created them, largest
        groups first: ``(bytes, count, "op shape dtype")``."""
        groups: dict[str, list[int]] = {}
        for s in serials:
            g = groups.setdefault(self._origin.get(s, "?"), [0, 0])
            g[0] += self._size[s]
            g[1] += 1
        return sorted(((b, c, o) for o, (b, c) in groups.items()), reverse=True)[:n]

    def _bytes_at_peak(self, serials: set[int]) -> int:
        return sum(self._size[s] for s in serials)


_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
              aten._unsafe_index.Tensor, aten._unsafe_index_put.default}
_REAL_FACTORY_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        return
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, torch.nn.Module):
            yield from _tensors(leaf)


def _runs_real(func, tensors: list[torch.Tensor], kwargs: dict) -> bool:
    """Under fake mode: ops on real tensors only, and integer / bool / seeded factories, run for real."""
    if tensors:
        return True
    if kwargs.get("generator") is not None:
        return True
    dtype = kwargs.get("dtype")
    if dtype is None:
        schema = func._schema
        returns = [r for r in schema.returns]
        if not returns or str(returns[0].type) != "Tensor":
            return True  # no tensor out (e.g. scalar ops)
        dtype = torch.get_default_dtype()
        if func in (aten.arange.default, aten.arange.start, aten.arange.start_step, aten.randint.default,
                    aten.randint.low, aten.randperm.default, aten.scalar_tensor.default):
            return True  # integer ranges / permutations (arange of floats is small)
    return dtype in _REAL_FACTORY_DTYPES


def _scalar_stand_in(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return 1.0
    return 1


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _long_indices(indices: list) -> list:
    """Boolean masks in an index list replaced by the long indices of their True elements (a
    fake mask: all elements)."""
    from torch._subclasses.fake_tensor import FakeTensor

    out = []
    for i in indices:
        if not _is_mask(i):
            out.append(i)
        elif isinstance(i, FakeTensor):
            out.extend([torch.zeros(i.numel(), dtype=torch.long, device=i.device)] * i.dim())
        else:
            with _disable_current_modes():
                out.extend(i.bool().nonzero(as_tuple=True))
    return out


# ---------------------------------------------------------------------------------------------
# CUDA autocast policy on CPU


CUDA_FP32_OPS = ("softmax.int", "log_softmax.int", "exp", "log", "log1p", "rsqrt", "pow.Tensor_Scalar",
                 "pow.Tensor_Tensor", "logsumexp", "cumsum", "layer_norm", "sum", "sum.dim_IntList")


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While active, CPU bf16 autocast casts the ops CUDA autocast runs in float32 (softmax,
    log_softmax, exp, log, rsqrt, pow, sum, cumsum, logsumexp, layer_norm) to float32 as CUDA
    does, so a fake CPU step keeps the activations a GPU step keeps (CPU autocast leaves them in
    bf16). Matmuls / linear / SDPA are bf16 under both."""
    lib = torch.library.Library("aten", "IMPL")
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def make(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(keyset):
                args = [a.float() if isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16)
                        else a for a in args]
                return op(*args, **kwargs)
        return kernel

    try:
        for name in CUDA_FP32_OPS:
            base, _, overload = name.partition(".")
            op = getattr(getattr(aten, base), overload or "default")
            lib.impl(name, make(op), "AutocastCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def cuda_attention_policy(fused_loss: bool = True) -> Iterator[None]:
    """While active, the drafts' attention takes CUDA's path on any device: with a mask, CUDA's
    fused SDPA kernels take no grouped key/value heads, so the heads are expanded before the call
    (:func:`~draftsmith.models.attention.sdpa_supports_gqa_with_mask`); the CPU passes them grouped.
    A fake step then holds the key / value copies a GPU step holds. The teacher logits stay in the
    target's dtype, as on a GPU (:func:`~draftsmith.train.losses.teacher_in_target_dtype`), and the
    loss takes the fused path with ``fused_loss`` (:func:`~draftsmith.train.losses.fused_device_ok`;
    fake tensors only: under them its kernel is shape-only, and a real CPU step has no kernel to run)."""
    from draftsmith.models import attention
    from draftsmith.train import losses

    saved = attention.sdpa_supports_gqa_with_mask, losses.teacher_in_target_dtype, losses.fused_device_ok
    attention.sdpa_supports_gqa_with_mask = lambda device: False
    losses.teacher_in_target_dtype = lambda device: True
    if fused_loss:  # the fused loss's buffers and gradients (fake tensors: its kernel is shape-only)
        losses.fused_device_ok = lambda device: True
    try:
        yield
    finally:
        attention.sdpa_supports_gqa_with_mask, losses.teacher_in_target_dtype, losses.fused_device_ok = saved


# ---------------------------------------------------------------------------------------------
# the method without a prepared run directory


class OneProcess:
    """The parts of an ``accelerate.Accelerator`` the methods read, for one process."""

    num_processes = 1
    process_index = 0
    local_process_index = 0
    is_main_process = True
    is_local_main_process = True
    sync_gradients = True

    def __init__(self, device: torch.device):
        self.device = device

    def reduce(self, tensor: Any, reduction: str = "sum") -> Any:
        return tensor

    def gather(self, tensor: Any) -> Any:
        return tensor

    def unwrap_model(self, model: Any) -> Any:
        return model


def target_geometry(config: Any) -> dict[str, int]:
    """``hidden_size``, ``vocab_size``, ``num_hidden_layers`` of the target's text config."""
    from draftsmith.target import text_config

    text = text_config(config)
    return {"hidden_size": int(text.hidden_size), "vocab_size": int(text.vocab_size),
            "num_hidden_layers": int(text.num_hidden_layers)}


@contextlib.contextmanager
def offline_method(recipe: Any, config_json: dict[str, Any], head_dtype: torch.dtype,
                   factory: Any = torch.empty) -> Iterator[Any]:
    """The recipe's training method (``models/<name>/training.py``) constructed as a prepared run
    would construct it, from a temporary run directory holding only ``target.json`` and the
    target's ``config.json``: the target's embedding / ``lm_head`` / final norm come from
    ``factory`` (shape, dtype; random or fake), the draft vocab is the first
    ``data.draft_vocab_size`` target ids, the mask token the last id. The directory is removed
    on exit."""
    from unittest import mock

    from draftsmith.layout import RunLayout
    from draftsmith.methods import get_method
    from draftsmith.target import TargetInfo, aux_layer_ids
    from draftsmith.train import method_base
    from transformers import AutoConfig

    tmp = Path(tempfile.mkdtemp(prefix="draftsmith-bench-"))
    try:
        target_dir = tmp / "target"
        target_dir.mkdir()
        (target_dir / "config.json").write_text(json.dumps(config_json))
        config = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=recipe.target.trust_remote_code)
        geo = target_geometry(config)
        H, V, n = geo["hidden_size"], geo["vocab_size"], geo["num_hidden_layers"]
        data = RunLayout(tmp / "run").data
        data.root.mkdir(parents=True)
        ids = aux_layer_ids(recipe.data.aux_layer_ids, n)
        TargetInfo(name_or_path=recipe.target.name_or_path, verifier=recipe.target.name_or_path,
                   path=str(target_dir), architectures=list(getattr(config, "architectures", None) or []),
                   num_hidden_layers=n, hidden_size=H, vocab_size=V, aux_layer_ids=ids).write(data.target_info)
        Vd = min(recipe.data.draft_vocab_size, V)
        d2t = torch.zeros(Vd, dtype=torch.long)  # draft id i -> target id i
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:Vd] = True
        heads = {"embed_tokens": factory(V, H, dtype=head_dtype), "lm_head": factory(V, H, dtype=head_dtype),
                 "final_norm": factory(H, dtype=head_dtype)}
        mask_id = recipe.draft.mask_token_id if getattr(recipe.draft, "mask_token_id", None) is not None else V - 1
        patches = [mock.patch.object(method_base, "load_target_head_tensors", lambda path: dict(heads)),
                   mock.patch.object(method_base, "read_vocab", lambda paths: (d2t.clone(), t2d.clone()))]
        if hasattr(method_base, "DraftVocabMethod") and hasattr(method_base.DraftVocabMethod, "mask_token_id"):
            patches.append(mock.patch.object(method_base.DraftVocabMethod, "mask_token_id",
                                             lambda self, default=None: mask_id))
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            method = get_method(recipe.draft.method).training_method(recipe, tmp / "run")
        yield method
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_recipe(recipe: Any, batch_size: int, max_length: int) -> Any:
    """A copy of ``recipe`` at ``batch_size x max_length`` that trains offline from step 0
    (no warm start, none from the target's MTP layer either, stage 1 of the MLP speculator, no validation)."""
    r = recipe.model_copy(deep=True)
    r.train.batch_size = batch_size
    r.data.max_length = max_length
    r.data.hidden_states_mode = "offline"
    for key, value in (("init_from", None), ("stage2_start_step", None), ("init_from_target", False)):
        if hasattr(r.draft, key):
            setattr(r.draft, key, value)
    return r


# ---------------------------------------------------------------------------------------------
# one measured step


@dataclass
class Precision:
    """How the launcher runs the draft: ``param_dtype`` of the module's weights, ``autocast``
    (bf16 autocast around ``forward`` and accelerate's fp32 upcast of its outputs)."""

    name: str
    param_dtype: torch.dtype
    autocast: bool

    @classmethod
    def of(cls, launch: Any | None, name: str = "auto") -> "Precision":
        if name == "auto":
            if launch is None or launch.mixed_precision != "bf16":
                name = "fp32"
            else:
                name = "bf16" if launch.distributed_type == "DEEPSPEED" else "amp-bf16"
        if name == "fp32":
            return cls(name, torch.float32, False)
        if name == "amp-bf16":
            return cls(name, torch.float32, True)
        if name == "bf16":
            return cls(name, torch.bfloat16, False)
        raise ValueError(f"--precision {name!r}: one of auto, fp32, amp-bf16, bf16")


HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float8_e4m3fn": torch.float32}  # fp8 shards are decoded to float32 by the loader


def random_batch(recipe: Any, H: int, V: int, n_aux: int, fake: bool, seed: int = 0,
                 rows: list[list[int]] | None = None, length: int | None = None) -> dict[str, Any]:
    """A batch shaped like the method's real one, hidden states in ``data.hidden_states_dtype``
    (fake under ``fake``).

    ``rows`` None: ``train.batch_size x data.max_length``, every position real and trained (the
    memory upper bound; under ``train.packing`` two documents per row). Else the documents of each
    row (token counts, :func:`benchmarks.lengths.trainer_rows`) right-padded to ``length``
    positions: real tokens trained (``loss_mask`` 1), padding masked; packed rows carry
    ``position_ids`` / ``document_ids`` as :func:`~draftsmith.train.packing.collate_packed` builds them.
    """
    packing = getattr(recipe.train, "packing", False)
    B = recipe.train.batch_size if rows is None else len(rows)
    T = recipe.data.max_length if rows is None else (length or max(sum(r) for r in rows))
    g = torch.Generator().manual_seed(seed)
    batch: dict[str, Any] = {"input_ids": torch.randint(0, V, (B, T), generator=g)}
    if rows is None:
        batch["loss_mask"] = torch.ones(B, T, dtype=torch.long)
        if packing:  # two documents per row
            half = T // 2
            pos = torch.arange(T)
            batch["position_ids"] = torch.where(pos < half, pos, pos - half).expand(B, T).clone()
            batch["document_ids"] = (pos >= half).long().expand(B, T).clone()
        batch["attention_mask"] = torch.ones(B, T, dtype=torch.long)
    else:  # the trainer's collation of the documents' token counts (masks, positions, document ids)
        from draftsmith.train.data import collate
        from draftsmith.train.packing import collate_packed

        docs = [[{"input_ids": torch.zeros(n, dtype=torch.long)} for n in row] for row in rows]
        pad = lambda longest: T  # noqa: E731
        shape = collate_packed(docs, pad) if packing else collate([row[0] for row in docs], pad)
        batch["loss_mask"] = shape["attention_mask"].clone()
        if packing:
            batch["position_ids"], batch["document_ids"] = shape["position_ids"], shape["document_ids"]
        batch["attention_mask"] = shape["attention_mask"]
    dtype = HIDDEN_DTYPES[recipe.data.hidden_states_dtype]
    make = torch.empty if fake else (lambda *s, dtype: torch.randn(*s, generator=g).to(dtype))
    batch["aux_hidden_states"] = make(B, T, n_aux * H, dtype=dtype)
    batch["final_hidden_states"] = make(B, T, H, dtype=dtype)
    return batch


@dataclass
class Measurement:
    """One measured step (bytes)."""

    max_length: int
    batch_size: int
    process_peak_bytes: int
    phases: dict[str, dict[str, int]]
    trainable_parameters: int
    per_gpu_bytes: int
    per_gpu_phase: str
    state_per_gpu: dict[str, int]
    cuda_max_memory_allocated: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def measure_step(recipe: Any, config_json: dict[str, Any], launch: Any | None = None,
                 precision: Precision | None = None, device: str = "fake", seed: int = 0,
                 rows: list[list[int]] | None = None, length: int | None = None) -> Measurement:
    """Build the recipe's draft and run two training steps of its method on a random batch;
    the second is measured (see the module docstring).

    Args:
        recipe: at the wanted ``train.batch_size`` / ``data.max_length`` (:func:`bench_recipe`).
        config_json: the target's ``config.json`` contents.
        launch: the validated launcher (:class:`~draftsmith.train.launchers.LauncherReport`) or None.
        device: ``"fake"`` (shapes only, see :class:`MemoryTracker`), ``"cpu"`` or ``"cuda"``.
        rows / length: the documents per row of the batch and its padded length
            (:func:`random_batch`); None: every position real (the upper bound).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from draftsmith.train.dry_run import state_bytes_per_gpu

    precision = precision or Precision.of(launch)
    fake = device == "fake"
    dev = torch.device("cpu" if fake else device)
    torch.manual_seed(seed)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    tracker = MemoryTracker(fake=fake_mode, device=None if fake else dev)  # real runs: the device's storages only
    ctx = contextlib.ExitStack()
    with ctx:
        if fake_mode is not None:
            ctx.enter_context(fake_mode)
        ctx.enter_context(tracker)
        if fake and precision.autocast:
            ctx.enter_context(cuda_autocast_policy())
        if dev.type != "cuda":  # the GPU's attention path: grouped key/value heads expanded (models/eagle3/model.py)
            ctx.enter_context(cuda_attention_policy(fused_loss=fake))
        head_dtype = getattr(torch, recipe.target.dtype)
        factory = torch.empty if fake else random_weights
        with offline_method(recipe, config_json, head_dtype, factory) as method:
            geo = {"H": int(method.target_info.hidden_size), "V": int(method.target_info.vocab_size)}
            n_aux = len(method.target_info.aux_layer_ids)
            tracker.exclude(getattr(method, "heads", {}))  # host RAM in a run (moved lazily, if ever)
            model, trainable, optimizers = prepare_model(method, recipe, precision, dev, fake)
            guard = _guard(optimizers, dev)
            cpu_batch = random_batch(recipe, geo["H"], geo["V"], n_aux, fake, seed, rows, length)
            plan = method.batch_plan() if hasattr(method, "batch_plan") else None
            if fake:
                gc_collect()
            batch = _device_batch(cpu_batch, plan, dev, tracker, fake)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            cuda_peak = None
            for step in range(2):
                measured = step == 1
                if measured:
                    gc_collect()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats(dev)
                with tracker.phase(f"forward_backward{step}"):
                    method.begin_step(step)
                    loss, metrics = method.compute_loss(model, batch)
                    loss.backward()
                    del loss, metrics
                if measured:  # the storages holding this step's gradients (freed by zero_grad below)
                    tracker.grad_serials = {s for s in (tracker.serial(p.grad) for p in trainable
                                                        if p.grad is not None) if s is not None}
                with tracker.phase(f"optimizer{step}"):
                    torch.nn.utils.clip_grad_norm_(trainable, recipe.train.max_grad_norm)
                    for opt in optimizers:
                        opt.step()
                    if guard is not None:
                        guard.end_step()
                    for opt in optimizers:
                        opt.zero_grad(set_to_none=True)
                if measured and dev.type == "cuda":
                    torch.cuda.synchronize()
                    cuda_peak = int(torch.cuda.max_memory_allocated(dev))
            categories = _categories(tracker, model, trainable, optimizers, guard, method, batch)
            n_trainable = sum(p.numel() for p in trainable)
            state = state_bytes_per_gpu(n_trainable, launch, precision.name, getattr(recipe.train, "optimizer", "adamw"))
            held = categories["weights"] | categories["gradients"] | categories["optimizer_state"]
            known = held | categories["frozen"] | categories["batch"]
            phases, per_gpu, at_peak = {}, {}, {}
            for name in ("forward_backward", "optimizer"):
                # one rank: the state it holds comes from the launcher's arithmetic (weight 0 here);
                # in the optimizer step the update's transients are divided like the optimizer state
                weight = dict.fromkeys(held, 0.0)
                default = 1.0
                if name == "optimizer" and state["optimizer_shards"] > 1:
                    weight.update(dict.fromkeys(known - held, 1.0))
                    default = 1.0 / state["optimizer_shards"]
                rest, serials = tracker.weighted_peak(f"{name}1", weight, default)
                per_gpu[name] = int(rest) + state["total"]
                at_peak[name] = serials
                phases[name] = tracker.breakdown(serials, categories)
            where = max(per_gpu, key=per_gpu.get)
            peak = max(tracker.phases["forward_backward1"].bytes, tracker.phases["optimizer1"].bytes)
            return Measurement(max_length=recipe.data.max_length, batch_size=recipe.train.batch_size,
                               process_peak_bytes=peak, phases=phases, trainable_parameters=n_trainable,
                               per_gpu_bytes=per_gpu[where], per_gpu_phase=where, state_per_gpu=state,
                               cuda_max_memory_allocated=cuda_peak,
                               extra={"precision": precision.name, "device": device,
                                      "loss_path": "fused" if tracker.ran("distill_rows") else "chunked",
                                      "largest_at_peak": tracker.largest(at_peak[where] - set().union(*categories.values()),
                                                                         LARGEST_GROUPS)})


def random_weights(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A real run's stand-in for a target tensor (embedding, ``lm_head``, final norm): N(0, 0.02^2)
    in ``dtype`` (the ``factory`` of :func:`offline_method`)."""
    return torch.randn(*shape).to(dtype) * 0.02


def prepare_model(method: Any, recipe: Any, precision: Precision, dev: torch.device, fake: bool = False,
                  ns_dtype: torch.dtype | None = torch.bfloat16
                  ) -> tuple[torch.nn.Module, list[torch.nn.Parameter], list[torch.optim.Optimizer]]:
    """The method's draft as the launcher trains it: built, moved to ``dev`` (real runs), its
    parameters in ``precision.param_dtype``, ``forward`` under bf16 autocast with accelerate's fp32
    output upcast (``amp-bf16``), the trainer's optimizers of ``train.optimizer`` (AdamW; AdamW
    and Muon), the method set up on one process, in train mode. ``ns_dtype``: Muon's
    Newton-Schulz dtype (default bf16, as on the recipes' GPUs, so that a fake and a real step
    measure the same temporaries whatever this CPU has; None: the trainer's detection). Returns
    ``(model, trainable, optimizers)``, the optimizers in the order the trainer steps them."""
    from draftsmith.train.activation_checkpointing import apply_recipe_checkpointing

    model = apply_recipe_checkpointing(method.build_model(), recipe.draft)  # as the trainer does
    if not fake:  # fake tensors are on the CPU already (a module of them cannot be moved)
        model.to(dev)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if precision.param_dtype != torch.float32:  # DeepSpeed casts the parameters (frozen too), not the buffers
        for p in model.parameters():
            p.data = p.data.to(precision.param_dtype)
    if precision.autocast:
        from types import MethodType

        from accelerate.utils import convert_outputs_to_fp32

        dtype = torch.bfloat16
        forward = model.forward.__func__
        auto = torch.autocast(device_type=dev.type, dtype=dtype)(forward)
        model.forward = MethodType(convert_outputs_to_fp32(auto), model)
    optimizers = _optimizers(model, trainable, recipe, dev, fake, ns_dtype)
    accelerator = OneProcess(dev)
    method.setup(accelerator)
    model.train()
    return model, trainable, optimizers


def _optimizers(model: torch.nn.Module, params: list[torch.nn.Parameter], recipe: Any, dev: torch.device,
                fake: bool, ns_dtype: torch.dtype | None = torch.bfloat16) -> list[torch.optim.Optimizer]:
    """The trainer's optimizers (:func:`draftsmith.train.components.optimizer.build_optimizers`: AdamW, fused
    where torch has the kernel; under ``train.optimizer: muon`` also torch's Muon over the hidden
    matrices) as they are built on the GPU the step stands for (a fake step: CUDA); the
    multi-tensor AdamW, CUDA's default, where the trainer has no builder; Muon's Newton-Schulz
    iterations in ``ns_dtype`` (:func:`prepare_model`)."""
    try:
        from draftsmith.train.components.optimizer import build_optimizers
    except ImportError:
        return [torch.optim.AdamW(params, lr=recipe.train.lr, betas=tuple(recipe.train.betas),
                                  weight_decay=recipe.train.weight_decay, foreach=True)]
    device = torch.device("cuda") if fake else dev
    try:
        return build_optimizers(model, recipe.train, device, ns_dtype=ns_dtype)
    except TypeError:  # a checkout before the Newton-Schulz dtype was a choice: torch's bf16
        return build_optimizers(model, recipe.train, device)


def _guard(optimizers: list[torch.optim.Optimizer], dev: torch.device) -> Any:
    """The trainer's :class:`~draftsmith.train.components.nonfinite.NonFiniteGuard` on ``optimizers`` (one
    process): what it keeps across steps (a non-fused optimizer's copies) is part of the
    measured optimizer state. None where the trainer has no guard."""
    try:
        from draftsmith.train.components.nonfinite import NonFiniteGuard
    except ImportError:
        return None
    return NonFiniteGuard(optimizers, dev, 1)


def gc_collect() -> None:
    import gc

    gc.collect()


def trainer_step(method: Any, model: torch.nn.Module, batch: dict[str, Any], trainable: list[torch.nn.Parameter],
                 optimizers: list[torch.optim.Optimizer], cfg: Any, dev: torch.device
                 ) -> tuple[Callable[[int], None], Callable[[], None], Any]:
    """``(forward_backward(i), update(), window)``: train/trainer.py's step, one process, no
    accumulation: the loss and backward of ``batch``, the clipped gradient norm and the
    non-finite guard's notes (metrics into ``window``, a
    :class:`~draftsmith.train.components.metrics.MetricWindow` read by the
    caller), then every optimizer's step (skipped on the device when not finite) and zero_grad.
    The benchmarks that time a step (``benchmarks.gpu``, ``benchmarks.muon``) call these two."""
    from draftsmith.train.components.metrics import MetricWindow
    from draftsmith.train.components.nonfinite import NonFiniteGuard

    guard, window = NonFiniteGuard(optimizers, dev, 1), MetricWindow(dev)

    def forward_backward(i: int) -> None:
        method.begin_step(i)
        loss, metrics = method.compute_loss(model, batch)
        guard.note_loss(loss)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
        guard.note_grad_norm(norm)
        window.add({**metrics, "grad_norm": norm})

    def update() -> None:
        for opt in optimizers:  # train.optimizer: AdamW, or AdamW then Muon
            opt.step()
        guard.end_step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)

    return forward_backward, update, window


def _device_batch(cpu_batch: dict[str, Any], plan: Any, dev: torch.device, tracker: MemoryTracker | None,
                  fake: bool) -> dict[str, Any]:
    """What the trainer hands ``compute_loss``: the collated batch with the method's plan
    applied on the host, moved to the device, plus ``num_tokens``. Under fake mode the small
    integer tensors stay real (their values decide shapes); the hidden states are fake."""
    batch = dict(cpu_batch)
    if plan is not None:
        with _disable_current_modes():
            real = {k: v for k, v in batch.items() if not _is_fake(v)}
            extra = plan(real)
        batch.update(extra)
    batch["num_tokens"] = int(cpu_batch["attention_mask"].sum())
    out = {}
    for k, v in batch.items():
        out[k] = v.to(dev) if isinstance(v, torch.Tensor) and not fake else v
    if tracker is not None:
        tracker.track({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
    return out


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _categories(tracker: MemoryTracker, model: torch.nn.Module, trainable: list[torch.Tensor],
                optimizers: list[Any], guard: Any, method: Any, batch: dict[str, Any]) -> dict[str, set[int]]:
    """Serials of the storages by role: trainable weights, gradients (of the measured step:
    the weights' ``.grad`` are set to None after it, so they are the storages that were grads at
    the peak only if still alive; see below), optimizer state (the guard's copies included),
    frozen buffers / weights and the method's own device tensors (teacher head), the batch."""

    def serials(tensors: Any) -> set[int]:
        return {s for s in (tracker.serial(t) for t in _tensors(tensors)) if s is not None}

    weights = serials(trainable)
    state = serials([v for opt in optimizers for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)] + (guard.copies() if guard is not None else []))
    frozen = serials([t for t in itertools.chain(model.parameters(), model.buffers())]) - weights
    frozen |= serials([v for k, v in vars(method).items() if k not in ("heads", "recipe", "paths", "accelerator")])
    data = serials(batch)
    return {"weights": weights, "gradients": tracker.grad_serials, "optimizer_state": state,
            "frozen": frozen, "batch": data}


# ---------------------------------------------------------------------------------------------
# the command line


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.recipe import add_recipe_arguments
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(prog="draftsmith bench memory", description=__doc__, formatter_class=HelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--target-config", type=Path,
                   help="the target's config.json (default: the copy under recipes/targets/, a local target "
                        "directory's, else the hub's; never weights)")
    p.add_argument("--batch-size", type=int, help="micro-batch B (default: train.batch_size)")
    p.add_argument("--max-length", type=int, nargs="+", metavar="T",
                   help="sequence lengths to measure (default: data.max_length)")
    p.add_argument("--launcher", type=Path, help="accelerate launcher YAML (default: the recipe's `launcher`)")
    p.add_argument("--device-memory-gib", type=float, default=80.0,
                   help="memory of one GPU of the launcher, GiB: each row says whether the step fits")
    p.add_argument("--device", choices=["fake", "cpu", "cuda"], default="fake",
                   help="fake: shapes only, any machine (FakeTensorMode); cpu / cuda: run the step for real")
    p.add_argument("--precision", choices=["auto", "fp32", "amp-bf16", "bf16"], default="auto",
                   help="auto: the launcher's (bf16 autocast; bf16 weights under DeepSpeed; fp32 without mixed precision)")
    p.add_argument("--lengths", default="full", metavar="full|default|RUN_DIR",
                   help="sequence lengths of the batch measured (benchmarks/lengths.py): full (default): every "
                        "position real, the upper bound a recipe must fit; default: the documented stand-in for "
                        "regenerated chat conversations; RUN_DIR: a prepared run's own. Not full: the batch the "
                        "trainer forms (packed rows under train.packing), with its useful (non-padding) tokens")
    p.add_argument("--json", action="store_true", help="one JSON object per sequence length")
    return p


def run(args: argparse.Namespace, recipe: Any) -> list[dict[str, Any]]:
    """Measure and estimate every requested length; rows as ``--json`` prints them.

    Raises:
        ValueError / FileNotFoundError: bad target config, length, batch size or launcher
            (one line naming the key).
    """
    from draftsmith.target import check_lengths, load_config_json, validate_geometry
    from draftsmith.train.dry_run import estimate_inputs, memory_estimate
    from draftsmith.train.launchers import draft_model_class, validate_launcher

    config_json, source = load_config_json(recipe, args.target_config)
    validate_geometry(config_json, source)
    B = args.batch_size or recipe.train.batch_size
    if B < 1:
        raise ValueError(f"--batch-size {B}: must be >= 1")
    lengths = args.max_length or [recipe.data.max_length]
    check_lengths(config_json, lengths, source, "--max-length" if args.max_length else "data.max_length")
    launcher = args.launcher or recipe.launcher
    launch = validate_launcher(recipe, launcher, draft_model_class(recipe.draft.method)) if launcher else None
    precision = Precision.of(launch, args.precision)
    from benchmarks.lengths import describe, lengths_for, row_length, trainer_rows
    from draftsmith.models.common import resolve_attention_backend

    rows = []
    for T in lengths:
        r = bench_recipe(recipe, B, T)
        docs, Tb = None, T
        drawn = lengths_for(getattr(args, "lengths", "full"), T, recipe.seed)
        if drawn is not None:  # the trainer's batch on the GPU (padded to its flex length bucket there)
            docs = trainer_rows(drawn, B, T, r.train.packing, r.train.pack_tokens, recipe.seed)
            flex = resolve_attention_backend(r.train.attention_backend, torch.device("cuda")) == "flex"
            Tb = row_length(docs, T, r.train.packing, r.train.pack_tokens, bucketed=flex)
        m = measure_step(r, config_json, launch, precision, args.device, rows=docs, length=Tb)
        est = memory_estimate(r, *estimate_inputs(r, config_json), launch, precision.name)
        rows.append({
            "recipe": recipe.name, "method": recipe.draft.method, "target": recipe.target.name_or_path,
            "target_config": str(source), "launcher": None if launch is None else str(launch.path),
            "precision": precision.name, "device": args.device,
            "max_length": T, "batch_size": B, "lengths": getattr(args, "lengths", "full"), "row_length": Tb,
            **describe(docs, B, Tb),
            "measured_bytes": m.per_gpu_bytes, "estimated_bytes": est["per_gpu_bytes"],
            "estimate_error": round(est["per_gpu_bytes"] / m.per_gpu_bytes - 1, 4),
            "process_peak_bytes": m.process_peak_bytes, "peak_phase": m.per_gpu_phase,
            "measured_phases": m.phases, "state_per_gpu": m.state_per_gpu,
            "estimate": est, "trainable_parameters": m.trainable_parameters,
            # the loss the step ran (the fused kernel's op seen) and the one the estimate counts
            "loss_path": m.extra["loss_path"],
            "estimated_loss_path": est["loss_path"],
            "cuda_max_memory_allocated": m.cuda_max_memory_allocated,
            "largest_at_peak": [{"bytes": b, "count": c, "what": w} for b, c, w in m.extra["largest_at_peak"]],
            "device_memory_bytes": int(args.device_memory_gib * GiB),
            "fits": m.per_gpu_bytes <= args.device_memory_gib * GiB,
        })
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    head = (f"{first['recipe']} ({first['method']}), target {first['target']} ({first['target_config']}), "
            f"launcher {first['launcher'] or 'none'}, precision {first['precision']}, device {first['device']}")
    cols = f"{'B':>3} {'T':>6} {'per GPU':>10} {'estimate':>10} {'est/meas':>8} {'process':>10} {'activ.':>9} " \
           f"{'state':>8} {'frozen':>8} {'batch':>8}  fits"
    if any(r["cuda_max_memory_allocated"] is not None for r in rows):
        cols += "  cuda max allocated"
    lines = [head, cols]
    for r in rows:
        ph = r["measured_phases"][r["peak_phase"]]
        g = lambda b: f"{b / GiB:.2f}G"  # noqa: E731
        line = (f"{r['batch_size']:>3} {r['max_length']:>6} {g(r['measured_bytes']):>10} {g(r['estimated_bytes']):>10} "
                f"{r['estimate_error']:>+8.1%} {g(r['process_peak_bytes']):>10} {g(ph['activations']):>9} "
                f"{g(r['state_per_gpu']['total']):>8} {g(ph['frozen']):>8} {g(ph['batch']):>8}  "
                f"{'yes' if r['fits'] else 'NO'}")
        if r["cuda_max_memory_allocated"] is not None:
            line += f"  {g(r['cuda_max_memory_allocated'])}"
        lines.append(line)
    for r in rows:
        if r["lengths"] != "full":
            lines.append(f"T={r['max_length']}: batch of --lengths {r['lengths']}: {r['batch_size']} rows of "
                         f"{r['row_length']} positions, {r['documents']} documents, {r['useful_tokens']:,} useful "
                         f"tokens ({100 * r['useful_fraction']:.0f}% of the positions)")
    lines.append("per GPU: measured activations + frozen buffers + batch of one process, plus the trainable state "
                 "as one rank of the launcher holds it (GiB = 2^30 bytes)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``draftsmith bench memory``; exit 0, 1 on a bad target config / length / launcher, 2 on a bad recipe."""
    from draftsmith.recipe import recipe_from_args
    from draftsmith.runtime import setup_logging
    from draftsmith.train.launchers import LauncherError

    args = build_parser().parse_args(argv)
    setup_logging()
    recipe = recipe_from_args(args)
    try:
        rows = run(args, recipe)
    except (ValueError, FileNotFoundError, LauncherError) as exc:
        print(f"draftsmith bench memory: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
