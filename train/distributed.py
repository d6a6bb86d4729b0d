"""The Accelerator of a training run, built from the launcher's environment and the recipe.

``accelerate launch --config_file X.yaml`` exports the launcher config as environment variables
(``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_MIXED_PRECISION``
...); torchrun exports ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``. :func:`build_accelerator`
turns them into one ``accelerate.Accelerator`` whose ``num_processes`` / ``process_index``
match the real process group, on GPUs and on the CPU lab alike:

- GPU: accelerate's own routing (NCCL, one device per ``LOCAL_RANK``); nothing is changed.
- CPU, DeepSpeed (``DS_ACCELERATOR=cpu``): accelerate 1.15 starts the process group through
  DeepSpeed but, finding no GPU backend, records ``num_processes == 1`` on every rank (so every
  rank believes it is the main process, writes the same files and sees all the data). Giving
  accelerate the ``gloo`` backend makes it read the real world size.
- CPU, FSDP: accelerate 1.15 selects FSDP only for GPU-like device types; on CPU it silently
  falls back to DDP (``MULTI_CPU``) or to independent single processes. FSDP2 itself
  (``fully_shard``) runs on CPU with gloo, so the state is set to FSDP and the same accelerate
  FSDP2 code path as on GPUs wraps, gathers and checkpoints the draft.

What the launcher asked for is then checked against what was built, and the DeepSpeed
micro-batch, accumulation and clipping are taken from the recipe
(:func:`draftsmith.train.launchers.check_runtime`).

GPU defaults set here (:func:`gpu_defaults`, :func:`distributed_kwargs`):

- TF32 matmuls and cuDNN convolutions on CUDA (fp32 work left outside bf16 autocast, e.g. the
  target head, runs on tensor cores).
- DDP: ``broadcast_buffers=False``. The drafts' buffers (the frozen target embedding, RoPE
  frequencies, the vocab maps) are built identically on every rank from the target and never
  change; the default would re-broadcast the multi-GB fp32 embedding at every synced forward.
- FSDP2 with ``mixed_precision: bf16``: ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=float32, output_dtype=bf16)``. accelerate 1.15 builds ``reduce_dtype=bf16``
  from the launcher (``set_mixed_precision``), i.e. gradients summed over ranks in bf16; an
  explicit policy is kept as given. The launcher YAML cannot express it, so it is passed as
  accelerate's ``FullyShardedDataParallelPlugin`` (the other ``FSDP_*`` settings still come
  from the launcher's environment).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..recipe import Recipe
from ..layout import RunLayout
from .launchers import check_runtime, requested_distributed_type

log = logging.getLogger("draftsmith.train")

TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


def runs_on_cpu() -> bool:
    """True when this process trains on CPU: ``ACCELERATE_USE_CPU`` or no accelerator at all."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.accelerator.is_available()


def cpu_mixed_precision() -> str | None:
    """``"no"`` when training runs on CPU, else None (the launcher config decides).

    Mixed precision comes from the accelerate launcher config (``mixed_precision: bf16`` ->
    ``ACCELERATE_MIXED_PRECISION``): bf16 autocast on GPU. On CPU bf16 autocast is slower
    than fp32 (docs/cpu_lab.md), so a CPU run stays fp32 whatever the config says.
    """
    if not runs_on_cpu():
        return None
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if asked != "no":
        log.info("training on CPU: fp32 (the launcher config asked for mixed_precision=%s)", asked)
    return "no"


def check_trackers(report_to: list[str]) -> None:
    """Refuse a tracker that is not installed (accelerate would drop it without a word).

    Raises:
        ValueError: naming ``train.report_to`` and the package to install.
    """
    for name in report_to:
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ValueError(f"train.report_to names {name!r}, but the {TRACKER_PACKAGES[name]!r} package is not "
                             f"installed: pip install 'draftsmith[{name}]' or remove it from train.report_to")


def gpu_defaults() -> None:
    """TF32 for fp32 matmuls / convolutions when training on CUDA (no effect on CPU)."""
    if runs_on_cpu() or not torch.cuda.is_available():
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def distributed_kwargs() -> dict[str, Any]:
    """``kwargs_handlers`` / ``fsdp_plugin`` arguments of the Accelerator (see the module docstring):
    DDP without buffer broadcasts, and under FSDP with bf16 an fp32 gradient reduction."""
    from accelerate.utils import DistributedDataParallelKwargs

    out: dict[str, Any] = {"kwargs_handlers": [DistributedDataParallelKwargs(broadcast_buffers=False)]}
    if requested_distributed_type() == "FSDP" and cpu_mixed_precision() is None \
            and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.bfloat16)
        out["fsdp_plugin"] = FullyShardedDataParallelPlugin(mixed_precision_policy=policy)
    return out


