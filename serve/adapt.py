"""``draftsmith adapt``: continue training a deployed EAGLE-3 draft on the traffic it served.

    draftsmith adapt --log traffic.jsonl --deployed DEPLOYED_EXPORT --recipe RECIPE.yaml \\
        --replay BASE_RUN/data/regen.jsonl --run-dir runs/adapt [--out runs/adapt/export/adapted] \\
        [--holdout 0.1] [--replay-share 0.25] [--min-conversations 64] [--budget-minutes 30] \\
        [--model SERVED_MODEL] [--swap http://127.0.0.1:8000] [--set key=value ...]

A vLLM deployment behind ``draftsmith proxy`` logs every completion it serves: the target's own
replies to the real prompts, i.e. self-distillation data of exactly the served domain, with no
regeneration. ``adapt`` turns that log into a new draft:

1. **Read** the log and its rotations (:func:`draftsmith.data_prep.traffic.read_traffic`):
   unparseable / truncated lines, failed requests, other models, raw ``/v1/completions``,
   replies the client or a broken stream cut, empty replies and repeated prompts are skipped and
   counted. Replies cut by ``max_tokens`` are the target's own tokens: they are kept (counted
   apart, ``traffic.cut`` in ``adapt.json``) and trained on without an end-of-turn label at the
   cut; ``--drop-cut-replies`` skips them.
2. **Hold out** ``--holdout`` of the prompts (seeded hash of the prompt, stable as the log grows)
   into ``RUN/traffic/heldout.jsonl``, for measuring the old and new drafts on unseen traffic
   (``draftsmith acceptance --prompts RUN/traffic/heldout.jsonl``).
3. **Refuse** a log with fewer than ``--min-conversations`` usable training conversations (exit 1
   with the counts; nothing is written).
4. **Replay**: a seeded sample of ``--replay`` (conversations with target-written replies, e.g.
   the base run's ``data/regen.jsonl``) makes ``--replay-share`` of the training conversations,
   the guard against forgetting the general distribution the draft was trained on.
5. **Prepare** (tokenise, draft vocab, hidden states; ``data.regenerate.enabled: false``: the
   served replies are used as they are) with the recipe's ``data.aux_layer_ids`` set to the
   deployed draft's, then **train** from the deployed draft (``draft.init_from``, checked to fit
   the target before any step) for what is left of ``--budget-minutes`` (``train.max_time_minutes``).
6. **Export** ``checkpoints/best`` (with ``data.validation_fraction``) or the last checkpoint to
   ``--out``, and with ``--swap`` ask a managed ``draftsmith proxy`` to serve it
   (``POST /draftsmith/swap``: in-flight requests finish on the old server).

The deployed draft is only read: ``--out`` may not be the deployed folder or inside it. Results
(counts, times, paths) go to ``RUN/adapt.json``; CPU time is user + system time of this process
and its children (seconds).
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data_prep.traffic import TrafficError, holdout_split, read_traffic
from ..layout import DraftLoadError, read_export
from ..methods import DraftMethodSpec, get_method, registered_methods
from ..recipe import dump_recipe, load_recipe


class AdaptError(ValueError):
    """The traffic, replay data or deployed draft cannot be adapted on; the message says why, with counts."""


@dataclass
class AdaptOptions:
    """One adaptation: ``draftsmith adapt``'s flags (:mod:`draftsmith.cli.adapt`), same names and meanings.

    Attributes:
        log: the traffic log (its rotations are read too); ``deployed``: the deployed draft's
            export folder (read only); ``recipe``: its recipe file, with ``overrides``
            (``KEY=VALUE``); ``run_dir``: the adaptation's run directory; ``out``: where the
            adapted draft is exported.
        replay: conversations with target-written replies to replay (None: no forgetting guard),
            making ``replay_share`` (in [0, 1)) of the training conversations.
        model: the served model name the log is filtered by (None: the one most requests name).
        holdout: share of the prompts held out; ``drop_cut_replies``: skip replies cut by
            ``max_tokens``; ``min_conversations``: fewer usable training conversations are refused.
        budget_minutes: wall-clock budget of preparation + training, of which
            ``export_reserve_minutes`` are kept for the export.
        seed: hold-out and replay sampling seed.
        swap: a managed proxy's URL to serve the new draft (None: no swap), with ``admin_token``.
        resume / overwrite: continue an interrupted adaptation in ``run_dir`` / start it over.
    """

    log: str
    deployed: str
    recipe: str
    run_dir: Path
    out: Path
    overrides: list[str]
    replay: str | None
    replay_share: float
    model: str | None
    holdout: float
    drop_cut_replies: bool
    min_conversations: int
    budget_minutes: float
    export_reserve_minutes: float
    seed: int
    swap: str | None
    admin_token: str | None
    resume: bool
    overwrite: bool


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def replay_sample(path: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` conversations (seeded sample, file order kept) of ``path`` that have an assistant reply.

    Raises:
        AdaptError: ``path`` unreadable or without any conversation with a reply.
    """
    from ..data_prep.conversations import DataError, load_records

    try:
        records, _ = load_records(path)
    except (DataError, OSError) as exc:
        raise AdaptError(f"--replay {path}: {exc}") from None
    usable = [r for r in records if any(m.get("role") == "assistant" for m in r.get("messages", []))]
    if not usable:
        raise AdaptError(f"--replay {path}: no conversation with an assistant reply (replay needs target-written "
                         "replies, e.g. the base run's data/regen.jsonl)")
    picked = sorted(random.Random(seed).sample(range(len(usable)), min(n, len(usable))))
    return [{"id": f"replay-{usable[i]['id']}", "messages": usable[i]["messages"]} for i in picked]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"], **({"cut": True} if r.get("cut") else {})},
                                       ensure_ascii=False) + "\n" for r in rows))
    return path


