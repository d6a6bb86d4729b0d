"""The data stage inside a multi-process training launch (``accelerate launch`` / torchrun).

``accelerate launch train/eagle3.py RECIPE`` on a run directory without data runs the
missing stages here, before any training rank touches a GPU, in child processes
(``python -m draftsmith.cli.prepare``) that exit, and so free every byte of device
memory they held, before training starts:

1. Global rank 0 writes ``data/.prepare-session`` (a fresh id) and the resolved recipe, and
   hands the id to every rank over the launcher's store (no process group: the accelerator
   makes the job's one later); each rank reads the file back and finds that id. A node that
   cannot is not on the run directory's file system: a clear error, within a minute.
2. **Node child** (local rank 0 of each node; it sees all of the node's GPUs): the node's share
   of regeneration (vLLM's server with data parallel x tensor parallel over the node's GPUs),
   node 0's tokenize / vocab, and, with ``node`` placement (a target larger than one GPU),
   the node's shards with vLLM at tensor parallel over the node's GPUs
   (:func:`draftsmith.data_prep.ranks.prepare_node`).
3. **Capture children** (``rank`` placement, a target that fits one GPU): every rank starts
   one child with ``CUDA_VISIBLE_DEVICES`` set to its own GPU, capturing the shards
   ``i % world_size == rank``.
4. Every rank waits (file system polling, not a collective: the data stage can outlast any
   process-group timeout) for every node's done marker and the complete shard manifest.

The other ranks of a node never load the target. Each child's output goes to
``data/logs/<role>.log``; a child that fails raises :class:`DataStageError` with the log's
tail in the rank that started it, and the launcher then stops the job.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..layout import RunLayout
from ..recipe import Recipe, dump_recipe
from .plan import DataPlan, PlanError
from ..fileio import atomic_write_bytes
from .shards import MANIFEST, load_manifest

log = logging.getLogger("draftsmith.prepare")

SESSION = ".prepare-session"
CHILD_RECIPE = "prepare.recipe.yaml"
# what makes a process part of a launch: removed from a child's environment so it runs alone
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
               "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class DataStageError(RuntimeError):
    """A data-stage child failed; the message names its log and ends with the log's tail."""


