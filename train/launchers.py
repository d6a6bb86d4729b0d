"""accelerate launcher configs, checked against a recipe and its draft model.

A launcher config is the YAML ``accelerate launch --config_file`` reads (the ``accelerate
config`` format of accelerate 1.15: top-level ``distributed_type``, ``num_processes``,
``num_machines``, ``mixed_precision``, ``use_cpu``, and the ``deepspeed_config`` /
``fsdp_config`` sections). The recipe's ``launcher`` field names the one it is run with
(``recipes/accelerate/*.yaml``); ``--dry-run`` validates that pair with
:func:`validate_launcher` before any GPU is booked.

What draftsmith supports, and why:

- ``distributed_type``: ``NO``, ``MULTI_GPU``, ``MULTI_CPU`` (plain data parallel),
  ``DEEPSPEED`` (ZeRO stage 0-2), ``FSDP`` (``fsdp_version: 2`` only). FSDP1 is refused:
  accelerate picks it when ``fsdp_version`` is missing, and its flat parameters cannot hold
  the frozen ``lm_head`` of ``draft.freeze_lm_head`` in a unit with trainable weights
  without ``use_orig_params``; draftsmith's FSDP path is FSDP2's per-parameter sharding.
  ZeRO-3 is refused: a draft is small (its weights are 4 of the 16 bytes/parameter of AdamW
  training; ZeRO-2 already shards the other 12), the frozen target embedding inside the
  EAGLE-3 draft is a buffer that ZeRO-3 does not shard anyway, and exporting a ZeRO-3
  checkpoint needs a gather step draftsmith does not run.
- FSDP wrap units come from the model's ``_no_split_modules`` (the transformers convention,
  which accelerate's ``TRANSFORMER_BASED_WRAP`` uses when the launcher names no class), so
  one launcher file serves every draft method. A launcher that names
  ``fsdp_transformer_layer_cls_to_wrap`` must name blocks the model declares.
- Gradient clipping comes from the recipe's ``train.max_grad_norm``: a DeepSpeed
  ``gradient_clipping`` (or ``gradient_accumulation_steps``) that says otherwise is refused
  instead of silently winning. FSDP and DDP have no clipping key: the trainer clips with
  ``train.max_grad_norm``.
- ``mixed_precision``: ``no`` or ``bf16``. The draft trains in bf16 on GPU (fp32 on CPU);
  fp16 would need a loss scaler, whose deliberate overflow steps the trainer's non-finite
  guard (``train.max_nonfinite_steps``) counts and skips, so the scale never comes down;
  fp8 is not implemented for the draft.

At run time, :func:`check_runtime` compares what the launcher asked for (the environment
``accelerate launch`` exports) with what accelerate chose, and writes the recipe's clipping,
accumulation and micro-batch into the DeepSpeed config before ``accelerator.prepare``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from ..methods import UnknownMethodError, get_method
from ..recipe import Recipe

SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP")
SUPPORTED_MIXED_PRECISION = ("no", "bf16")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
# accelerate refuses these in deepspeed_config when a DeepSpeed JSON file is given (they belong in the JSON)
_DS_KEYS_OWNED_BY_JSON = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                          "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                          "zero3_save_16bit_model")
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class LauncherError(ValueError):
    """A launcher config that does not fit the recipe or the draft model, or a run whose
    distributed setup is not the one the launcher asked for; the message names the file
    (or environment variable) and the key."""


def draft_model_class(method: str) -> type[nn.Module]:
    """The draft network class trained by ``draft.method`` (:mod:`draftsmith.methods`).

    Raises:
        LauncherError: unknown method.
    """
    try:
        return get_method(method).model_class
    except UnknownMethodError as exc:
        raise LauncherError(f"draft.method: {exc}") from None


def resolve_launcher_path(name: str | Path) -> Path:
    """The launcher file ``name`` refers to: absolute, else relative to the current directory,
    else to the draftsmith package root (where the shipped ``recipes/accelerate/`` live).

    Raises:
        LauncherError: no such file.
    """
    path = Path(name).expanduser()
    candidates = [path] if path.is_absolute() else [path, PACKAGE_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise LauncherError(f"launcher: {name} not found (looked in {', '.join(str(c) for c in candidates)})")


@dataclass
class LauncherConfig:
    """The parts of an accelerate launcher YAML that draftsmith checks.

    Attributes:
        path: the file.
        distributed_type: accelerate's ``DistributedType`` name (``NO``, ``FSDP`` ...).
        num_processes: processes over all machines (accelerate counts the total); None when the
            file leaves it to ``accelerate launch`` (all visible GPUs).
        num_machines: nodes.
        mixed_precision: ``no``, ``bf16``, ``fp16`` or ``fp8`` as written.
        use_cpu: ``use_cpu: true``.
        deepspeed_config / fsdp_config: the sections, ``{}`` when absent; ``fsdp_config`` keys
            carry the ``fsdp_`` prefix, which accelerate adds where the file omits it.
    """

    path: Path
    distributed_type: str = "NO"
    num_processes: int | None = None
    num_machines: int = 1
    mixed_precision: str = "no"
    use_cpu: bool = False
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    fsdp_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LauncherConfig":
        """Read ``path``. Unknown top-level keys are errors here, as they are for
        ``accelerate launch``.

        Raises:
            LauncherError: unreadable file, not a mapping, unknown key, or a value of the wrong type.
        """
        from accelerate.commands.config.config_args import ClusterConfig

        path = Path(path)
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise LauncherError(f"{path}: cannot read launcher config ({exc})") from exc
        if not isinstance(tree, dict):
            raise LauncherError(f"{path}: a launcher config must be a YAML mapping")
        unknown = sorted(set(tree) - set(ClusterConfig.__dataclass_fields__))
        if unknown:
            raise LauncherError(f"{path}: unknown key(s) {unknown} (accelerate launch refuses them)")
        dtype = tree.get("distributed_type", "NO")
        if dtype is False:  # YAML 1.1 reads a bare NO as false
            raise LauncherError(f"{path}: distributed_type: write 'NO' in quotes (bare NO is YAML false)")
        cfg = cls(path=path, distributed_type=str(dtype), num_processes=tree.get("num_processes"),
                  num_machines=tree.get("num_machines", 1), mixed_precision=str(tree.get("mixed_precision") or "no"),
                  use_cpu=bool(tree.get("use_cpu", False)), deepspeed_config=tree.get("deepspeed_config") or {},
                  fsdp_config=tree.get("fsdp_config") or {})
        for key in ("num_processes", "num_machines"):
            value = getattr(cfg, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise LauncherError(f"{path}: {key}: must be a positive integer, got {value!r}")
        for key in ("deepspeed_config", "fsdp_config"):
            if not isinstance(getattr(cfg, key), dict):
                raise LauncherError(f"{path}: {key}: must be a mapping")
        # accelerate reads fsdp_config.x as fsdp_x
        cfg.fsdp_config = {k if k.startswith("fsdp_") else f"fsdp_{k}": v for k, v in cfg.fsdp_config.items()}
        return cfg

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed ZeRO stage (accelerate's default 2 when unset); None without DeepSpeed."""
        return int(self.deepspeed_config.get("zero_stage", 2)) if self.distributed_type == "DEEPSPEED" else None

    def wrap_classes(self) -> list[str] | None:
        """``fsdp_transformer_layer_cls_to_wrap`` as a list (accelerate splits it on commas);
        None when the file names none."""
        value = self.fsdp_config.get("fsdp_transformer_layer_cls_to_wrap")
        if value is None:
            return None
        names = value if isinstance(value, list) else str(value).split(",")
        return [n.strip() for n in names if n.strip()]