def process_group_kwargs(timeout_s: float | None, gloo: bool) -> Any | None:
    """accelerate's ``InitProcessGroupKwargs`` for the run; None when nothing differs from its defaults.

    ``gloo``: the CPU backend (see the module docstring). ``timeout_s``
    (``train.collective_timeout_s``): the process-group timeout, how long a rank waits in a
    collective for a peer that died or hangs before it fails (NCCL's watchdog, gloo's socket
    waits); accelerate passes it to ``init_process_group`` or DeepSpeed's ``init_distributed``.
    """
    from accelerate.utils import InitProcessGroupKwargs

    if timeout_s is None and not gloo:
        return None
    kwargs: dict[str, Any] = {"backend": "gloo"} if gloo else {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    return InitProcessGroupKwargs(**kwargs)


def set_default_collective_timeout(timeout_s: float | None) -> None:
    """Make ``timeout_s`` torch's default timeout of process groups created without one.

    The timeout given to ``init_process_group`` covers only the world group: a group made later
    by ``new_group()`` gets torch's default (NCCL 10 min, gloo 30 min), and DeepSpeed reduces
    ZeRO gradients over such a group (its clone of the world group), so a rank of a DeepSpeed run
    whose peer hangs would wait 30 min on CPU whatever the recipe says. accelerate also leaves out
    a timeout equal to its own default (600 s), which then falls back to this default.
    """
    if timeout_s is None:
        return
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:  # None without NCCL
        c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)


def build_accelerator(recipe: Recipe, run_dir: Path) -> Any:
    """The run's ``accelerate.Accelerator`` (see the module docstring).

    Trackers (``train.report_to``) log under ``RUN_DIR/logs``; gradient accumulation, the
    CPU fp32 rule and the GPU defaults (TF32, DDP/FSDP2 settings) are applied here. Call once per process, before anything else touches
    ``accelerate.PartialState``.

    Raises:
        ValueError: a tracker in ``train.report_to`` is not installed.
        LauncherError: the launcher asked for what was not built, or contradicts the recipe.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, ProjectConfiguration

    cfg = recipe.train
    check_trackers(cfg.report_to)
    asked = requested_distributed_type()
    gpu_defaults()
    extra = distributed_kwargs()
    handlers = extra.pop("kwargs_handlers")
    gloo = bool(asked) and runs_on_cpu() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    set_default_collective_timeout(cfg.collective_timeout_s)
    pg = process_group_kwargs(cfg.collective_timeout_s, gloo)
    if pg is not None:
        handlers.append(pg)
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.grad_accum_steps,
        log_with=list(cfg.report_to) or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(RunLayout(run_dir).logs)),
        # the schedule counts optimizer steps; accelerate's default would step it once per process
        step_scheduler_with_optimizer=False,
        mixed_precision=cpu_mixed_precision(),
        kwargs_handlers=handlers,
        **extra,
    )
    if asked == "FSDP" and runs_on_cpu() and accelerator.distributed_type != DistributedType.FSDP:
        _route_fsdp_on_cpu(accelerator, extra.get("fsdp_plugin"))
    check_runtime(accelerator, recipe)
    if accelerator.is_main_process:
        note_recipe_launcher(recipe, accelerator)
    return accelerator


def uses_deepspeed(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs under DeepSpeed, whose engine clips and steps the optimizer
    inside ``accelerator.backward`` (the one backend the training loop branches on)."""
    return accelerator.distributed_type.value == "DEEPSPEED"


def full_tensor(x: Any) -> Any:
    """A plain tensor from a grad-norm DTensor (FSDP2; a collective, not a host read)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def note_recipe_launcher(recipe: Recipe, accelerator: Any) -> None:
    """Log a warning when the recipe names a launcher (``launcher:``) that this run does not use,
    with the command that would: ``accelerate launch`` without ``--config_file`` reads accelerate's
    default config (one process when there is none)."""
    from .launchers import LauncherConfig, resolve_launcher_path

    if not recipe.launcher:
        return
    try:
        want = LauncherConfig.from_yaml(resolve_launcher_path(recipe.launcher))
    except (OSError, ValueError):
        return  # the dry run reports an unreadable launcher; training goes on as launched
    got = accelerator.distributed_type.value
    same_type = want.distributed_type == got or (want.distributed_type in ("NO", "MULTI_GPU") and got in ("NO", "MULTI_GPU", "MULTI_CPU"))
    if not same_type or (want.num_processes and want.num_processes != accelerator.num_processes):
        log.warning("the recipe was tuned for %s (%s, %s processes) but this run is %s with %d process(es); to use it: "
                    "accelerate launch --config_file %s train/%s.py RECIPE", recipe.launcher, want.distributed_type,
                    want.num_processes, got, accelerator.num_processes, recipe.launcher, recipe.draft.method)


def _route_fsdp_on_cpu(accelerator: Any, plugin: Any = None) -> None:
    """Make accelerate 1.15 run FSDP2 on CPU (gloo): set the shared state's distributed type to
    FSDP with ``plugin`` (the one :func:`distributed_kwargs` passed the Accelerator, which
    accelerate drops when it does not choose FSDP) or one built from the launcher's ``FSDP_*``
    environment, given the Accelerator's mixed precision as accelerate gives it on a GPU (an
    explicit ``MixedPrecisionPolicy`` kept). The process count is already right (gloo handler or
    MULTI_CPU); ``check_runtime`` then refuses FSDP1."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    plugin = getattr(accelerator.state, "fsdp_plugin", None) or plugin or FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":  # fp32 on a CPU run (cpu_mixed_precision): nothing to set
        plugin.set_mixed_precision(accelerator.mixed_precision)
    log.info("FSDP on CPU: accelerate chose %s; routing to FSDP2 over gloo", accelerator.distributed_type.value)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