def launch_layout(env: dict | None = None) -> dict[str, int]:
    """``rank``, ``world``, ``local_rank``, ``local_world``, ``node`` and ``nodes`` of this process
    from the launcher's environment (torchrun and ``accelerate launch`` set ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; the node is ``GROUP_RANK``, else
    ``NODE_RANK``, else ``RANK // LOCAL_WORLD_SIZE``)."""
    env = os.environ if env is None else env
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    node = env.get("GROUP_RANK", env.get("NODE_RANK"))
    return {"rank": rank, "world": world, "local_rank": int(env.get("LOCAL_RANK", str(rank % local_world))),
            "local_world": local_world, "node": int(node) if node is not None else rank // local_world,
            "nodes": max(1, world // local_world)}


def child_env(cuda_visible_devices: str | None = None) -> dict[str, str]:
    """This process's environment without the launch variables (:data:`LAUNCH_VARS`), so the
    child is a process of its own, and with ``CUDA_VISIBLE_DEVICES`` when given."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("ACCELERATE_")}
    if os.environ.get("ACCELERATE_USE_CPU"):
        env["ACCELERATE_USE_CPU"] = os.environ["ACCELERATE_USE_CPU"]
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def run_child(args: list[str], env: dict[str, str], log_path: Path) -> None:
    """Run ``python -m draftsmith.cli.prepare ARGS`` to its end, output to ``log_path``; the
    child dies with this process (``PR_SET_PDEATHSIG``).

    Raises:
        DataStageError: the child exited non-zero (its log's tail in the message).
    """
    from ..procs import bound_command

    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "draftsmith.cli.prepare", *args]
    log.info("data-stage child: %s (log %s)", " ".join(cmd), log_path)
    with log_path.open("ab") as out:
        proc = subprocess.Popen(bound_command(cmd), stdout=out, stderr=subprocess.STDOUT, env=env)
        rc = proc.wait()
    if rc != 0:
        tail = log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        raise DataStageError(f"data-stage child exited with {rc} (log {log_path}):\n{tail}")


def prepare_in_children(recipe: Recipe, run_dir: Path, stages: list[str], make_plan,
                        poll_s: float = 5.0, timeout_s: float = 48 * 3600.0) -> None:
    """Run the missing data ``stages`` of ``run_dir`` in child processes, rank-safe (module
    docstring); every rank of the launch calls it and returns once the data is ready and every
    child has exited. ``make_plan() -> DataPlan`` runs on global rank 0 only (before the
    barrier: an embedded target is materialised once), which prints the plan and passes its
    capture placement to the others in the session file.

    Raises:
        PlanError: the run directory is not on a file system this node shares with rank 0.
        DataStageError: a child this rank started failed.
        TimeoutError: waited ``timeout_s`` for another node.
    """
    from .prepare import STAGES, log_plan, process_record
    from .ranks import EARLY_DONE, local_device, wait_for_markers, write_marker

    lay = launch_layout()
    paths = RunLayout(run_dir).data
    stages = [s for s in STAGES if s in stages]
    recipe_file = paths.root / CHILD_RECIPE
    if lay["rank"] == 0:
        plan: DataPlan = make_plan()
        log_plan(plan, paths)
        paths.root.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, recipe_file)
        session = uuid.uuid4().hex
        atomic_write_bytes(paths.root / SESSION, json.dumps({
            "session": session, "stages": stages,
            "placement": plan.capture["placement"] if plan.capture else None}).encode())
    shared = read_session(paths.root / SESSION, lay, session if lay["rank"] == 0 else None)
    session, placement = shared["session"], shared["placement"]
    capture = "hidden-states" in stages and recipe.data.hidden_states_mode == "offline"
    early = [s for s in stages if s != "hidden-states"]
    node_stages = early + (["hidden-states"] if placement == "node" else [])
    common = [str(recipe_file), "--run-dir", str(run_dir), "--session", session]
    node_marker = [paths.root / f".node-{n:03d}-of-{lay['nodes']:03d}.done" for n in range(lay["nodes"])]
    process_record(paths, f"rank-{lay['rank']}", rank=lay["rank"], node=lay["node"], local_rank=lay["local_rank"])
    if node_stages:
        if lay["local_rank"] == 0:
            run_child([*common, "--node", f"{lay['node']}/{lay['nodes']}",
                       *[a for s in node_stages for a in ("--stage", s)]],
                      child_env(), paths.root / "logs" / f"node-{lay['node']}.log")
            write_marker(node_marker[lay["node"]], session)
        wait_for_markers(node_marker, session, "every node's data-stage child", poll_s, timeout_s)
    if placement == "rank":
        wait_for_markers([paths.root / EARLY_DONE], session if early else None, "node 0's tokenize / vocab",
                         poll_s, timeout_s)
        run_child([*common, "--capture-share", f"{lay['rank']}/{lay['world']}", "--stage", "hidden-states"],
                  child_env(local_device(lay["local_rank"])), paths.root / "logs" / f"capture-{lay['rank']}.log")
    if capture:
        _wait_for_manifest(paths.hidden_states, poll_s, timeout_s)
    log.info("rank %d: data ready in %s", lay["rank"], paths.root)


def _agent_store(timeout_s: float):
    """A client of the launcher's key-value store (torchrun's agent store, which ``accelerate
    launch`` uses too), under a prefix of this launch; None when the launcher has none. No
    process group is made: one made and destroyed before the accelerator's own would leave its
    peers' addresses in the store, and a rank reaching ``init_process_group`` late would dial
    them (gloo: "connection refused")."""
    import datetime

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" or not dist.is_available():
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    prefix = (f"draftsmith/prepare/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    return dist.PrefixStore(prefix, store)


_STARTED = time.time()  # a session file older than this process (less clock slack) is an earlier launch's
CLOCK_SLACK_S = 120.0


def read_session(path: Path, lay: dict[str, int], session: str | None, timeout_s: float = 600.0,
                 grace_s: float = 60.0) -> dict:
    """The session file rank 0 wrote, as this rank reads it from the run directory. Rank 0 passes
    its ``session`` id and also hands it over the launcher's store (:func:`_agent_store`); the
    other ranks then expect exactly that id in the file (retrying briefly: a network file
    system may show a new file late: up to ``grace_s``). Without a store, a file written since this process
    started (less :data:`CLOCK_SLACK_S`) is taken.

    Raises:
        PlanError: the file with rank 0's id is not readable here within ``timeout_s``: the run
            directory is not on a file system this node shares with rank 0.
    """
    store = _agent_store(timeout_s)
    if store is not None:
        if lay["rank"] == 0:
            store.set("session", session)
        session = store.get("session").decode()
    deadline = time.monotonic() + (grace_s if session is not None else timeout_s)
    while True:
        try:
            shared = json.loads(path.read_text())
            if shared["session"] == session or (session is None and path.stat().st_mtime >= _STARTED - CLOCK_SLACK_S):
                return shared
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            raise PlanError(f"{path}, written by rank 0, is not readable on node {lay['node']} (rank {lay['rank']}): "
                            "the run directory must be on a file system every node sees")
        time.sleep(1.0)


def _wait_for_manifest(directory: Path, poll_s: float, timeout_s: float) -> None:
    """Wait until the shard manifest lists every shard (the last capturing process merges the
    parts into ``manifest.json``)."""
    from .ranks import wait_for_markers

    wait_for_markers([directory / MANIFEST], None, "the complete shard manifest", poll_s, timeout_s)
    m = load_manifest(directory)  # raises ShardError when the nodes' part manifests disagree
    expected = m.get("num_shards")
    if expected is not None and len(m["shards"]) != expected:
        raise PlanError(f"{directory / MANIFEST}: lists {len(m['shards'])} of {expected} shards")
