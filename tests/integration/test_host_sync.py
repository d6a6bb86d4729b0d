"""No host sync in a training step that neither logs nor checkpoints.

A host sync (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, a boolean-mask
index, ``nonzero``, ``unique``, a device-to-host copy ...) makes the CPU wait until the GPU has
drained its queue; with a one-layer draft (thousands of small kernels per step) that exposes the
CPU's launch latency at every sync. The trainer reads the device only at logging steps
(``train.log_every`` and the last step), checkpoint steps and validations (see
``train/trainer.py``), in code it marks with ``host_work``.

The real trainer (``fit``) runs ``2 * log_every`` optimizer steps of a tiny draft on the CPU,
with gradient accumulation and a checkpoint step between the logging steps, under a
``TorchFunctionMode`` (python-level reads: ``item``, ``tolist``, ``__bool__``, ``__float__``,
``__int__``, ``__index__``, ``cpu``, ``numpy``) and a ``TorchDispatchMode`` (aten ops that read
the device: ``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``unique*``, ``is_nonzero``,
``equal``, ``allclose``, ``bincount``, ``repeat_interleave`` without ``output_size``, boolean-mask
``index`` / ``index_put_``, device-to-host copies). Each event is attributed to the step whose
micro-batch was running (``method.begin_step``) and to the ``host_work`` region around it
(``trainer.host_work`` is replaced by a recorder). Allowed: everything before the first
micro-batch (setup), ``host_work("data")`` (the DataLoader's CPU batches: the sampler and the
collate function, where ``num_tokens`` and the method's ``batch_plan`` are computed on CPU
tensors), and ``log`` / ``checkpoint`` / ``validation`` regions at exactly their scheduled steps.
``eagle3_muon`` (``train.optimizer: muon``) runs the non-finite guard's skip for an optimizer
without a fused kernel (``torch.optim.Muon``), which restores on the device instead of reading a flag.
DeepSpeed's own ``engine.step`` (e.g. its clipping and fp32 overflow check) syncs inside
DeepSpeed; it is not run here.

On the CPU every tensor is on the host, so the events are counted by what the code asks for, not
by device: a ``.cpu()`` or ``bool()`` of a tensor counts even though it costs nothing here.

Methods whose loss still syncs are ``xfail(strict=True)``: the failure message lists every
sync left (op, file:line); the mark must go when the method is converted (a pass then fails).
"""

from __future__ import annotations

import contextlib
import shutil
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.train import trainer as trainer_module

from helpers.recipes import tiny_recipe

pytestmark = pytest.mark.integration  # prepares the tiny target's data and trains it

REPO = Path(__file__).resolve().parents[2]

# 6 optimizer steps of 2 micro-batches: logging at 3 and 6, a checkpoint at 4 (and the final one
# at 6); steps 1, 2 and 5 must not sync
LOG_EVERY, MAX_STEPS, CHECKPOINT_EVERY = 3, 6, 4
TRAIN = {"log_every": LOG_EVERY, "max_steps": MAX_STEPS, "checkpoint_every": CHECKPOINT_EVERY, "batch_size": 2,
         "grad_accum_steps": 2, "keep_checkpoints": 3, "warmup_ratio": 0.0}