@dataclass
class LauncherReport:
    """What a validated launcher does with the recipe (reported by ``--dry-run``).

    Attributes:
        path: the launcher file.
        distributed_type, num_processes, num_machines, mixed_precision: as in the file
            (``num_processes`` None: all visible GPUs of each machine).
        zero_stage: DeepSpeed ZeRO stage, else None.
        wrap_classes: FSDP units below the root (FSDP only; ``[]``: the root is the one unit).
        wrap_source: ``"launcher"`` or ``"model _no_split_modules"``.
        gradient_clipping: the max gradient norm the run clips to (``train.max_grad_norm``).
        sharded: what each rank holds 1/num_processes of: subset of ``("weights",
            "gradients", "optimizer state")``.
    """

    path: Path
    distributed_type: str
    num_processes: int | None
    num_machines: int
    mixed_precision: str
    zero_stage: int | None
    wrap_classes: list[str] | None
    wrap_source: str | None
    gradient_clipping: float
    sharded: tuple[str, ...]


def _contradicts(value: Any, want: float) -> bool:
    """A launcher / DeepSpeed value that is set (not ``"auto"``) and differs from the recipe's."""
    if value is None or value == "auto":
        return False
    try:
        return not math.isclose(float(value), want)
    except (TypeError, ValueError):
        return True


