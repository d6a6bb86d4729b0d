"""``draftsmith bench memory``: the training memory of a recipe's draft, measured by running it.

    draftsmith bench memory RECIPE.yaml [--target-config config.json] [--batch-size B]
        [--max-length T [T ...]] [--device-memory-gib G] [--launcher L.yaml] [--json]

The recipe's method builds its real draft model at the target's true geometry (the target's
``config.json``: ``--target-config``, else the copy shipped under ``recipes/targets/``, see
:func:`draftsmith.train.dry_run.bundled_target_config`) with random weights, and trains it on a
random batch shaped like the method's real one (``input_ids``, ``loss_mask``,
``attention_mask``, the aux / final hidden states in ``data.hidden_states_dtype``, position /
document ids under ``train.packing``) through its real ``compute_loss``: forward, loss,
backward, gradient clipping and an AdamW step, on the launcher's precision path (bf16 autocast
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

Two optimizer steps run; the second is measured, so the AdamW state exists as it does at every
step of a run. The step is measured in one process; the per-GPU figure applies the launcher's
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
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

GiB = 1024**3
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# the tracker


@dataclass
class PhasePeak:
    """The peak of one phase: bytes and the storages (serials) live at that moment."""

    bytes: int = 0
    serials: frozenset[int] = frozenset()


class MemoryTracker(TorchDispatchMode):
    """Live bytes of the storages the dispatched ops create, and their peak.

    Every tensor an op returns has its storage registered once (a view's storage is its base's:
    not counted again) with a weak reference; the bytes are released when the storage is
    freed (its last tensor, including one autograd saved, is gone). :meth:`track` registers
    tensors created outside the mode; :meth:`exclude` takes storages out of the count (host
    tensors). :meth:`phase` keeps the peak of a code region with the storages live at it.

    Under ``fake`` (a :class:`FakeTensorMode` entered *before* this mode), ops whose tensor
    inputs are all real run for real (integer / bool factories, and any factory given a
    ``generator``, too): index and mask tensors computed from a real batch keep their values, so
    boolean indexing, ``nonzero`` and host reads on them work; a boolean index over fake data
    is applied as if every element were True, and a scalar read from a fake tensor is 1.
    """

    def __init__(self, fake: Any | None = None):
        super().__init__()
        self.fake = fake
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> serial
        self._bytes: dict[int, int] = {}  # live serial -> bytes
        self._size: dict[int, int] = {}  # every serial -> bytes (peaks are broken down after the fact)
        self.grad_serials: set[int] = set()
        self._excluded: set[int] = set()
        self._serials = itertools.count()
        self.current = 0
        self.peak = 0
        self._phases: dict[str, PhasePeak] = {}
        self._open: list[str] = []

    # -- accounting
    def _register(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided:
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
        self.current += n
        weakref.finalize(st, self._release, serial)
        self._update_peak()

    def _release(self, serial: int) -> None:
        n = self._bytes.pop(serial, 0)
        if serial in self._excluded:
            self._excluded.discard(serial)
        else:
            self.current -= n

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
        for name in self._open:
            ph = self._phases[name]
            if self.current > ph.bytes:
                ph.bytes = self.current
                ph.serials = frozenset(s for s in self._bytes if s not in self._excluded)

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
        ph = self._phases[name] = PhasePeak(self.current, frozenset(s for s in self._bytes if s not in self._excluded))
        self._open.append(name)
        try:
            yield ph
        finally:
            self._open.remove(name)

    @property
    def phases(self) -> dict[str, PhasePeak]:
        return self._phases

    # -- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs) if self.fake is not None else func(*args, **kwargs)
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
    def breakdown(self, name: str, categories: dict[str, set[int]]) -> dict[str, int]:
        """Bytes of phase ``name``'s peak by category (``categories``: name -> serials); the rest
        is ``"activations"``."""
        ph = self._phases[name]
        out, seen = {}, set()
        for cat, serials in categories.items():
            mine = (ph.serials & serials) - seen
            seen |= mine
            out[cat] = self._bytes_at_peak(mine)
        out["activations"] = ph.bytes - sum(out.values())
        return out

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
    from ..data_prep.target import text_config

    text = text_config(config)
    return {"hidden_size": int(text.hidden_size), "vocab_size": int(text.vocab_size),
            "num_hidden_layers": int(text.num_hidden_layers)}


@contextlib.contextmanager
def offline_method(recipe: Any, config_json: dict[str, Any], head_dtype: torch.dtype,
                   factory: Any = torch.empty) -> Iterator[Any]:
    """The recipe's training method (``train/method_<name>.py``) constructed as a prepared run
    would construct it, from a temporary run directory holding only ``target.json`` and the
    target's ``config.json``: the target's embedding / ``lm_head`` / final norm come from
    ``factory`` (shape, dtype; random or fake), the draft vocab is the first
    ``data.draft_vocab_size`` target ids, the mask token the last id. The directory is removed
    on exit."""
    from unittest import mock

    from ..data_prep.target import default_aux_layer_ids
    from ..layout import RunLayout
    from ..methods import get_method
    from ..train import method_base
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
        ids = list(recipe.data.aux_layer_ids or default_aux_layer_ids(n))
        data.target_info.write_text(json.dumps({
            "name_or_path": recipe.target.name_or_path, "verifier": recipe.target.name_or_path,
            "path": str(target_dir), "architectures": list(getattr(config, "architectures", None) or []),
            "num_hidden_layers": n, "hidden_size": H, "vocab_size": V, "aux_layer_ids": ids}))
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
            patches.append(mock.patch.object(method_base.DraftVocabMethod, "mask_token_id", lambda self: mask_id))
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            method = get_method(recipe.draft.method).training_method(recipe, tmp / "run")
        yield method
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_recipe(recipe: Any, batch_size: int, max_length: int) -> Any:
    """A copy of ``recipe`` at ``batch_size x max_length`` that trains offline from step 0
    (no warm start, stage 1 of the MLP speculator, no validation)."""
    r = recipe.model_copy(deep=True)
    r.train.batch_size = batch_size
    r.data.max_length = max_length
    r.data.hidden_states_mode = "offline"
    r.data.validation_fraction = None if hasattr(r.data, "validation_fraction") else None
    for key, value in (("init_from", None), ("stage2_start_step", None)):
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


def random_batch(recipe: Any, H: int, V: int, n_aux: int, device: torch.device, fake: bool,
                 seed: int = 0) -> dict[str, Any]:
    """A batch shaped like the method's real one: every position real and trained (the memory
    upper bound), hidden states in ``data.hidden_states_dtype`` (fake under ``fake``)."""
    B, T = recipe.train.batch_size, recipe.data.max_length
    g = torch.Generator().manual_seed(seed)
    batch: dict[str, Any] = {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": torch.ones(B, T, dtype=torch.long),
    }
    if getattr(recipe.train, "packing", False):  # two documents per row
        half = T // 2
        pos = torch.arange(T)
        batch["position_ids"] = torch.where(pos < half, pos, pos - half).expand(B, T).clone()
        batch["document_ids"] = (pos >= half).long().expand(B, T).clone()
    batch["attention_mask"] = torch.ones(B, T, dtype=torch.long)
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
                 precision: Precision | None = None, device: str = "fake", seed: int = 0) -> Measurement:
    """Build the recipe's draft and run two training steps of its method on a random batch;
    the second is measured (see the module docstring).

    Args:
        recipe: at the wanted ``train.batch_size`` / ``data.max_length`` (:func:`bench_recipe`).
        config_json: the target's ``config.json`` contents.
        launch: the validated launcher (:class:`~draftsmith.train.launchers.LauncherReport`) or None.
        device: ``"fake"`` (shapes only, see :class:`MemoryTracker`), ``"cpu"`` or ``"cuda"``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..train.dry_run import state_bytes_per_gpu

    precision = precision or Precision.of(launch)
    fake = device == "fake"
    dev = torch.device("cpu" if fake else device)
    torch.manual_seed(seed)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    tracker = MemoryTracker(fake=fake_mode)
    ctx = contextlib.ExitStack()
    with ctx:
        if fake_mode is not None:
            ctx.enter_context(fake_mode)
        ctx.enter_context(tracker)
        if fake and precision.autocast:
            ctx.enter_context(cuda_autocast_policy())
        head_dtype = getattr(torch, recipe.target.dtype)
        factory = torch.empty if fake else (lambda *s, dtype: torch.randn(*s).to(dtype) * 0.02)
        with offline_method(recipe, config_json, head_dtype, factory) as method:
            geo = {"H": int(method.target_info["hidden_size"]), "V": int(method.target_info["vocab_size"])}
            n_aux = len(method.target_info["aux_layer_ids"])
            tracker.exclude(getattr(method, "heads", {}))  # host RAM in a run (moved lazily, if ever)
            model = method.build_model()
            model.to(dev)
            trainable = [p for p in model.parameters() if p.requires_grad]
            if precision.param_dtype != torch.float32:  # DeepSpeed casts the parameters, not the buffers
                for p in trainable:
                    p.data = p.data.to(precision.param_dtype)
            if precision.autocast:
                from types import MethodType

                from accelerate.utils import convert_outputs_to_fp32

                dtype = torch.bfloat16
                forward = model.forward.__func__
                auto = torch.autocast(device_type=dev.type, dtype=dtype)(forward)
                model.forward = MethodType(convert_outputs_to_fp32(auto), model)
            opt = torch.optim.AdamW(trainable, lr=1e-4, betas=tuple(recipe.train.betas),
                                    weight_decay=recipe.train.weight_decay, foreach=True)
            accelerator = OneProcess(dev)
            method.setup(accelerator)
            model.train()
            cpu_batch = random_batch(recipe, geo["H"], geo["V"], n_aux, dev, fake, seed)
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
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if measured and dev.type == "cuda":
                    torch.cuda.synchronize()
                    cuda_peak = int(torch.cuda.max_memory_allocated(dev))
            categories = _categories(tracker, model, trainable, opt, method, batch)
            n_trainable = sum(p.numel() for p in trainable)
            state = state_bytes_per_gpu(n_trainable, launch, precision.name)
            phases, per_gpu = {}, {}
            for name in ("forward_backward", "optimizer"):
                bd = tracker.breakdown(f"{name}1", categories)
                bd["total"] = tracker.phases[f"{name}1"].bytes
                phases[name] = bd
                held = bd["weights"] + bd["gradients"] + bd["optimizer_state"]
                rest = bd["total"] - held
                if name == "optimizer" and state["optimizer_shards"] > 1:
                    rest -= bd["activations"] - bd["activations"] // state["optimizer_shards"]
                per_gpu[name] = rest + state["total"]
            where = max(per_gpu, key=per_gpu.get)
            peak = max(tracker.phases["forward_backward1"].bytes, tracker.phases["optimizer1"].bytes)
            return Measurement(max_length=recipe.data.max_length, batch_size=recipe.train.batch_size,
                               process_peak_bytes=peak, phases=phases, trainable_parameters=n_trainable,
                               per_gpu_bytes=per_gpu[where], per_gpu_phase=where, state_per_gpu=state,
                               cuda_max_memory_allocated=cuda_peak,
                               extra={"precision": precision.name, "device": device})


def gc_collect() -> None:
    import gc

    gc.collect()


def _device_batch(cpu_batch: dict[str, Any], plan: Any, dev: torch.device, tracker: MemoryTracker,
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
    tracker.track({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
    return out


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _categories(tracker: MemoryTracker, model: torch.nn.Module, trainable: list[torch.Tensor], opt: Any,
                method: Any, batch: dict[str, Any]) -> dict[str, set[int]]:
    """Serials of the storages by role: trainable weights, gradients (of the measured step:
    the weights' ``.grad`` are set to None after it, so they are the storages that were grads at
    the peak only if still alive; see below), optimizer state, frozen buffers / weights and the
    method's own device tensors (teacher head), the batch."""

    def serials(tensors: Any) -> set[int]:
        return {s for s in (tracker.serial(t) for t in _tensors(tensors)) if s is not None}

    weights = serials(trainable)
    state = serials([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
    frozen = serials([t for t in itertools.chain(model.parameters(), model.buffers())]) - weights
    frozen |= serials([v for k, v in vars(method).items() if k not in ("heads", "recipe", "paths", "accelerator")])
    data = serials(batch)
    return {"weights": weights, "gradients": tracker.grad_serials, "optimizer_state": state,
            "frozen": frozen, "batch": data}
