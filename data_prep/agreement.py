"""A run directory's data agrees with the recipe, or nothing is written.

``RUN_DIR/data`` is made for one recipe's data keys: the target, the aux layer ids, the
tokenisation (sources, regeneration, ``max_length``, over-long policy, harmony channels,
``data.history_turns`` where the template rewrites history, the target's chat template), the
draft vocab size and the shard storage (dtype, capture dtype, shard size). Before any stage
writes (every stage of ``draftsmith prepare``, training and its automatic prepare of missing
stages), :func:`check_run_dir` compares the keys the stages already on disk were made with
against the recipe; a disagreement raises :class:`RunDirMismatchError`, one line naming the key,
both values and the two ways out (a fresh ``--run-dir``, or ``draftsmith prepare RECIPE
--run-dir DIR --overwrite-data``), and nothing is written.

What is on disk is read from the files each stage leaves (:class:`~draftsmith.layout.DataPaths`):

- ``target.json``: the target and, without shards, the aux layer ids;
- ``hidden_states/manifest.json`` (and per-rank parts): the aux layer ids the shards were
  captured at (the truth training reads), their dtype, and the shard layout;
- ``vocab.safetensors``: the draft vocab size (rows of ``d2t``);
- ``spec.json``: the rest, per stage (``target``, ``tokenize``, ``vocab``, ``hidden-states``), as
  :func:`record_stage` wrote it when that stage last ran (data prepared before it existed is
  compared on what the other files record).

A stage's keys are compared only when its output is on disk: a stage whose output is missing
is prepared from the recipe anyway. The shard layout (``data.sequences_per_shard``,
``data.shard_bytes``) is compared only when shards are to be written: training reads shards of
any layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..layout import DataPaths, RunLayout
from ..target import TargetInfo, aux_layer_ids
from .conversations import DataError
from .fingerprint import describe_change, fingerprint, normalised_source

SPEC_VERSION = 1


class RunDirMismatchError(DataError):
    """The run directory's data was prepared with other recipe keys; one line (key, both values,
    the two ways out). Raised before anything is written."""


def remedy(run_dir: Path | str, recipe_arg: str | None = None) -> str:
    """The two ways out of a disagreement, as one clause."""
    return (f"use a fresh --run-dir, or start this one's data over with: draftsmith prepare "
            f"{recipe_arg or 'RECIPE'} --run-dir {run_dir} --overwrite-data")


def recipe_arg(args: Any) -> str:
    """The recipe as the command line named it (``args.recipe`` and its ``--set`` overrides), for
    the command a message suggests."""
    import shlex

    overrides = [f"--set {shlex.quote(o)}" for o in getattr(args, "overrides", [])]
    return " ".join([shlex.quote(str(args.recipe)), *overrides])


def mismatch_message(run_dir: Path | str, key: str, on_disk: Any, where: Path | str, wanted: Any,
                     recipe_arg: str | None = None) -> str:
    """The one line of :class:`RunDirMismatchError` (a changed source's content: what changed)."""
    if key.startswith(f"{CONTENT_KEY}:"):
        return (f"{wanted['path']} changed since {Path(run_dir) / 'data'} was tokenised from it "
                f"({describe_change(on_disk, wanted)}; recorded in {where}); nothing was written: "
                f"{remedy(run_dir, recipe_arg)}")
    return (f"{Path(run_dir) / 'data'} was prepared with {key}={_show(on_disk)} ({where}), the recipe has "
            f"{_show(wanted)}; nothing was written: {remedy(run_dir, recipe_arg)}")


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, str)) or value is None else str(value)


def read_spec(paths: DataPaths) -> dict[str, dict[str, Any]]:
    """``spec.json`` (``{stage: {recipe key: value}}``); empty when there is none or it is unreadable."""
    try:
        spec = json.loads(paths.spec.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in spec.items() if isinstance(v, dict)} if isinstance(spec, dict) else {}


def record_stage(paths: DataPaths, stage: str, values: dict[str, Any]) -> None:
    """Note in ``spec.json`` the recipe keys ``stage`` writes its output with (atomically; the
    other stages' entries are kept). Called by each stage of ``prepare`` before it writes."""
    from ..fileio import atomic_write_bytes

    spec = read_spec(paths)
    spec[stage] = values
    spec["format"] = {"version": SPEC_VERSION}
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(paths.spec, json.dumps(spec, indent=1, sort_keys=True).encode())


def target_keys(recipe: Any, aux_layer_ids: list[int]) -> dict[str, Any]:
    """The ``target`` stage's keys (``aux_layer_ids``: as resolved for the target)."""
    return {"target.name_or_path": recipe.target.name_or_path, "data.aux_layer_ids": list(aux_layer_ids)}