def adapted_method() -> DraftMethodSpec:
    """The draft method ``adapt`` continues (:mod:`draftsmith.methods`): the one whose recipe ``draft``
    section warm-starts from an export folder (``draft.init_from``), EAGLE-3."""
    return next(get_method(m) for m in registered_methods() if "init_from" in get_method(m).recipe_config.model_fields)


def deployed_config(path: Path) -> Any:
    """The deployed draft's config (:func:`adapted_method`'s ``config_class``; its aux layer ids fix
    the run's ``data.aux_layer_ids``).

    Raises:
        AdaptError: ``path`` is no export folder of that method.
    """
    try:
        config, _, _ = read_export(path, adapted_method().config_class.from_export)
    except DraftLoadError as exc:
        raise AdaptError(f"--deployed: {exc}") from None
    return config


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def plan(args: AdaptOptions) -> dict[str, Any]:
    """Steps 1-4 (read, hold out, refuse, replay) and the adapt recipe, in memory: nothing is
    written, so a refused log leaves the run directory as it was.

    Returns:
        ``{"recipe": Recipe, "files": {name: rows}, "traffic": report, "conversations": counts, ...}``.

    Raises:
        AdaptError: unusable log / replay / deployed draft, a too-small log, ``--out`` inside the deployment.
        RecipeError: the recipe with its overrides does not validate.
    """
    deployed, out, run = Path(args.deployed), Path(args.out), Path(args.run_dir)
    if _inside(out, deployed):
        raise AdaptError(f"--out {out} is the deployed draft {deployed} (or inside it): the deployment is never "
                         "overwritten; choose another folder")
    config = deployed_config(deployed)
    try:
        convs, report = read_traffic(args.log, args.model, keep_cut=not args.drop_cut_replies)
    except TrafficError as exc:
        raise AdaptError(str(exc)) from None
    train, held = holdout_split(convs, args.holdout, args.seed)
    if len(train) < args.min_conversations:
        raise AdaptError(f"{args.log}: too little traffic to adapt on: {len(train)} usable training conversations "
                         f"(need --min-conversations {args.min_conversations}; {len(held)} held out). "
                         f"{report.summary()}. The deployed draft is untouched.")
    n_replay = round(len(train) * args.replay_share / (1 - args.replay_share)) if args.replay else 0
    replay = replay_sample(args.replay, n_replay, args.seed) if n_replay else []
    tdir = (run / "traffic").resolve()
    files = {"train.jsonl": train, "replay.jsonl": replay, "heldout.jsonl": held}
    sources = [{"path": str(tdir / name), "format": "messages"} for name in ("train.jsonl", "replay.jsonl")
               if files[name]]
    overrides = list(args.overrides) + [
        f"data.sources={json.dumps(sources)}",
        "data.regenerate.enabled=false",
        "data.max_samples=null",
        f"data.aux_layer_ids={json.dumps(list(config.aux_layer_ids))}",
        f"draft.init_from={json.dumps(str(deployed.resolve()))}",
    ]
    if held:
        overrides.append(f"data.eval_prompts={json.dumps(str(tdir / 'heldout.jsonl'))}")
    recipe = load_recipe(args.recipe, overrides)
    method = adapted_method()
    if recipe.draft.method != method.name:
        raise AdaptError(f"{args.recipe}: draft.method is {recipe.draft.method}; adapt continues "
                         f"{method.format.layout} drafts")
    return {"recipe": recipe, "files": files, "traffic": report.to_dict(),
            "conversations": {"traffic_train": len(train), "heldout": len(held), "replay": len(replay)},
            "heldout_path": str(tdir / "heldout.jsonl") if held else None, "deployed": str(deployed), "out": str(out)}


def write_plan(p: dict[str, Any], run: Path) -> Path:
    """Write ``RUN/traffic/*.jsonl``, ``traffic/report.json``, ``plan.json`` and ``adapt_recipe.yaml``
    (returned: the recipe the stages run)."""
    for name, rows in p["files"].items():
        if rows:
            _write_jsonl(run / "traffic" / name, rows)
    (run / "traffic" / "report.json").write_text(json.dumps(p["traffic"], indent=1))
    (run / "plan.json").write_text(json.dumps({k: v for k, v in p.items() if k not in ("recipe", "files")}, indent=1))
    recipe_path = run / "adapt_recipe.yaml"
    dump_recipe(p["recipe"], recipe_path)
    return recipe_path


