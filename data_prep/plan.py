"""The data stage's plan: which engine regenerates and which captures, on which devices, and
what the shards cost on disk and in read bandwidth; printed before the stage runs and by
``draftsmith prepare --dry-run`` (and the training scripts' ``--dry-run``).

The plan follows from the target's weight bytes against one device's memory
(:func:`draftsmith.target.target_weight_bytes`, the figure the training dry run also prints):

- **tensor-parallel size**: the smallest power of two (dividing the target's attention heads
  and at most the node's GPUs) at which one GPU's share of the weights takes at most
  :data:`WEIGHT_SHARE` of vLLM's share of that GPU (``vllm.gpu_memory_utilization``), so the
  rest holds the KV cache of a useful batch. A target that needs more than one node's GPUs
  is refused in one line that says how many nodes one engine would span (:func:`nodes_needed`:
  TP over a node, pipeline parallel across nodes): the data stage's engines run within a node.
- **expert parallelism** (MoE targets at TP > 1, :func:`expert_parallel`): whether vLLM's
  ``enable_expert_parallel`` is on (``vllm.extra_engine_args``), whole experts per GPU.
- **regeneration**: vLLM's OpenAI server with ``data_parallel_size`` = node GPUs / TP on
  every node (``data.regenerate.engine: vllm-server``; each node regenerates the
  conversations ``i % nodes == node``), or the offline engine at that TP (one engine; vLLM's
  offline ``LLM`` has no data parallelism, so the other GPUs of the node idle).
- **capture placement** (``data.capture_placement``): ``rank`` when the target fits one GPU:
  every rank of the launcher captures its own shards in a child process that sees only its
  own GPU (``CUDA_VISIBLE_DEVICES``); ``node`` otherwise: one child per node (started by
  local rank 0) captures that node's shards with vLLM at TP over all of the node's GPUs.
- **shards**: bytes per token at ``data.hidden_states_dtype``
  (:func:`draftsmith.data_prep.shards.bytes_per_token`), the shard size, the disk the
  expected tokens need and what the file system has free, and the read bandwidth training
  needs at a given training throughput.

Everything here is arithmetic on the target's ``config.json`` and the recipe: no weights are
read and no device is touched, so the same plan prints on a laptop for a 120B target.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..recipe import Recipe
from ..target import target_facts, target_weight_bytes, text_json

WEIGHT_SHARE = 0.7  # most of vLLM's share of a GPU the weights may take; the rest is KV cache / activations
DEFAULT_DEVICE_MEMORY_GIB = 80.0


class PlanError(ValueError):
    """The data stage cannot run as configured; one line naming the recipe key or path."""


@dataclass(frozen=True)
class Cluster:
    """The machines the data stage runs on.

    Attributes:
        nodes: machines in the job.
        gpus_per_node: GPUs per machine (0: CPU only, the lab).
        device_memory_gib: memory of one GPU in GiB (None on CPU).
    """

    nodes: int = 1
    gpus_per_node: int = 0
    device_memory_gib: float | None = None

    @classmethod
    def detect(cls, nodes: int | None = None, gpus_per_node: int | None = None,
               device_memory_gib: float | None = None) -> "Cluster":
        """This job's layout: ``nodes`` from ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (1 outside a
        launcher), GPUs per node from ``LOCAL_WORLD_SIZE`` under a launcher (one process per
        GPU) or the GPUs this process sees, the memory of one GPU from NVML / ``nvidia-smi``
        (no CUDA context is created: the training ranks stay clean for the data-stage child).
        Arguments override what is detected."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if nodes is None:
            nodes = max(1, world // max(1, local_world))
        if gpus_per_node is None:
            visible = _visible_gpus()
            gpus_per_node = min(visible, local_world) if world > 1 and visible else visible
        if device_memory_gib is None and gpus_per_node:
            device_memory_gib = gpu_memory_gib() or DEFAULT_DEVICE_MEMORY_GIB
        return cls(nodes, gpus_per_node, device_memory_gib if gpus_per_node else None)


def _visible_gpus() -> int:
    """CUDA devices this process may use, counted without creating a CUDA context."""
    import torch

    if not torch.cuda.is_available():  # NVML-based where possible; never initialises CUDA
        return 0
    return torch.cuda.device_count()


def gpu_memory_gib() -> float | None:
    """Total memory of GPU 0 in GiB from ``nvidia-smi`` (None when it is not there)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return float(out.split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def nodes_needed(weight_bytes: int, cluster: Cluster, utilization: float) -> int:
    """Nodes of ``cluster``'s GPUs one engine needs to hold ``weight_bytes`` with the KV-cache room
    :func:`tensor_parallel_size` keeps (tensor parallel over a node's GPUs, pipeline parallel
    across nodes, as ``vllm serve --tensor-parallel-size G --pipeline-parallel-size N`` runs it);
    1 on CPU."""
    if not cluster.gpus_per_node:
        return 1
    node = WEIGHT_SHARE * utilization * cluster.device_memory_gib * 1024**3 * cluster.gpus_per_node
    return max(1, -(-int(weight_bytes) // int(node)))


def tensor_parallel_size(weight_bytes: int, cluster: Cluster, utilization: float, heads: int) -> int:
    """The smallest TP (a power of two dividing ``heads``, at most the node's GPUs) at which
    one GPU's share of ``weight_bytes`` takes at most :data:`WEIGHT_SHARE` of
    ``utilization`` x the GPU's memory; 1 on CPU.

    Raises:
        PlanError: not even the whole node holds the target that way: one line with the nodes an
            engine would span (:func:`nodes_needed`) and what to do, since the data stage's
            engines (regeneration, capture) run within one node.
    """
    if not cluster.gpus_per_node:
        return 1
    budget = WEIGHT_SHARE * utilization * cluster.device_memory_gib * 1024**3
    tp = 1
    while tp <= cluster.gpus_per_node:
        if heads % tp == 0 and weight_bytes / tp <= budget:
            return tp
        tp *= 2
    nodes = nodes_needed(weight_bytes, cluster, utilization)
    per_gpu = weight_bytes / (WEIGHT_SHARE * utilization * cluster.gpus_per_node * 1024**3)
    raise PlanError(
        f"the target's {weight_bytes / 1024**3:.1f} GiB of weights do not fit one node: {cluster.gpus_per_node} GPUs x "
        f"{cluster.device_memory_gib:g} GiB x vllm.gpu_memory_utilization {utilization:g} x {WEIGHT_SHARE:g} (KV cache "
        f"room); one engine would span {nodes} such nodes (tensor_parallel_size {cluster.gpus_per_node} x "
        f"pipeline_parallel_size {nodes}), but the data stage runs its engines within one node: use nodes of "
        f"{cluster.gpus_per_node} GPUs with at least {per_gpu:.0f} GiB each (e.g. H200 141 GB), or regenerate with "
        "your own multi-node servers (data.regenerate.server_urls) and capture with data.hidden_states_engine on such nodes")


def expert_parallel(config_json: dict[str, Any], recipe: Recipe, tensor_parallel: int) -> dict[str, Any] | None:
    """Expert parallelism for a MoE target sharded over ``tensor_parallel`` GPUs: vLLM's
    ``enable_expert_parallel`` (set through ``vllm.extra_engine_args``, which every engine of
    the data stage receives) places whole experts on each GPU instead of slicing every expert
    ``tensor_parallel`` ways. None for a dense target or TP 1."""
    facts = target_facts(config_json)
    if not facts["moe"] or tensor_parallel < 2:
        return None
    on = bool(recipe.vllm.extra_engine_args.get("enable_expert_parallel"))
    E = facts["moe"]["experts"]
    return {"enabled": on, "experts": E, "experts_per_gpu": E / tensor_parallel,
            "text": (f"expert parallel over {tensor_parallel} GPUs: {E / tensor_parallel:g} of {E} experts per GPU"
                     if on else f"experts sliced {tensor_parallel} ways (tensor parallel); vllm.extra_engine_args: "
                                "{enable_expert_parallel: true} places whole experts per GPU instead")}


@dataclass
class DataPlan:
    """What the data stage will do (see the module docstring); :meth:`format` prints it."""

    recipe: str
    cluster: Cluster
    target: str
    target_parameters: int
    target_weight_bytes: int
    quantization: str | None
    fits_one_device: bool
    min_tensor_parallel: int
    regenerate: dict[str, Any] | None
    capture: dict[str, Any] | None
    shards: dict[str, Any]
    disk: dict[str, Any]
    read_bandwidth: dict[str, Any]
    expert_parallel: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        c = self.cluster
        where = (f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s) of {c.device_memory_gib:g} GiB" if c.gpus_per_node
                 else f"{c.nodes} node(s), CPU only")
        lines = [f"data plan        {self.recipe}: {where}",
                 f"target           {self.target}: {self.target_parameters / 1e9:.2f}B parameters, "
                 f"{_gib(self.target_weight_bytes)} of weights"
                 + (f" ({self.quantization} {'experts' if self.quantization == 'mxfp4' else 'linears'})" if self.quantization else "")
                 + (f"; smallest tensor-parallel size {self.min_tensor_parallel} "
                    f"({'fits one GPU' if self.fits_one_device else 'larger than one GPU'})" if c.gpus_per_node else "")]
        if self.expert_parallel:
            lines.append(f"experts          {self.expert_parallel['text']}")
        r = self.regenerate
        samples = r["samples_per_prompt"] if r else 1
        if r is None:
            lines.append("regenerate       off (data.regenerate.enabled: false) or already done")
        elif not c.gpus_per_node:
            lines.append(f"regenerate       {r['engine']} on the CPU, one engine per node"
                         + (f"; node n takes conversations i % {c.nodes} == n" if c.nodes > 1 else ""))
        else:
            lines.append(f"regenerate       {r['engine']} on every node: data_parallel_size {r['data_parallel_size']} x "
                         f"tensor_parallel_size {r['tensor_parallel_size']} = {r['gpus']} GPU(s) per node"
                         + (f" ({r['idle_gpus']} idle: the offline engine has no data parallelism)" if r["idle_gpus"] else "")
                         + (f"; node n takes conversations i % {c.nodes} == n" if c.nodes > 1 else "")
                         + f"; {r['throughput']}")
        if samples > 1:
            lines.append(f"                 {samples} replies per prompt (data.regenerate.samples_per_prompt) at "
                         f"temperatures {r['temperatures']}: {samples}x the conversations, tokens and capture time "
                         f"of one reply each")
        k = self.capture
        if k is None:
            lines.append("capture          none (data.hidden_states_mode: online, or the shards exist)")
        else:
            lines.append(f"capture          {k['engine']}, placement {k['placement']}: {k['devices']}")
        s, d, b = self.shards, self.disk, self.read_bandwidth
        lines.append(f"shards           {s['dtype']}, {s['bytes_per_token']} B per token, "
                     + (f"{human_bytes(s['shard_bytes'])} per shard (~{s['tokens_per_shard']} tokens)" if s["shard_bytes"]
                        else f"{s['sequences_per_shard']} sequences per shard (up to {human_bytes(s['max_shard_bytes'])})"))
        lines.append(f"disk             {human_bytes(d['need_bytes'])} for {d['tokens'] or 'unknown'} tokens"
                     f" ({d['tokens_source']}); free at {d['path']}: {human_bytes(d['free_bytes'])}")
        lines.append(f"training reads   {b['text']}")
        lines += [f"note             {n}" for n in self.notes]
        return "\n".join(lines)


def human_bytes(n: float | None) -> str:
    """``n`` bytes in decimal units (``11.5 TB``); ``n/a`` for None."""
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _tp_for_node(gpus: int, heads: int) -> int:
    """The largest power of two <= ``gpus`` dividing ``heads``: TP over one node's GPUs."""
    tp = 1
    while tp * 2 <= gpus and heads % (tp * 2) == 0:
        tp *= 2
    return tp


def _free_bytes(path: Path) -> tuple[str, int | None]:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return str(p), shutil.disk_usage(p).free
    except OSError:
        return str(p), None


def build_plan(recipe: Recipe, config_json: dict[str, Any], cluster: Cluster, run_dir: Path | None = None,
               regenerate: bool | None = None, capture: bool | None = None, tokens: int | None = None,
               train_tokens_per_s_per_gpu: float | None = None, regenerate_engine: str | None = None,
               capture_engine: str | None = None) -> DataPlan:
    """The data stage's plan for ``recipe`` on ``cluster`` (module docstring).

    Args:
        config_json: the target's ``config.json`` (:func:`draftsmith.target.load_config_json`).
        run_dir: where the data lands (free space is read there).
        regenerate / capture: whether those stages are left to run (default: as the recipe says).
        tokens: tokens to capture when known (the tokenised data); else ``data.expected_tokens``.
        train_tokens_per_s_per_gpu: training throughput, for the read bandwidth.
        regenerate_engine / capture_engine: the resolved engine names (default: resolved here
            from the recipe the way the stages resolve them).

    Raises:
        PlanError: ``vllm.data_parallel_size x vllm.tensor_parallel_size`` beyond the node's GPUs;
            ``data.shard_bytes`` below one sequence of ``data.max_length`` tokens; a target larger
            than one node.
    """
    from .shards import bytes_per_token

    d = recipe.data
    t = text_json(config_json)
    heads = int(t["num_attention_heads"])
    weights = target_weight_bytes(config_json, recipe.target.dtype)
    gpus = cluster.gpus_per_node
    v = recipe.vllm
    if gpus and v.tensor_parallel_size * v.data_parallel_size > gpus:
        raise PlanError(f"vllm.data_parallel_size {v.data_parallel_size} x vllm.tensor_parallel_size "
                        f"{v.tensor_parallel_size} = {v.data_parallel_size * v.tensor_parallel_size} GPUs, but a node "
                        f"has {gpus}")
    tp_min = tensor_parallel_size(weights["bytes"], cluster, v.gpu_memory_utilization, heads)
    notes: list[str] = []

    regen = None
    if (d.regenerate.enabled if regenerate is None else regenerate):
        from .chat_engines import resolve_engine as resolve_regen

        engine = regenerate_engine or ("vllm-server" if gpus and d.regenerate.engine == "auto"
                                       else resolve_regen(d.regenerate.engine, v))
        if d.regenerate.server_urls:
            engine = "vllm-server (your servers: data.regenerate.server_urls)"
        tp = (d.regenerate.tensor_parallel_size or tp_min) if gpus else 1
        if tp < tp_min or (gpus and tp > gpus):
            raise PlanError(f"data.regenerate.tensor_parallel_size={tp}: the target needs at least {tp_min} and a node "
                            f"has {gpus} GPUs")
        dp = max(1, gpus // tp) if engine == "vllm-server" and gpus else 1
        used = tp * dp if gpus else 0
        regen = {"engine": engine, "tensor_parallel_size": tp, "data_parallel_size": dp, "gpus": used,
                 "idle_gpus": max(0, gpus - used), "samples_per_prompt": d.regenerate.samples_per_prompt,
                 "temperatures": list(d.regenerate.temperatures),
                 "throughput": "throughput per GPU: measured, printed when regeneration ends and kept in "
                               "data/summary.json (regenerate_tok_s_per_gpu)"}

    cap = None
    if d.hidden_states_mode == "offline" and (capture is None or capture):
        from ..target.vllm_capture import resolve_engine as resolve_capture

        engine = capture_engine or ("vllm" if gpus and d.hidden_states_engine == "auto"
                                    else resolve_capture(d.hidden_states_engine))
        if engine == "transformers" and tp_min > 1:
            raise PlanError(f"data.hidden_states_engine: transformers captures on one GPU, but the target needs "
                            f"tensor_parallel_size {tp_min} ({_gib(weights['bytes'])} of weights): use vllm (or auto)")
        placement = d.capture_placement
        if placement == "auto":
            placement = "rank" if tp_min == 1 else "node"
        if placement == "rank" and tp_min > 1:
            raise PlanError(f"data.capture_placement: rank, but the target needs tensor_parallel_size {tp_min} "
                            f"({_gib(weights['bytes'])} of weights on {cluster.device_memory_gib:g} GiB GPUs): "
                            "use node (or auto)")
        if placement == "node":
            tp = _tp_for_node(gpus, heads) if gpus else 1
            devices = (f"local rank 0 of each node starts one child that captures its node's shards "
                       f"(i % {cluster.nodes} == node) with tensor_parallel_size {tp} over the node's "
                       f"{gpus or 'CPU'}{' GPUs' if gpus else ''}")
        else:
            tp = 1
            devices = ("every rank starts one child bound to its own device (CUDA_VISIBLE_DEVICES=<its GPU>) "
                       "that captures shards i % world_size == rank")
        if engine == "transformers" and not gpus:
            devices += "; transformers on the CPU"
        cap = {"engine": engine, "placement": placement, "tensor_parallel_size": tp, "devices": devices}

    H = int(t["hidden_size"])
    per_token = bytes_per_token(H, d.hidden_states_dtype)
    one_seq = d.max_length * per_token
    if d.shard_bytes is not None and d.shard_bytes < one_seq:
        raise PlanError(f"data.shard_bytes={d.shard_bytes} cannot hold one sequence of data.max_length={d.max_length} "
                        f"tokens ({one_seq} bytes at {per_token} B per token, {d.hidden_states_dtype})")
    shards = {"dtype": d.hidden_states_dtype, "bytes_per_token": per_token, "shard_bytes": d.shard_bytes,
              "tokens_per_shard": d.shard_bytes // per_token if d.shard_bytes else None,
              "sequences_per_shard": d.sequences_per_shard,
              "max_shard_bytes": d.shard_bytes or d.sequences_per_shard * one_seq}
    n_tokens, source = (tokens, "tokenised data") if tokens is not None else (d.expected_tokens, "data.expected_tokens")
    path, free = _free_bytes(run_dir or Path("."))
    need = n_tokens * per_token if n_tokens and d.hidden_states_mode == "offline" else None
    disk = {"tokens": n_tokens, "tokens_source": source if n_tokens else "set data.expected_tokens",
            "need_bytes": need, "path": path, "free_bytes": free}
    if need is not None and free is not None and need > free:
        notes.append(f"the shards need {human_bytes(need)} but {path} has {human_bytes(free)} free")
    if d.hidden_states_mode == "online":
        bw = {"bytes_per_s_per_node": None, "text": "nothing from disk: online mode runs the target in the job"}
    elif train_tokens_per_s_per_gpu:
        per_node = train_tokens_per_s_per_gpu * per_token * max(1, gpus)
        bw = {"bytes_per_s_per_node": per_node,
              "text": f"{human_bytes(per_node)}/s per node ({per_token} B per token x {train_tokens_per_s_per_gpu:,.0f} "
                      f"training tok/s per GPU x {max(1, gpus)} GPU(s))"}
    else:
        bw = {"bytes_per_s_per_node": None,
              "text": f"{per_token} B per training token per GPU ({human_bytes(per_token * 10_000)}/s per GPU at 10k tok/s)"}
    if gpus and d.hidden_states_dtype != "float8_e4m3fn" and need and need > 1e12:
        notes.append(f"{human_bytes(need)} of {d.hidden_states_dtype} shards: data.hidden_states_dtype: float8_e4m3fn halves it")
    return DataPlan(recipe=recipe.name, cluster=cluster, target=recipe.target.name_or_path,
                    target_parameters=weights["parameters"], target_weight_bytes=weights["bytes"],
                    quantization=weights["quantization"], fits_one_device=tp_min == 1, min_tensor_parallel=tp_min,
                    regenerate=regen, capture=cap, shards=shards, disk=disk, read_bandwidth=bw,
                    expert_parallel=expert_parallel(config_json, recipe, tp_min if gpus else 1), notes=notes)


def parse_share(text: str, what: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``.

    Raises:
        PlanError: naming ``what`` and the text.
    """
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise PlanError(f"{what} {text!r}: want INDEX/COUNT, e.g. 0/2") from None
    if n < 1 or not 0 <= i < n:
        raise PlanError(f"{what} {text!r}: index outside 0..{n - 1}")
    return i, n