def tokenize_keys(recipe: Any, chat_template_sha256: str | None, history: bool = True) -> dict[str, Any]:
    """The keys that fix the tokenised data: the sources and how many rows, the regeneration
    (its engine, batching and servers excepted: the regeneration cache keeps its own
    fingerprints), the length and over-long policy, the harmony channels, the chat template and the
    kwargs it is rendered with (``data.chat_template_kwargs``, recorded when set), and
    ``data.history_turns`` when ``history``: the tokenize stage records it only when the chat
    template rewrote an earlier reply of some conversation (else both values give the same rows,
    and data tokenised before the key existed has none), so it is compared only where it matters."""
    d, r = recipe.data, recipe.data.regenerate
    keys = {"data.sources": [normalised_source(s.model_dump(mode="json")) for s in d.sources],
            "data.max_samples": d.max_samples,
            "data.max_length": d.max_length, "data.overlong": d.overlong,
            "data.harmony_channels": list(d.harmony_channels), "data.regenerate.enabled": r.enabled,
            **({"data.chat_template_kwargs": dict(d.chat_template_kwargs)} if d.chat_template_kwargs else {}),
            **({"data.history_turns": d.history_turns} if history else {}),
            "chat_template_sha256": chat_template_sha256}
    if r.enabled:
        keys.update({"data.regenerate.max_new_tokens": r.max_new_tokens,
                     "data.regenerate.temperatures": list(r.temperatures),
                     "data.regenerate.samples_per_prompt": r.samples_per_prompt,
                     "data.regenerate.reasoning_effort": r.reasoning_effort})
    return keys


def source_contents(recipe: Any, recorded: list[Any] | None = None) -> list[dict[str, Any] | None]:
    """Per ``data.sources`` entry, its :func:`~draftsmith.data_prep.fingerprint.fingerprint` (None
    for a hub dataset or builtin set); ``recorded``: the fingerprints ``spec.json`` holds, whose
    sha256 is reused for a file of the same size and mtime (read once)."""
    recorded = recorded if isinstance(recorded, list) else []
    return [fingerprint(s.path, recorded[i] if i < len(recorded) and isinstance(recorded[i], dict) else None)
            for i, s in enumerate(recipe.data.sources)]


def vocab_keys(recipe: Any, target_vocab_size: int) -> dict[str, Any]:
    """The vocab stage's key: the draft vocab size as built (capped at the target vocab)."""
    return {"data.draft_vocab_size": min(recipe.data.draft_vocab_size, int(target_vocab_size))}


def hidden_states_keys(recipe: Any, aux_layer_ids: list[int]) -> dict[str, Any]:
    """The hidden-states stage's keys: the layers, the storage dtype, the dtype the target ran at
    (the states are those of that dtype), and the shard layout."""
    d = recipe.data
    return {"data.aux_layer_ids": list(aux_layer_ids), "data.hidden_states_dtype": d.hidden_states_dtype,
            "target.dtype": recipe.target.dtype, "data.sequences_per_shard": d.sequences_per_shard,
            "data.shard_bytes": d.shard_bytes}


LAYOUT_KEYS = ("data.sequences_per_shard", "data.shard_bytes")
CONTENT_KEY = "data.sources.content"  # spec.json's tokenize entry: the sources' fingerprints


def wanted_aux_layer_ids(recipe: Any, info: TargetInfo | None) -> list[int] | None:
    """The aux layer ids the recipe asks for: its own, else the default of the target in
    ``info`` (``target.json``; None without it)."""
    if info is None or info.num_hidden_layers is None:
        return list(recipe.data.aux_layer_ids) if recipe.data.aux_layer_ids else None
    return aux_layer_ids(recipe.data.aux_layer_ids, int(info.num_hidden_layers))


def captured_aux_layer_ids(paths: DataPaths) -> list[int] | None:
    """The aux layer ids the shards of ``paths`` were captured at (their manifest), or None
    without shards."""
    from .shards import load_manifest

    manifest = load_manifest(paths.hidden_states) if paths.hidden_states.is_dir() else None
    return None if manifest is None else list(manifest["aux_layer_ids"])