def _check_deepspeed_json(file: Path, recipe: Recipe) -> tuple[list[str], int | None]:
    """Problems (``key: message``) of a DeepSpeed JSON config against the recipe, and its ZeRO stage."""
    try:
        ds = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [f"cannot read ({exc})"], None
    problems = []
    train = recipe.train
    for key, want, recipe_key in (("gradient_clipping", train.max_grad_norm, "train.max_grad_norm"),
                                  ("gradient_accumulation_steps", train.grad_accum_steps, "train.grad_accum_steps"),
                                  ("train_micro_batch_size_per_gpu", train.batch_size, "train.batch_size")):
        if _contradicts(ds.get(key), want):
            problems.append(f"{key}: {ds[key]} contradicts the recipe's {recipe_key}={want}; write \"auto\" or drop it")
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage == 3:
        problems.append("zero_optimization.stage: 3 is not supported (see draftsmith.train.launchers); use 2")
    if ds.get("fp16", {}).get("enabled") is True:
        problems.append("fp16.enabled: fp16 is not supported; the draft trains in bf16")
    return problems, stage


def validate_launcher(recipe: Recipe, launcher_path: str | Path, model_cls: type[nn.Module] | None = None
                      ) -> LauncherReport:
    """Check the launcher YAML ``launcher_path`` against ``recipe`` and the draft class
    ``model_cls`` (default: the class of ``recipe.draft.method``). Every problem is listed.

    Checks: supported ``distributed_type``; ``num_processes`` divisible by ``num_machines``
    (one process per GPU on every node) and 1 for ``NO``; ``mixed_precision`` ``no``/``bf16``;
    FSDP: ``fsdp_version: 2``, not ``use_cpu`` (accelerate 1.15 falls back to DDP on CPU), a
    known ``fsdp_auto_wrap_policy``, wrap classes among ``model_cls._no_split_modules``;
    DeepSpeed: ZeRO stage <= 2 and ``gradient_clipping`` / ``gradient_accumulation_steps``
    equal to ``train.max_grad_norm`` / ``train.grad_accum_steps`` when set (also inside a
    ``deepspeed_config_file`` JSON, found relative to the current directory, then the launcher's).

    Raises:
        LauncherError: naming the file and each offending key.
    """
    path = resolve_launcher_path(launcher_path)
    cfg = LauncherConfig.from_yaml(path)
    model_cls = model_cls or draft_model_class(recipe.draft.method)
    blocks = list(getattr(model_cls, "_no_split_modules", None) or [])
    problems: list[str] = []
    dtype = cfg.distributed_type
    if dtype not in SUPPORTED_DISTRIBUTED_TYPES:
        problems.append(f"distributed_type: {dtype} is not supported; use one of {list(SUPPORTED_DISTRIBUTED_TYPES)}")
    if cfg.num_processes is not None and cfg.num_processes % cfg.num_machines:
        problems.append(f"num_processes: {cfg.num_processes} is not divisible by num_machines={cfg.num_machines} "
                        "(num_processes counts all machines' processes)")
    if dtype == "NO" and (cfg.num_processes or 1) > 1:
        problems.append(f"num_processes: {cfg.num_processes} with distributed_type NO starts one process; "
                        "use MULTI_GPU, DEEPSPEED or FSDP")
    if cfg.mixed_precision not in SUPPORTED_MIXED_PRECISION:
        problems.append(f"mixed_precision: {cfg.mixed_precision} is not supported; use bf16 (the draft trains in bf16 "
                        "on GPU; fp16's loss-scaler overflow steps are what the trainer's non-finite guard skips)")

    wrap, wrap_source = None, None
    train = recipe.train
    if dtype == "FSDP":
        fsdp = cfg.fsdp_config
        version = fsdp.get("fsdp_version", 1)
        if str(version) != "2":
            default = " (the default)" if "fsdp_version" not in fsdp else ""
            problems.append(f"fsdp_config.fsdp_version: {version}{default} is FSDP1, which draftsmith does not "
                            "support; set fsdp_version: 2")
        if cfg.use_cpu:
            problems.append("use_cpu: FSDP does not run on CPU with accelerate 1.15 (it silently becomes DDP)")
        policy = fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")
        if policy not in WRAP_POLICIES:
            problems.append(f"fsdp_config.fsdp_auto_wrap_policy: {policy} is not one of {list(WRAP_POLICIES)}")
        named = cfg.wrap_classes()
        if named is not None:
            missing = [n for n in named if n not in blocks]
            if missing:
                problems.append(f"fsdp_config.fsdp_transformer_layer_cls_to_wrap: {', '.join(missing)} is not a "
                                f"block of {model_cls.__name__} (its _no_split_modules: {blocks}); remove the key "
                                "to wrap the model's own blocks")
            wrap, wrap_source = named, "launcher"
        elif policy == "TRANSFORMER_BASED_WRAP":
            wrap, wrap_source = blocks, "model _no_split_modules"
        else:
            wrap, wrap_source = [], f"fsdp_auto_wrap_policy {policy}"
        if "fsdp_gradient_clipping" in fsdp:
            problems.append("fsdp_config.gradient_clipping: accelerate does not read it; clipping comes from the "
                            f"recipe's train.max_grad_norm={train.max_grad_norm}")
    zero_stage = cfg.zero_stage
    if dtype == "DEEPSPEED":
        ds = cfg.deepspeed_config
        if zero_stage == 3:
            problems.append("deepspeed_config.zero_stage: 3 is not supported (a draft's weights are small; ZeRO-2 "
                            "shards the optimizer state and gradients, and ZeRO-3 checkpoints need a gather to "
                            "export); use 2")
        for key, want, recipe_key in (
            ("gradient_clipping", train.max_grad_norm, "train.max_grad_norm"),
            ("gradient_accumulation_steps", train.grad_accum_steps, "train.grad_accum_steps"),
        ):
            if _contradicts(ds.get(key), want):
                problems.append(f"deepspeed_config.{key}: {ds[key]} contradicts the recipe's {recipe_key}={want} "
                                "(DeepSpeed's value would win silently); remove the key")
        json_file = ds.get("deepspeed_config_file")
        if json_file:
            owned = [k for k in _DS_KEYS_OWNED_BY_JSON if k in ds]
            if owned:
                problems.append(f"deepspeed_config.{owned[0]}: with deepspeed_config_file, set {owned} in the JSON "
                                "(accelerate refuses both)")
            found = next((p for p in (Path(json_file), path.parent / json_file) if p.is_file()), None)
            if found is None:
                problems.append(f"deepspeed_config.deepspeed_config_file: {json_file} not found")
            else:
                json_problems, json_stage = _check_deepspeed_json(found, recipe)
                problems += [f"deepspeed_config.deepspeed_config_file ({found}): {p}" for p in json_problems]
                zero_stage = json_stage if isinstance(json_stage, int) else zero_stage
    if problems:
        raise LauncherError(f"{path}: launcher does not fit recipe {recipe.name!r} ({model_cls.__name__})\n"
                            + "\n".join(f"  {p}" for p in problems))

    sharded: tuple[str, ...] = ()
    if dtype == "FSDP":
        sharded = ("weights", "gradients", "optimizer state")
    elif zero_stage == 1:
        sharded = ("optimizer state",)
    elif zero_stage == 2:
        sharded = ("optimizer state", "gradients")
    return LauncherReport(path=path, distributed_type=dtype, num_processes=cfg.num_processes,
                          num_machines=cfg.num_machines, mixed_precision=cfg.mixed_precision, zero_stage=zero_stage,
                          wrap_classes=wrap, wrap_source=wrap_source, gradient_clipping=train.max_grad_norm,
                          sharded=sharded)