def swap(proxy_url: str, draft: Path, admin_token: str | None, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Ask a managed ``draftsmith proxy`` to serve ``draft`` (``POST /draftsmith/swap``); returns its answer.

    Raises:
        AdaptError: the proxy refused or could not be reached (its answer / the error).
    """
    import urllib.error
    import urllib.request

    from ..vllm_bridge.net import LOOPBACK
    from .proxy import ADMIN_HEADER

    req = urllib.request.Request(f"{proxy_url.rstrip('/')}/draftsmith/swap", method="POST",
                                 data=json.dumps({"draft": str(draft.resolve())}).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({ADMIN_HEADER: admin_token} if admin_token else {})})
    try:
        with LOOPBACK.open(req, timeout=timeout_s) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as exc:
        raise AdaptError(f"proxy {proxy_url} refused the swap ({exc.code}): {exc.read().decode()[-2000:]}") from None
    except OSError as exc:
        raise AdaptError(f"proxy {proxy_url}: {exc}") from None


def adapt(args: AdaptOptions) -> dict[str, Any]:
    """All six steps; returns what ``RUN/adapt.json`` holds. The stages run in this process, as
    ``draftsmith prepare`` and ``draftsmith train --no-prepare`` would (their summaries printed to
    stdout, a failed stage's message to stderr).

    Raises:
        AdaptError, RecipeError: see :func:`plan`; a preparation or training stage that failed
            (its exit code; its own message went to stderr).
    """
    from types import SimpleNamespace

    from ..data_prep.agreement import recipe_arg
    from ..data_prep.ranks import PREPARE_ERRORS, prepare_run
    from ..eval.export import export, resolve_checkpoint
    from ..procs import install_child_reaper
    from ..run_lock import LOCK_FILE
    from ..train.run import fit_summary, train, train_errors

    wall0, cpu0 = time.monotonic(), cpu_seconds()
    run = Path(args.run_dir)
    if args.resume and (run / "plan.json").is_file():  # the traffic as first read, not the grown log
        p = json.loads((run / "plan.json").read_text())
        recipe_path = run / "adapt_recipe.yaml"
        p["recipe"] = load_recipe(recipe_path)
    else:
        if run.exists() and any(f.name != LOCK_FILE for f in run.iterdir()) and not args.overwrite:
            raise AdaptError(f"{run} is not empty: --resume continues that adaptation, --overwrite starts over")
        p = plan(args)  # refuses before anything in RUN_DIR is touched
        for sub in ("traffic", "data", "checkpoints", "export", "plan.json", "adapt_recipe.yaml", "adapt.json"):
            old = run / sub
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        recipe_path = write_plan(p, run)
    install_child_reaper()  # engine processes die with this one, SIGKILL included
    try:
        summary = prepare_run(load_recipe(recipe_path), run, recipe_arg=recipe_arg(SimpleNamespace(recipe=recipe_path)))
    except PREPARE_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise AdaptError(f"preparing {run}/data failed (exit 1); see the error above") from None
    print(json.dumps(summary, indent=1))
    prepare_s = time.monotonic() - wall0
    left = args.budget_minutes - prepare_s / 60 - args.export_reserve_minutes
    if left <= 0.5:
        raise AdaptError(f"preparing took {prepare_s / 60:.1f} min of the {args.budget_minutes} min budget: no time "
                         "left to train (raise --budget-minutes or shorten the log)")
    recipe = p["recipe"]
    budget = left if recipe.train.max_time_minutes is None else min(left, recipe.train.max_time_minutes)
    overrides = [f"train.max_time_minutes={budget:.2f}"]
    refused, failed = train_errors()
    try:
        fitted = train(load_recipe(recipe_path, overrides), run, resume=args.resume, overwrite=not args.resume,
                       prepare=False, recipe_arg=recipe_arg(SimpleNamespace(recipe=recipe_path, overrides=overrides)),
                       recipe_file=str(recipe_path))
    except (*refused, *failed) as exc:
        print(f"draftsmith train: error: {exc}", file=sys.stderr)
        raise AdaptError(f"training in {run} failed (exit {2 if isinstance(exc, refused) else 1}); "
                         "see the error above") from None
    print(json.dumps(fit_summary(run, fitted), indent=1))
    best = run / "checkpoints" / "best"
    ckpt = best if best.is_dir() else resolve_checkpoint(run)
    out = export(ckpt, Path(args.out), num_speculative_tokens=recipe.eval.num_speculative_tokens)
    result = {**{k: v for k, v in p.items() if k not in ("recipe", "files")},
              "recipe": str(recipe_path), "checkpoint": str(ckpt), "out": str(out),
              "prepare_seconds": round(prepare_s, 1), "train_minutes_budget": round(budget, 2),
              "wall_seconds": round(time.monotonic() - wall0, 1), "cpu_seconds": round(cpu_seconds() - cpu0, 1)}
    if args.swap:
        result["swap"] = swap(args.swap, out, args.admin_token)
    (run / "adapt.json").write_text(json.dumps(result, indent=1))
    return result
