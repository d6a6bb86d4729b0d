"""The bad inputs of a new user, tried as one would: each a real ``draftsmith`` command in its own
process on the test-suite's tiny Llama target, classed by what it did.

    python scripts/bad_input_trial.py [--workdir DIR] [--only SUBSTRING]     (from the repository root)

Prints one Markdown row per case: ``case | exit | class | last stderr line``, where the class is

- ``traceback``: stderr holds a Python traceback;
- ``lost``: a file the case's ``guard`` names (the user's data, shards, checkpoints) changed bytes;
- ``silent``: exit 0 where the case expects a refusal;
- ``ok``: the expected exit code and one ``error:`` line (or, for a case that should pass, exit 0).

Then the counts by class. Cases that need a prepared, trained and exported run share one, made
first (about a minute). It lives outside the package because it is built from the test-suite's
helpers (``tests/helpers``): the tiny target, its recipe overrides and prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@dataclass
class Case:
    name: str
    argv: list[str]
    expect: int  # the exit code a refusal has (0: the case should work)
    guard: list[Path] = field(default_factory=list)  # what must keep every byte
    setup: object = None  # () -> None, run before the command
    background: list[str] | None = None  # a command holding the run directory while this one runs


def tree_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.exists() else []
        for f in files:
            if f.name == ".draftsmith.lock":
                continue
            h.update(str(f).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def draftsmith(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftsmith.cli", *map(str, args)]


def run_case(case: Case, env: dict) -> tuple[int, str, str]:
    if case.setup is not None:
        case.setup()
    before = tree_hash(case.guard)
    holder = None
    if case.background:
        holder = subprocess.Popen(case.background, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(12)  # the holder has taken the lock and is working
    try:
        proc = subprocess.run(case.argv, env=env, capture_output=True, text=True, timeout=900)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    errs = [line for line in proc.stderr.splitlines() if line.strip()]
    last = next((line for line in reversed(errs) if "error" in line.lower()), errs[-1] if errs else "")
    if "Traceback (most recent call last)" in proc.stderr:
        cls = "traceback"
    elif tree_hash(case.guard) != before:
        cls = "lost"
    elif proc.returncode == 0 and case.expect != 0:
        cls = "silent"
    elif proc.returncode != case.expect:
        cls = f"unclear (exit {proc.returncode}, expected {case.expect})"
    else:
        cls = "ok"
    return proc.returncode, cls, last


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, help="where the runs go (default: a temporary folder)")
    p.add_argument("--only", help="run only the cases whose name contains this")
    args = p.parse_args()
    from helpers.recipes import tiny_recipe, write_prompts
    from helpers.tiny import build_tiny_target

    from draftsmith.recipe import dump_recipe

    work = args.workdir or Path(tempfile.mkdtemp(prefix="draftsmith-trial-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    target = build_tiny_target(work / "target")
    prompts = write_prompts(work / "chats.jsonl")
    recipe = tiny_recipe(target, prompts, max_steps=4)
    R = work / "r.yaml"
    dump_recipe(recipe, R)
    run = work / "runs" / "r1"
    for argv in (draftsmith("prepare", R, "--run-dir", run), draftsmith("train", R, "--run-dir", run),
                 draftsmith("export", run, "--out", work / "exp" / "r1")):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
    exp = work / "exp" / "r1"

    def copy_run(name: str) -> Path:
        dst = work / "runs" / name
        if not dst.exists():
            shutil.copytree(run, dst)
        return dst

    def foreign_source():
        d = copy_run("own") / "data"
        shutil.copy(prompts, d / "mychats.jsonl")

    edited = work / "edited.jsonl"
    shutil.copy(prompts, edited)

    def prepare_edited():
        subprocess.run(draftsmith("prepare", R, "--run-dir", work / "runs" / "ed", "--set",
                                  f"data.sources=[{{path: {edited}}}]"), env=env, capture_output=True)
        with edited.open("a") as fh:
            fh.write(json.dumps({"id": "p99", "prompt": "One more?"}) + "\n")

    def stale_profile():
        (exp / "speculation_profile.json").write_text(json.dumps({"schema_version": "1.0", "method": "dflash"}))

    bare = work / "bare"
    bare.mkdir(exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, bare / f.name)
    latin = work / "latin1.jsonl"
    latin.write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    own = work / "runs" / "own"
    cases = [
        Case("prepare --overwrite-data with the recipe's source inside data/",
             draftsmith("prepare", R, "--run-dir", own, "--overwrite-data", "--set",
                        f"data.sources=[{{path: {own / 'data' / 'mychats.jsonl'}}}]"), 1, [own], foreign_source),
        Case("prepare --overwrite-data while train holds the run (two processes)",
             draftsmith("prepare", R, "--run-dir", copy_run("conc"), "--overwrite-data", "--stage", "target"), 2,
             [work / "runs" / "conc" / "data"],
             background=draftsmith("train", R, "--run-dir", work / "runs" / "conc", "--overwrite",
                                   "--set", "train.max_steps=400")),
        Case("source edited in place, then prepare", draftsmith("prepare", R, "--run-dir", work / "runs" / "ed", "--set",
                                                               f"data.sources=[{{path: {edited}}}]"), 1,
             [work / "runs" / "ed"], prepare_edited),
        Case("source edited in place, then train", draftsmith("train", R, "--run-dir", work / "runs" / "ed", "--set",
                                                             f"data.sources=[{{path: {edited}}}]"), 1,
             [work / "runs" / "ed"]),
        Case("export into a folder holding a stale profile, then hub",
             draftsmith("hub", exp, "--out", work / "hub", "--repo-id", "user/draft"), 1, [exp], stale_profile),
        Case("train --resume --set draft.ttt_steps=5", draftsmith("train", R, "--run-dir", copy_run("res"), "--resume",
                                                                  "--set", "draft.ttt_steps=5"), 2,
             [work / "runs" / "res" / "checkpoints"]),
        Case("train --resume --set train.optimizer=muon", draftsmith("train", R, "--run-dir", copy_run("res"),
                                                                     "--resume", "--set", "train.optimizer=muon"), 2,
             [work / "runs" / "res" / "checkpoints"]),
        Case("prepare with data.max_length=1000000000", draftsmith("prepare", R, "--run-dir", work / "runs" / "ml",
                                                                   "--set", "data.max_length=1000000000"), 1),
        Case("train with data.max_length=1000000000", draftsmith("train", R, "--run-dir", work / "runs" / "ml",
                                                                 "--set", "data.max_length=1000000000"), 1),
        Case("prepare with draft.sliding_window beyond the context",
             draftsmith("prepare", R, "--run-dir", work / "runs" / "sw", "--set", "draft.sliding_window=1048576"), 1),
        Case("export --vllm 99.0", draftsmith("export", run, "--out", work / "exp" / "v99", "--vllm", "99.0"), 1),
        Case("export --vllm 0.34", draftsmith("export", run, "--out", work / "exp" / "v34", "--vllm", "0.34"), 1),
        Case("export of a folder without draft_config.json", draftsmith("export", work / "target", "--out",
                                                                        work / "exp" / "nd"), 1),
        Case("acceptance --max-prompts 0", draftsmith("acceptance", "--target", target, "--draft", exp,
                                                      "--max-prompts", "0"), 2),
        Case("acceptance --k 0", draftsmith("acceptance", "--target", target, "--draft", exp, "--k", "0"), 2),
        Case("acceptance --temperature -1", draftsmith("acceptance", "--target", target, "--draft", exp,
                                                       "--temperature", "-1"), 2),
        Case("acceptance --prompts missing", draftsmith("acceptance", "--target", target, "--draft", exp,
                                                        "--prompts", work / "nope.jsonl"), 1),
        Case("acceptance --prompts not UTF-8", draftsmith("acceptance", "--target", target, "--draft", exp,
                                                          "--prompts", latin), 1),
        Case("acceptance --max-model-len above the target's", draftsmith("acceptance", "--target", target, "--draft",
                                                                         exp, "--max-model-len", "100000"), 1),
        Case("prepare with a target folder without weights", draftsmith("prepare", R, "--run-dir", work / "runs" / "bw",
                                                                        "--set", f"target.name_or_path={bare}"), 1),
        Case("draftsmith --version", draftsmith("--version"), 0),
    ]
    counts: dict[str, int] = {}
    print("| case | exit | class | last stderr line |\n|---|---|---|---|")
    for case in cases:
        if args.only and args.only not in case.name:
            continue
        code, cls, last = run_case(case, env)
        counts[cls.split(" ")[0]] = counts.get(cls.split(" ")[0], 0) + 1
        print(f"| {case.name} | {code} | {cls} | `{last[:300]}` |", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