# what ``accelerate launch`` exports for a launcher's distributed_type
REQUEST_ENV = {"ACCELERATE_USE_DEEPSPEED": "DEEPSPEED", "ACCELERATE_USE_FSDP": "FSDP"}


def requested_distributed_type() -> str | None:
    """``"DEEPSPEED"`` / ``"FSDP"`` when the launcher asked for one (accelerate's env), else None."""
    from accelerate.utils import parse_flag_from_env

    return next((asked for env, asked in REQUEST_ENV.items() if parse_flag_from_env(env)), None)


def check_runtime(accelerator: Any, recipe: Recipe) -> None:
    """Refuse a run whose distributed setup is not what the launcher asked for, and make the
    DeepSpeed config follow the recipe. Call right after building the ``Accelerator`` and
    BEFORE ``accelerator.prepare`` (DeepSpeed reads its config in ``prepare``).

    1. ``accelerate launch`` exports ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED``
       from the launcher's ``distributed_type``; if accelerate nonetheless chose another
       ``accelerator.distributed_type`` (accelerate 1.15 on CPU turns FSDP into DDP or into
       independent single-process runs, docs/cpu_lab.md, "accelerate on a CPU"), the run is refused; so is FSDP1.
    2. ``WORLD_SIZE`` (set by every launcher) above ``accelerator.num_processes`` means the
       ranks do not see each other as one job (they would train on the same data and write
       the same checkpoint folder): refused.
    3. DeepSpeed: ``gradient_clipping``, ``gradient_accumulation_steps`` and
       ``train_micro_batch_size_per_gpu`` of ``accelerator.state.deepspeed_plugin.deepspeed_config``
       are set from ``train.max_grad_norm``, ``train.grad_accum_steps`` and
       ``train.batch_size`` where they are ``"auto"`` or missing (accelerate would otherwise
       clip at 1.0, and cannot infer the micro-batch: the trainer prepares no DataLoader);
       a number that contradicts the recipe (from the launcher's ``deepspeed_config``, i.e.
       ``ACCELERATE_GRADIENT_CLIPPING``, or the DeepSpeed JSON) is refused. ZeRO-3 is refused.

    Raises:
        LauncherError: naming what was asked (environment variable) and what was got, or the
            DeepSpeed key and its source.
    """
    from accelerate.utils import parse_flag_from_env

    got = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    n = accelerator.num_processes
    for env, asked in REQUEST_ENV.items():
        if parse_flag_from_env(env) and got != asked:
            raise LauncherError(
                f"{env}=true: the launcher asked for {asked} but accelerate chose {got} with {n} process(es); "
                f"refusing to train without {asked} (on CPU draftsmith.train.distributed routes DeepSpeed and FSDP "
                "itself; for plain data parallel use torchrun with ACCELERATE_USE_CPU=1)"
            )
    if got == "FSDP" and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise LauncherError(f"FSDP_VERSION={accelerator.state.fsdp_plugin.fsdp_version}: FSDP1 is not supported; "
                            "set fsdp_version: 2 in the launcher's fsdp_config")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > n:
        raise LauncherError(f"WORLD_SIZE={world}: the launcher started {world} processes but accelerate sees {n} "
                            f"({got}); each would train alone on the same data into the same checkpoint folder")
    if got != "DEEPSPEED":
        return
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    train = recipe.train
    source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    source = f"DeepSpeed config {source}" if source != "none" else "the launcher's deepspeed_config"
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage == 3:
        raise LauncherError(f"zero_optimization.stage=3 ({source}): ZeRO-3 is not supported; use stage 2")
    for key, want, recipe_key in (("gradient_clipping", train.max_grad_norm, "train.max_grad_norm"),
                                  ("gradient_accumulation_steps", train.grad_accum_steps, "train.grad_accum_steps"),
                                  ("train_micro_batch_size_per_gpu", train.batch_size, "train.batch_size")):
        value = ds.get(key, "auto")
        if value in ("auto", None):
            ds[key] = want
        elif _contradicts(value, want):
            env = {"gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
                   "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"}.get(key)
            where = env if env and env in os.environ else source
            raise LauncherError(f"DeepSpeed {key}={value} ({where}) contradicts the recipe's {recipe_key}={want}; "
                                "remove it from the launcher / DeepSpeed config (the recipe decides)")
    plugin.gradient_clipping = train.max_grad_norm