def _vocab_rows(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return int(fh.get_slice("d2t").get_shape()[0])


def chat_template_of(info: TargetInfo, trust_remote_code: bool = False) -> str | None:
    """The sha256 of the chat template of the target in ``info`` (``target.json``); None when
    its tokenizer does not load from there (not compared then: the stages that need the target
    say so themselves)."""
    from transformers import AutoTokenizer

    from .regenerate import chat_template_sha256

    try:
        tok = AutoTokenizer.from_pretrained(info.path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a moved or missing target is reported where it is loaded
        return None
    return chat_template_sha256(tok)


def disagreements(recipe: Any, run_dir: Path | str,
                  stages: list[str] | None = None) -> list[tuple[str, Any, Path, Any]]:
    """Every ``(key, value on disk, file that records it, value of the recipe)`` that differs,
    most telling first (the target, the layers, the storage, the vocab, the tokenisation).

    Args:
        stages: the stages about to run (None: none; training reads what is there): the shard
            layout is compared only when ``hidden-states`` is among them.
    """
    from .shards import MANIFEST, load_manifest

    run_dir = Path(run_dir)
    paths = RunLayout(run_dir).data
    if not paths.root.is_dir():
        return []
    stages = stages or []
    out: list[tuple[str, Any, Path, Any]] = []

    def compare(key: str, on_disk: Any, where: Path, wanted: Any) -> None:
        if wanted is not None and on_disk != wanted:
            out.append((key, on_disk, where, wanted))

    spec = read_spec(paths)
    info = TargetInfo.read(paths.target_info) if paths.target_info.is_file() else None
    offline = recipe.data.hidden_states_mode == "offline"
    manifest = load_manifest(paths.hidden_states) if paths.hidden_states.is_dir() else None
    manifest_file = paths.hidden_states / MANIFEST
    same_target = True
    if info is not None:
        compare("target.name_or_path", info.name_or_path, paths.target_info, recipe.target.name_or_path)
        same_target = info.name_or_path == recipe.target.name_or_path
    elif manifest is not None:
        compare("target.name_or_path", manifest.get("target"), manifest_file, recipe.target.name_or_path)
    aux = wanted_aux_layer_ids(recipe, info if same_target else None)
    if manifest is not None and offline:  # what the shards hold: what training reads
        compare("data.aux_layer_ids", list(manifest["aux_layer_ids"]), manifest_file, aux)
        compare("data.hidden_states_dtype", manifest.get("dtype"), manifest_file, recipe.data.hidden_states_dtype)
        recorded = spec.get("hidden-states", {})
        if "target.dtype" in recorded:
            compare("target.dtype", recorded["target.dtype"], paths.spec, recipe.target.dtype)
        if "hidden-states" in stages:
            compare("data.sequences_per_shard", manifest.get("sequences_per_shard"), manifest_file,
                    recipe.data.sequences_per_shard)
            if manifest.get("shard_bytes") != recipe.data.shard_bytes:
                out.append(("data.shard_bytes", manifest.get("shard_bytes"), manifest_file, recipe.data.shard_bytes))
    elif info is not None and info.aux_layer_ids is not None:
        compare("data.aux_layer_ids", list(info.aux_layer_ids), paths.target_info, aux)
    if info is not None and same_target and paths.vocab.is_file():
        compare("data.draft_vocab_size", _vocab_rows(paths.vocab), paths.vocab,
                vocab_keys(recipe, info.vocab_size)["data.draft_vocab_size"])
    recorded = spec.get("tokenize")
    if recorded and paths.tokenized_done.is_file():
        want = tokenize_keys(recipe, None)
        for key, value in want.items():
            if key in recorded and key != "chat_template_sha256":
                on_disk = recorded[key]
                if key == "data.sources" and isinstance(on_disk, list):  # the same file by another path
                    on_disk = [normalised_source(x) if isinstance(x, dict) else x for x in on_disk]
                if on_disk != value:
                    out.append((key, recorded[key], paths.spec, value))
        contents = recorded.get(CONTENT_KEY)
        if not out and isinstance(contents, list):  # a source edited in place: same path, other bytes
            for src, old, new in zip(recipe.data.sources, contents, source_contents(recipe, contents)):
                if isinstance(old, dict) and new is not None and old.get("sha256") != new["sha256"]:
                    out.append((f"{CONTENT_KEY}:{src.path}", old, paths.spec, new))
        if not out and recorded.get("chat_template_sha256") and info is not None and same_target:
            compare("the target's chat template (sha256)", recorded["chat_template_sha256"], paths.spec,
                    chat_template_of(info, recipe.target.trust_remote_code))
    return out


def check_run_dir(recipe: Any, run_dir: Path | str, stages: list[str] | None = None,
                  recipe_arg: str | None = None) -> None:
    """Refuse a run directory whose data disagrees with ``recipe`` (:func:`disagreements`).
    Reads only; call it before any stage writes.

    Args:
        stages: the stages about to run (the shard layout counts only when shards are written).
        recipe_arg: the recipe as the user named it (for the command in the message).

    Raises:
        RunDirMismatchError: one line naming the first key that differs, both values and the way out.
    """
    found = disagreements(recipe, run_dir, stages)
    if found:
        key, on_disk, where, wanted = found[0]
        raise RunDirMismatchError(mismatch_message(run_dir, key, on_disk, where, wanted, recipe_arg))


# What draftsmith writes under RUN_DIR/data (prepare, its launch children, the regeneration
# server's log, atomic writes' temporaries) and under data/hidden_states (shards, manifests, their
# temporaries, vLLM's work folder): --overwrite-data deletes these and nothing else.
DATA_FILES = ("target.json", "regen.jsonl", "regen.node-*-of-*.jsonl", "regen_server*.log", "stats.json",
              "vocab.safetensors", "summary.json", "spec.json", "plan.json", "prepare.recipe.yaml",
              ".prepare-session", ".early-stages.done", ".node-*-of-*.done", ".regen.node-*-of-*.done", ".*.tmp-*")
DATA_DIRS = ("tokenized", ".tokenized.tmp-*", "procs", "logs")
SHARD_FILES = ("shard-*.safetensors", "manifest.json", "manifest.rank-*.json", "manifest*.json", "scores.json",
               ".*.tmp-*")
SHARD_DIRS = (".vllm-work",)


class ForeignDataError(DataError):
    """``--overwrite-data`` refused: ``RUN_DIR/data`` holds files draftsmith did not write, or a
    source of the recipe; nothing was deleted."""


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pat) for pat in patterns)