FUNCTION_SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}
DISPATCH_SYNCS = {"_local_scalar_dense", "nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique",
                  "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                  "is_nonzero", "equal", "allclose", "bincount"}


_RECORDER_FRAMES = {"_where", "record", "__torch_function__", "__torch_dispatch__"}


def _where() -> str:
    """``file:line (function)`` of the innermost repository frame that is not the recorder's."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if REPO in path.parents and not {".venv", "site-packages"} & set(path.parts) \
                and not (path.name == "test_host_sync.py" and frame.name in _RECORDER_FRAMES):
            return f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return "outside the repository"


class SyncRecorder:
    """Where host syncs happen: the current step and ``host_work`` region of each event."""

    def __init__(self) -> None:
        self.step: int | None = None  # the optimizer step the running micro-batch belongs to
        self.regions: list[tuple[str, int | None]] = []
        self.region_log: list[tuple[str, int | None]] = []
        self.events: list[tuple[int | None, tuple[str, int | None] | None, str, str]] = []

    @contextlib.contextmanager
    def host_work(self, kind: str, step: int | None = None):
        self.regions.append((kind, step))
        self.region_log.append((kind, step))
        try:
            yield
        finally:
            self.regions.pop()

    def record(self, what: str) -> None:
        region = self.regions[-1] if self.regions else None
        self.events.append((self.step, region, what, _where()))

    def violations(self) -> list[str]:
        return [f"step {step}: {what} at {where}" for step, region, what, where in self.events
                if step is not None and (region is None or region[0] not in ("data", "log", "checkpoint", "validation"))]


class FunctionSyncs(TorchFunctionMode):
    def __init__(self, recorder: SyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in FUNCTION_SYNCS and args and isinstance(args[0], torch.Tensor):
            self.recorder.record(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class DispatchSyncs(TorchDispatchMode):
    def __init__(self, recorder: SyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        what = None
        if name in DISPATCH_SYNCS:
            what = f"aten.{name}"
        elif name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") \
                and kwargs.get("output_size", args[3] if len(args) > 3 else None) is None:
            what = "aten.repeat_interleave with tensor repeats and no output_size"
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _is_bool_index(args[1] if len(args) > 1 else None):
            what = f"aten.{name} with a boolean mask (nonzero)"
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None \
                    and torch.device(dst_device).type == "cpu":
                what = f"device-to-host {name}"
        if what is not None:
            self.recorder.record(what)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def prepared_data(prepared_run) -> tuple[Path, Path]:
    """``(prompts, run dir)`` of the session's prepared tiny run (its data is copied, not written)."""
    _, run, _ = prepared_run
    return run / "prompts.jsonl", run


def _method(name: str, tiny_target: Path, prompts: Path, run: Path):
    from draftsmith.models.dflash.recipe import DFlashDraftConfig
    from draftsmith.models.medusa.recipe import MedusaDraftConfig
    from draftsmith.models.mlp_speculator.recipe import MLPSpeculatorDraftConfig
    from draftsmith.models.peagle.recipe import PEagleDraftConfig

    recipe = tiny_recipe(tiny_target, prompts, **TRAIN)
    if name == "eagle3_packed":
        recipe.train.packing = True
    if name == "eagle3_muon":
        recipe.train.optimizer = "muon"
    if name.startswith("eagle3"):
        from draftsmith.models.eagle3.training import Eagle3Method as cls
    elif name == "dflash":
        from draftsmith.models.dflash.training import DFlashMethod as cls

        recipe.draft = DFlashDraftConfig(num_layers=1, block_size=4, num_anchors=16, freeze_lm_head=False)
    elif name == "peagle":
        from draftsmith.models.peagle.training import PEagleMethod as cls

        recipe.draft = PEagleDraftConfig(num_layers=1, num_depths=3)
    elif name == "medusa":
        from draftsmith.models.medusa.training import MedusaMethod as cls

        recipe.draft = MedusaDraftConfig(num_heads=2, num_layers=1)
    else:
        from draftsmith.models.mlp_speculator.training import MLPSpeculatorMethod as cls

        recipe.draft = MLPSpeculatorDraftConfig(n_predict=2, inner_dim=64)
    return recipe, cls(recipe, run)


# a method whose loss still syncs would be listed as
#   pytest.param("name", marks=pytest.mark.xfail(strict=True, reason="what syncs, who converts it"))
# so that its conversion flips the test (strict: an unexpected pass fails until the mark goes)
METHODS = ["eagle3", "eagle3_packed", "eagle3_muon", "dflash", "peagle", "medusa", "mlp_speculator"]


def counted_fit(recipe, method, run: Path, monkeypatch) -> SyncRecorder:
    """``fit`` under the recorder; checks the step count and where the allowed regions ran."""
    from draftsmith.train.trainer import fit

    recorder = SyncRecorder()
    monkeypatch.setattr(trainer_module, "host_work", recorder.host_work)
    begin_step = method.begin_step

    def counting_begin_step(step: int) -> None:
        recorder.step = step + 1
        begin_step(step)

    monkeypatch.setattr(method, "begin_step", counting_begin_step)
    with FunctionSyncs(recorder), DispatchSyncs(recorder):
        result = fit(recipe, method, run, progress=False)
    assert result.steps == MAX_STEPS

    # the allowed regions happen at their steps only
    logged = sorted({s for kind, s in recorder.region_log if kind == "log"})
    saved = sorted({s for kind, s in recorder.region_log if kind == "checkpoint"})
    assert logged == list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY)), logged
    assert saved == [CHECKPOINT_EVERY, MAX_STEPS], saved
    assert any(step is not None and region and region[0] == "log" for step, region, _, _ in recorder.events), \
        "no sync recorded at a logging step: the recorder does not see the trainer's reads"
    return recorder


@pytest.mark.parametrize("name", METHODS)
def test_no_host_sync_outside_logging_and_checkpoint_steps(name, prepared_data, tiny_target, tmp_path, monkeypatch):
    prompts, prepared = prepared_data
    run = tmp_path / "run"
    shutil.copytree(prepared / "data", run / "data")
    recipe, method = _method(name, tiny_target, prompts, run)
    recorder = counted_fit(recipe, method, run, monkeypatch)
    bad = recorder.violations()
    summary = Counter(v.split(": ", 1)[1] for v in bad)
    assert not bad, f"{len(bad)} host syncs outside logging/checkpoint steps:\n" + "\n".join(
        f"{n:4d} x {what}" for what, n in summary.most_common())


def test_the_recorder_sees_the_syncs_a_loss_can_make(prepared_data, tiny_target, tmp_path, monkeypatch):
    """Control: an EAGLE-3 loss with the syncs the step contract forbids is caught, at its line."""
    prompts, prepared = prepared_data
    run = tmp_path / "run"
    shutil.copytree(prepared / "data", run / "data")
    recipe, method = _method("eagle3", tiny_target, prompts, run)
    inner = method.compute_loss

    def syncing_loss(model, batch):
        loss, metrics = inner(model, batch)
        mask = batch["loss_mask"].bool()
        metrics = dict(metrics, loss=float(loss.detach()),  # a float() of the loss
                       picked=batch["input_ids"][mask].float().mean(),  # boolean-mask indexing
                       tokens=sum(batch["attention_mask"].sum(1).tolist()))  # a .tolist()
        return loss, metrics

    monkeypatch.setattr(method, "compute_loss", syncing_loss)
    recorder = counted_fit(recipe, method, run, monkeypatch)
    found = {v.split(": ", 1)[1] for v in recorder.violations()}
    here = Path(__file__).name
    for what in ("Tensor.__float__", "aten.index with a boolean mask (nonzero)", "Tensor.tolist"):
        assert any(f.startswith(what) and here in f for f in found), (what, found)
    # every plain step (1, 2, 5) and every micro-batch of it
    steps = {step for step, region, _, _ in recorder.events if region is None and step is not None}
    assert {1, 2, 5} <= steps
