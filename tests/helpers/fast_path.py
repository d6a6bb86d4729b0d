"""Evidence that the GPU step's fast paths ran, not just that a step gave the right numbers.

Where the fused loss cannot run (``fused_loss_available`` false, or a head that is not
``lm_head(norm(h))``), ``chunked_distill`` warns once per reason and takes the chunked torch path
(train/losses.py, ``_use_fused``), so a fused-vs-chunked comparison can compare torch with torch;
and ``compile_regions`` only wraps the regions in ``torch.compile``. So the GPU tests check:

- :func:`fast_path`: while active, how often the torch op ``draftsmith::distill_rows`` was
  dispatched (:class:`OpCounter`, a dispatch mode) and its row kernel launched
  (:class:`benchmarks.gpu.FusedLossCount`), and every ``train.fused_loss`` fallback warning (the
  once-per-reason memory of those warnings is emptied for the duration, so a fallback warns
  again). :meth:`FastPath.assert_fused` fails on no dispatch, no launch or a fallback warning.
- :func:`dynamo_frames`: the frames and graphs torch._dynamo compiled while active;
  :func:`benchmarks.gpu.compiled_regions`: the ``torch.compile``'d regions a model holds, and how
  many of them dynamo compiled code for.

The counting works wherever the op runs: CUDA, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``; tests/unit/test_bench_gpu.py proves the helper there, counting 0 on the
chunked path and every chunk on the forced fused path).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu import FUSED_OP, FusedLossCount, compiled_regions  # noqa: F401 - re-exported

FALLBACK = "train.fused_loss"  # how losses._use_fused's fallback warning starts


class OpCounter(TorchDispatchMode):
    """Counts every op the dispatcher runs while active, by qualified name (``aten::mm``,
    ``draftsmith::distill_rows``). It ignores torch.compile's internals
    (``ignore_compile_internals``): compiled regions are still compiled under it (a plain dispatch
    mode makes dynamo skip every frame) and their fused kernels are not counted as ops."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[getattr(getattr(func, "_schema", None), "name", str(func))] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class FastPath:
    """What :func:`fast_path` saw: dispatches of ``draftsmith::distill_rows`` (None when not
    counted), launches of its row kernel, and the ``train.fused_loss`` fallback warnings."""

    dispatched: int | None = None
    launched: int = 0
    fallbacks: list[str] = field(default_factory=list)

    def assert_fused(self, dispatches: int | None = None) -> None:
        """The fused loss ran: its op dispatched (``dispatches`` times when given), its kernel
        launched once per dispatch, and no call fell back to the chunked loss."""
        assert not self.fallbacks, f"the fused loss fell back to the chunked loss: {self.fallbacks}"
        assert self.launched > 0, f"{FUSED_OP} never launched its kernel (the chunked torch path ran)"
        if self.dispatched is not None:
            assert self.dispatched == self.launched, (self.dispatched, self.launched)
        if dispatches is not None:
            assert self.launched == dispatches, f"{FUSED_OP}: {self.launched} launches, {dispatches} expected"

    def assert_chunked(self) -> None:
        """Only the chunked torch path ran: the op was neither dispatched nor launched."""
        assert self.launched == 0 and not self.dispatched, (self.dispatched, self.launched)


@contextlib.contextmanager
def _fresh_fallback_memory() -> Iterator[None]:
    """losses warns once per reason (``_fused_warned``): empty that memory while active, so a
    fallback that already warned in this process warns again."""
    from draftsmith.train import losses

    saved = getattr(losses, "_fused_warned", None)
    if isinstance(saved, set):
        losses._fused_warned = set()
    try:
        yield
    finally:
        if isinstance(saved, set):
            losses._fused_warned = saved


@contextlib.contextmanager
def fast_path(dispatch: bool = True) -> Iterator[FastPath]:
    """Record the fused loss's dispatches (with ``dispatch``: a dispatch mode over every op, for
    tests; without: the kernel's launches only, nothing per op), launches and fallback warnings
    while active; the record is filled when the block exits."""
    record = FastPath()
    counter = OpCounter() if dispatch else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fresh_fallback_memory())
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        launches = stack.enter_context(FusedLossCount())
        if counter is not None:
            stack.enter_context(counter)
        try:
            yield record
        finally:
            record.launched = launches.launches
            record.dispatched = None if counter is None else counter.counts[FUSED_OP]
            record.fallbacks = [str(w.message) for w in caught if str(w.message).startswith(FALLBACK)]


@dataclass
class DynamoFrames:
    """Frames torch._dynamo compiled (``frames ok``) and graphs it made (``unique_graphs``) while
    :func:`dynamo_frames` was active."""

    frames: int = 0
    graphs: int = 0


@contextlib.contextmanager
def dynamo_frames() -> Iterator[DynamoFrames]:
    from torch._dynamo.utils import counters

    record = DynamoFrames()
    frames, graphs = counters["frames"]["ok"], counters["stats"]["unique_graphs"]
    try:
        yield record
    finally:
        record.frames = counters["frames"]["ok"] - frames
        record.graphs = counters["stats"]["unique_graphs"] - graphs


@contextlib.contextmanager
def eager_compile() -> Iterator[None]:
    """``torch.compile`` with dynamo's ``eager`` backend while active: a CPU test's regions are
    traced by dynamo and hold compiled code, without inductor's minutes of C++ compilation."""
    import functools

    import torch

    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="eager")
    try:
        yield
    finally:
        torch.compile = compile_