def data_files(run_dir: Path | str) -> tuple[list[Path], list[Path]]:
    """``(ours, foreign)``: the entries of ``RUN_DIR/data`` draftsmith wrote (files, and folders
    it owns whole) and every file it did not write (listed file by file)."""
    root = RunLayout(Path(run_dir)).data.root
    ours: list[Path] = []
    foreign: list[Path] = []
    if not root.is_dir():
        return ours, foreign
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            if _matches(entry.name, DATA_DIRS):
                ours.append(entry)
            elif entry.name == "hidden_states":
                mine, other = [], []
                for sub in sorted(entry.iterdir()):
                    is_dir = sub.is_dir() and not sub.is_symlink()
                    if _matches(sub.name, SHARD_DIRS if is_dir else SHARD_FILES):
                        mine.append(sub)
                    else:
                        other.extend(sorted(p for p in sub.rglob("*") if not p.is_dir()) if is_dir else [sub])
                ours.extend(mine if other else [entry])
                foreign.extend(other)
            else:
                foreign.extend(sorted(p for p in entry.rglob("*") if not p.is_dir()) or [entry])
        elif _matches(entry.name, DATA_FILES):
            ours.append(entry)
        else:
            foreign.append(entry)
    return ours, foreign


def sources_inside(recipe: Any, run_dir: Path | str) -> list[Path]:
    """The recipe's local source files that lie inside ``RUN_DIR/data``."""
    from .fingerprint import local_file

    root = RunLayout(Path(run_dir)).data.root.resolve()
    found = [local_file(s.path) for s in recipe.data.sources]
    return [f for f in found if f is not None and f.is_relative_to(root)]


def overwrite_plan(recipe: Any, run_dir: Path | str) -> list[Path]:
    """What ``--overwrite-data`` deletes (:func:`data_files`' ours), after refusing when there is
    anything else in ``RUN_DIR/data``.

    Raises:
        ForeignDataError: one line naming the recipe's own source kept in ``data/`` or the files
            draftsmith did not write (the first few, and how many); nothing is deleted.
    """
    root = RunLayout(Path(run_dir)).data.root
    inside = sources_inside(recipe, run_dir)
    if inside:
        raise ForeignDataError(
            f"--overwrite-data: {inside[0]} is a source of this recipe and lies inside {root}, which --overwrite-data "
            f"starts over; nothing was deleted: keep the recipe's sources outside the run directory")
    ours, foreign = data_files(run_dir)
    if foreign:
        names = ", ".join(str(p) for p in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ForeignDataError(
            f"--overwrite-data: {root} holds files draftsmith did not write ({names}); nothing was deleted: move "
            f"them out of {root}, or use a fresh --run-dir")
    return ours


def remove_data(recipe: Any, run_dir: Path | str) -> list[Path]:
    """``--overwrite-data``: delete what draftsmith wrote under ``RUN_DIR/data``
    (:func:`overwrite_plan`, which refuses first when anything else is there); returns what was
    removed (empty when there was nothing)."""
    import shutil

    removed = overwrite_plan(recipe, run_dir)
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    return removed
