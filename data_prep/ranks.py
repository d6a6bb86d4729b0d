"""The data stage over several processes: per-rank and per-node orchestration of :func:`~draftsmith.data_prep.prepare.prepare`.

- :func:`prepare_distributed`: ``prepare`` under torchrun / ``accelerate launch``
  (``RANK`` / ``WORLD_SIZE``): rank 0 runs the early stages, every rank captures its own shards.
- :func:`prepare_node`: one node's share (the data-stage child that
  :mod:`draftsmith.data_prep.launch` starts per node): node-split regeneration, merged by node 0
  (:func:`merge_node_caches`), then the node's shards.
- Done markers carrying the launch's session id (:func:`write_marker`, :func:`wait_for_markers`):
  the processes wait for each other by polling the file system, not by a collective, since the
  data stage can outlast any process-group timeout; one short barrier (:func:`_barrier`).
- :func:`bind_local_device`: each process of a multi-process launch restricted to its own GPU
  before CUDA or vLLM starts.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path

from ..fileio import DiskFullError, ShardError, atomic_write_bytes
from ..layout import DataPaths, RunLayout
from ..recipe import Recipe
from ..target import TargetInfo
from . import regenerate as regen
from .agreement import check_run_dir
from .conversations import DataError
from .plan import Cluster, DataPlan, PlanError
from .prepare import STAGES, data_plan, log_plan, node_cache, prepare, stage_outputs, stage_regenerate, stage_target
from .shards import distributed_rank

log = logging.getLogger("draftsmith.prepare")

EARLY_DONE = ".early-stages.done"  # RUN_DIR/data marker: the main process finished the early stages
# what the data stage raises with a one-line message (no traceback is useful): ``draftsmith prepare``
# prints it and exits 1
PREPARE_ERRORS: tuple[type[Exception], ...] = (DataError, ShardError, DiskFullError, PlanError, FileNotFoundError,
                                               ValueError, TimeoutError)


def prepare_node(recipe: Recipe, run_dir: Path, stages: list[str], node: int, nodes: int, session: str,
                 plan: DataPlan | None = None, record: Path | None = None, poll_s: float = 5.0,
                 timeout_s: float = 48 * 3600.0) -> dict:
    """One node's share of the data stage (the data-stage child of
    :mod:`draftsmith.data_prep.launch`; one process per node, seeing all of the node's GPUs).

    - ``target``: every node resolves the target (its weights must be on the node) and writes
      the same ``target.json``.
    - ``regenerate``: the conversations ``i % nodes == node`` into
      :func:`~draftsmith.data_prep.prepare.node_cache` (with the plan's engine: vLLM's server at
      data parallel x tensor parallel over the node's GPUs);
      a ``.regen.node-*.done`` marker then says this node is finished.
    - ``tokenize`` / ``vocab``: node 0 waits for every node's marker, merges the caches into
      ``regen.jsonl`` and runs them; the others wait for its ``.early-stages.done`` marker.
    - ``hidden-states`` (node placement only): the shards ``i % nodes == node``, with vLLM at
      tensor parallel over the node's GPUs.

    Every marker carries ``session`` (the launch's id), so a marker of an earlier run never
    releases a node.

    Raises:
        TimeoutError: waited ``timeout_s`` for another node; names the files.
    """
    check_run_dir(recipe, run_dir, stages)  # before the first write
    paths = RunLayout(run_dir).data
    early = [st for st in stages if st != "hidden-states"]
    summary: dict = {}
    info = stage_target(recipe, paths) if "target" in stages or not paths.target_info.is_file() \
        else TargetInfo.read(paths.target_info)
    if plan is None:
        plan = data_plan(recipe, run_dir, info, stages, Cluster.detect(nodes=nodes))
        log_plan(plan, paths if node == 0 else None)
    early = [st for st in early if st != "target"]
    if early:
        if nodes == 1:
            summary = prepare(recipe, run_dir, early, plan=plan, record=record)
        else:
            if "regenerate" in early and recipe.data.regenerate.enabled:
                t = time.perf_counter()
                raw, _ = stage_regenerate(recipe, paths, info, share=(node, nodes), plan=plan, record=record,
                                          stats=summary)
                collections.deque(raw, maxlen=0)
                summary["regenerate_s"] = time.perf_counter() - t
            write_marker(paths.root / f".regen.node-{node:03d}-of-{nodes:03d}.done", session)
            if node == 0:
                wait_for_markers([paths.root / f".regen.node-{n:03d}-of-{nodes:03d}.done" for n in range(nodes)],
                                 session, "every node's regeneration", poll_s, timeout_s)
                merge_node_caches(paths, nodes)
                rest = [st for st in early if st in ("tokenize", "vocab")]  # tokenize reads the merged cache
                if rest:
                    summary.update(prepare(recipe, run_dir, rest, plan=plan, record=record))
    if node == 0:
        write_marker(paths.root / EARLY_DONE, session)
    if "hidden-states" in stages:
        wait_for_markers([paths.root / EARLY_DONE], session, "node 0's tokenize / vocab", poll_s, timeout_s)
        summary.update(prepare(recipe, run_dir, ["hidden-states"], capture_share=(node, nodes), plan=plan,
                               record=record))
    return summary


def merge_node_caches(paths: DataPaths, nodes: int) -> int:
    """Append every node's regeneration cache (:func:`~draftsmith.data_prep.prepare.node_cache`)
    to ``regen.jsonl`` (a torn last line of a killed writer is dropped) and remove them; returns
    the rows merged. Rows appended later win over older rows of the same id, as in one process's
    cache."""
    rows = 0
    parts = [node_cache(paths, n, nodes) for n in range(nodes)]
    if paths.regen.is_file():
        regen._drop_torn_tail(paths.regen)  # a killed writer's last line would swallow the first merged row
    with paths.regen.open("ab") as out:
        for part in parts:
            if not part.is_file():
                continue
            with part.open("rb") as fh:
                for line in fh:
                    if line.endswith(b"\n"):
                        out.write(line)
                        rows += 1
        out.flush()
        os.fsync(out.fileno())
    for part in parts:
        part.unlink(missing_ok=True)
    log.info("merged %d regenerated rows of %d node(s) into %s", rows, nodes, paths.regen)
    return rows


def write_marker(path: Path, session: str, **fields) -> None:
    """A done marker: ``{"session": ..., **fields}``, written atomically."""
    atomic_write_bytes(path, json.dumps({"session": session, **fields}).encode())


def wait_for_markers(files: list[Path], session: str | None, what: str, poll_s: float = 5.0,
                     timeout_s: float = 48 * 3600.0) -> None:
    """Poll the file system until every file in ``files`` exists and (``session`` given) carries
    ``session``; logs once a minute. Polling, not a collective: the data stage can outlast any
    process-group timeout.

    Raises:
        TimeoutError: after ``timeout_s``, naming the files still missing or stale.
    """
    t0, last = time.monotonic(), -60.0
    while True:
        missing = [f for f in files if not _marker_ok(f, session)]
        if not missing:
            return
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise TimeoutError(f"waited {waited:.0f} s for {what}; still missing: " + ", ".join(map(str, missing)))
        if waited - last >= 60:
            log.info("waiting for %s (%.0f s)", what, waited)
            last = waited
        time.sleep(poll_s)


def _marker_ok(path: Path, session: str | None) -> bool:
    if not path.is_file():
        return False
    if session is None:
        return True
    try:
        return json.loads(path.read_text()).get("session") == session
    except (OSError, ValueError, AttributeError):
        return False


def prepare_distributed(recipe: Recipe, run_dir: Path, stages: list[str] | None = None, device: str | None = None,
                        poll_s: float = 5.0, timeout_s: float = 48 * 3600.0, record: Path | None = None,
                        verify_shards: bool = False) -> dict:
    """:func:`~draftsmith.data_prep.prepare.prepare`, rank-safe under a distributed launcher
    (``RANK`` / ``WORLD_SIZE``; one process: just ``prepare``).

    Rank 0 runs ``target`` / ``regenerate`` / ``tokenize`` / ``vocab`` (it first removes the done
    marker ``RUN_DIR/data/.early-stages.done`` of an earlier run, then all ranks pass one short
    barrier) while the others poll the file system for the marker it writes when those stages
    are finished (not a collective: a regeneration can outlast any process-group timeout; stale
    stage outputs never release them); then every rank captures its own
    hidden-state shards on its own device (``device``, else
    :func:`draftsmith.target.default_device`: one per local rank) and all wait until the shard manifest is complete. Only rank 0 writes ``summary.json``.
    The run directory must be on a file system every node sees.

    Raises:
        TimeoutError: waited ``timeout_s`` for files; the message names them.
    """
    stages = [s for s in STAGES if s in (stages or STAGES)]
    rank, world = distributed_rank()
    if world == 1:
        return prepare(recipe, run_dir, stages, device, record=record, verify_shards=verify_shards)
    paths = RunLayout(run_dir).data
    outputs = stage_outputs(recipe, paths)
    marker = paths.root / EARLY_DONE
    early = [s for s in stages if s != "hidden-states"]
    summary: dict = {}

    if early:
        if rank == 0:
            paths.root.mkdir(parents=True, exist_ok=True)
            marker.unlink(missing_ok=True)  # a marker from an earlier run must not release the others
        _barrier()  # no rank looks for the marker before the stale one is gone
        if rank == 0:
            summary = prepare(recipe, run_dir, early, device, record=record)
            atomic_write_bytes(marker, json.dumps({"stages": early}).encode())
        else:
            wait_for_markers([marker], None, f"rank 0 to run {', '.join(early)} (rank {rank})", poll_s, timeout_s)
    if "hidden-states" in stages:
        t = time.perf_counter()
        summary.update(prepare(recipe, run_dir, ["hidden-states"], device, record=record,  # this rank's shards
                               verify_shards=verify_shards))
        wait_for_markers(outputs["hidden-states"], None, f"the other ranks' hidden-state shards (rank {rank})",
                         poll_s, timeout_s)
        if "hidden_states" in summary:  # this rank's throughput; the tokens of every rank's shards
            from .shards import load_manifest

            m = load_manifest(paths.hidden_states)
            summary["hidden_states"]["tokens"] = sum(sh["num_tokens"] for sh in m["shards"])
        summary["seconds"] = summary.get("seconds", 0.0) + time.perf_counter() - t
    if rank == 0:
        paths.summary.write_text(json.dumps(summary, indent=1))
    return summary


def prepare_run(recipe: Recipe, run_dir: Path, stages: list[str] | None = None, device: str | None = None,
                verify_shards: bool = False, recipe_arg: str | None = None, check: bool = True) -> dict:
    """What ``draftsmith prepare RECIPE --run-dir RUN_DIR`` does in each process it runs in
    (one, or each rank of torchrun / ``accelerate launch``): compare ``RUN_DIR/data`` with the
    recipe (``check``) before anything is written, write ``RUN_DIR/recipe.yaml`` (rank 0) and this
    process's record under ``data/procs``, then :func:`prepare_distributed`; returns its summary.

    Args:
        recipe_arg: the recipe as the command line named it, for the command a refusal suggests
            (:func:`~draftsmith.data_prep.agreement.recipe_arg`).
        check: False when the data was just removed (``--overwrite-data``).

    Raises:
        RunDirMismatchError: ``RUN_DIR/data`` was prepared with other recipe keys (one line).
        PREPARE_ERRORS: a stage failed (see :func:`~draftsmith.data_prep.prepare.prepare`).
    """
    from ..recipe import dump_recipe
    from .prepare import process_record

    if check:  # before this process writes anything (its record, the recipe, any stage)
        check_run_dir(recipe, run_dir, [s for s in STAGES if s in (stages or STAGES)], recipe_arg)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = RunLayout(run_dir).data
    if distributed_rank()[0] == 0:
        dump_recipe(recipe, RunLayout(run_dir).recipe)
    record = process_record(paths, f"rank-{distributed_rank()[0]}", rank=distributed_rank()[0])
    return prepare_distributed(recipe, run_dir, stages, device, record=record, verify_shards=verify_shards)


def _barrier() -> None:
    """One short barrier over the launched processes: the job's process group when there is
    one, else a temporary gloo group (torchrun sets ``MASTER_ADDR`` / ``MASTER_PORT``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return
    if not (dist.is_available() and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        log.warning("no process group and no MASTER_ADDR/MASTER_PORT: ranks start without a barrier")
        return
    dist.init_process_group("gloo")
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def bind_local_device(env: dict | None = None) -> str | None:
    """Under a launcher with several processes per node, restrict this process to its own GPU
    (``CUDA_VISIBLE_DEVICES`` = the ``LOCAL_RANK``-th of the visible devices, or ``LOCAL_RANK``)
    so that an engine it builds, and the processes vLLM starts for it, land there and not all on
    device 0. Must run before CUDA or vLLM is initialised (``draftsmith prepare``'s ``main`` calls it
    first). Returns the value set, or None outside a multi-process launch."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if local_world <= 1 or "LOCAL_RANK" not in env:
        return None
    env["CUDA_VISIBLE_DEVICES"] = local_device(int(env["LOCAL_RANK"]), env)
    return env["CUDA_VISIBLE_DEVICES"]


def local_device(local_rank: int, env: dict | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of local rank ``local_rank``: the ``local_rank``-th of the
    devices visible in ``env`` (this process's environment by default), or ``local_rank`` when
    none are listed."""
    env = os.environ if env is None else env
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[local_rank % len(visible)] if visible else str(local_rank)
