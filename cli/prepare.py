"""``draftsmith prepare``: the data stages of a recipe (the command line of :mod:`draftsmith.data_prep.prepare`).

Also the module torchrun runs on every rank (``torchrun ... -m draftsmith.cli.prepare``) and the
data-stage children :mod:`draftsmith.data_prep.launch` start (``--node`` / ``--capture-share``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from ..data_prep import prepare as prep
from ..recipe import add_recipe_arguments, recipe_from_args
from ..runtime import HelpFormatter, setup_logging

log = logging.getLogger("draftsmith.prepare")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``data_prep/prepare.py`` (``draftsmith prepare``)."""
    from ..target import DEVICE_HELP

    p = argparse.ArgumentParser(description=prep.__doc__, formatter_class=HelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", required=True, type=Path, help="run directory; the data lands in RUN_DIR/data")
    p.add_argument("--stage", action="append", choices=prep.STAGES, help="run only these stages (repeatable; default: all)")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--dry-run", action="store_true",
                   help="print the data plan (engines, devices, shards, disk, read bandwidth) and exit; no weights")
    p.add_argument("--nodes", type=int, help="with --dry-run: nodes of the job (default: this one)")
    p.add_argument("--gpus-per-node", type=int, help="with --dry-run: GPUs per node (default: the GPUs seen here)")
    p.add_argument("--device-memory-gib", type=float, help="with --dry-run: memory of one GPU (default: GPU 0's, or 80)")
    p.add_argument("--node", metavar="N/NODES",
                   help="run node N's share of the data stage (the data-stage child of a multi-node launch: "
                        "regeneration of conversations i %% NODES == N, and with --stage hidden-states its shards)")
    p.add_argument("--capture-share", metavar="I/COUNT",
                   help="capture only the hidden-state shards i %% COUNT == I (a rank's capture child)")
    p.add_argument("--session", help="launch id written into the done markers (set by the launching ranks)")
    p.add_argument("--verify-shards", action="store_true",
                   help="hash the hidden-state shards already on disk against their manifest sha256 before keeping "
                        "them (default: their size and safetensors header are checked); a bad one is recomputed")
    p.add_argument("--overwrite-data", action="store_true",
                   help="delete what draftsmith wrote under RUN_DIR/data first and prepare it afresh (refused when "
                        "data/ holds anything else; with --dry-run: what it would delete). A run directory whose data "
                        "was prepared with other recipe keys is otherwise refused before anything is written")
    return p


def main(argv: list[str] | None = None) -> int:
    """``draftsmith prepare``: exit 0; 1 when a check or a stage fails (one line); 2 when the run
    directory is in use by another command (its lock names the holder)."""
    from ..data_prep.ranks import PREPARE_ERRORS, bind_local_device, prepare_node, prepare_run

    bind_local_device()  # before anything can initialise CUDA or import vLLM
    args = build_parser().parse_args(argv)
    setup_logging()
    recipe = recipe_from_args(args)
    from ..data_prep.agreement import check_run_dir, recipe_arg
    from ..data_prep.plan import parse_share
    from ..data_prep.shards import distributed_rank
    from ..layout import RunLayout
    from ..procs import install_child_reaper
    from ..run_lock import RunDirLockedError, command_line, run_dir_lock

    try:
        if args.dry_run:
            print(dry_run_report(recipe, args))
            return 0
        install_child_reaper()  # engine processes die with this one, SIGKILL included
        child = bool(args.node or args.capture_share)  # the launching ranks checked the run directory
        if child:
            if not args.overwrite_data:
                # before this process writes anything (its record, any stage)
                check_run_dir(recipe, args.run_dir, [s for s in prep.STAGES if s in (args.stage or prep.STAGES)],
                              recipe_arg(args))
            args.run_dir.mkdir(parents=True, exist_ok=True)
            paths = RunLayout(args.run_dir).data
            node = parse_share(args.node, "--node") if args.node else None
            share = parse_share(args.capture_share, "--capture-share") if args.capture_share else None
            role = f"node-{node[0]}" if node else f"capture-{share[0]}"
            record = prep.process_record(paths, role, node=node and node[0], share=share and share[0])
            stages = [s for s in prep.STAGES if s in (args.stage or prep.STAGES)]
            if node:
                summary = prepare_node(recipe, args.run_dir, stages, node[0], node[1], args.session or "", record=record)
            else:
                summary = prep.prepare(recipe, args.run_dir, stages, args.device, capture_share=share, record=record)
        else:
            main_rank = distributed_rank()[0] == 0
            # one writer per run directory: rank 0 of the job holds the lock (the other ranks and the
            # data-stage children are the same command)
            with run_dir_lock(args.run_dir, command_line(argv, "draftsmith prepare")) if main_rank \
                    else contextlib.nullcontext():
                # every check the dry run makes, before any stage works
                prep.preflight_run(recipe, args.stage or prep.STAGES)
                if args.overwrite_data and main_rank:
                    from ..data_prep.agreement import remove_data

                    removed = remove_data(recipe, args.run_dir)
                    if removed:
                        log.warning("--overwrite-data: removed %d entries draftsmith wrote under %s; preparing it "
                                    "afresh", len(removed), RunLayout(args.run_dir).data.root)
                summary = prepare_run(recipe, args.run_dir, args.stage, args.device, verify_shards=args.verify_shards,
                                      recipe_arg=recipe_arg(args), check=not args.overwrite_data)
    except RunDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PREPARE_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if distributed_rank()[0] == 0:
        print(json.dumps(summary, indent=1))
    return 0


def dry_run_report(recipe, args: argparse.Namespace) -> str:
    """What ``prepare --dry-run`` prints: the data plan, then what the real run would refuse (the
    recipe against its target, the run directory's data against the recipe) and, with
    ``--overwrite-data``, what it would delete. Writes nothing."""
    from ..data_prep.agreement import ForeignDataError, disagreements, mismatch_message, overwrite_plan, recipe_arg
    from ..fileio import tree_bytes
    from ..data_prep.plan import Cluster, human_bytes
    from ..layout import RunLayout

    cluster = Cluster.detect(args.nodes, args.gpus_per_node, args.device_memory_gib)
    lines = [prep.data_plan(recipe, args.run_dir, None, args.stage, cluster).format()]
    try:
        prep.preflight_run(recipe, args.stage or prep.STAGES)
    except (ValueError, FileNotFoundError) as exc:
        lines.append(f"the real run refuses the recipe: {exc}")
    if args.overwrite_data:
        try:
            doomed = overwrite_plan(recipe, args.run_dir)
            root = RunLayout(args.run_dir).data.root
            names = [p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in doomed]
            shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            size = human_bytes(sum(map(tree_bytes, doomed)))
            lines.append(f"--overwrite-data would delete {len(doomed)} entries ({size}) "
                         f"draftsmith wrote under {root}: {shown}" if doomed else "--overwrite-data: nothing to delete")
        except ForeignDataError as exc:
            lines.append(f"the real run refuses: {exc}")
    else:
        stages = [s for s in prep.STAGES if s in (args.stage or prep.STAGES)]
        for key, on_disk, where, wanted in disagreements(recipe, args.run_dir, stages):
            lines.append("the real run refuses: " + mismatch_message(args.run_dir, key, on_disk, where, wanted,
                                                                     recipe_arg(args)))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
