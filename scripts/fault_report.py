"""Fault and bad-input report: what draftsmith does with bad data and what survives a crash.

    python scripts/fault_report.py [--workdir DIR] [--seed 0]     (from the repository root)

Runs on the test-suite's tiny random target (``tests/helpers/tiny.py``: H=128, 6 layers, V=512,
built in code; minutes on CPU). Prints two Markdown tables:

- bad inputs: ``input | outcome | message``, the message being the text actually raised
  (or logged) by the pipeline for that input;
- faults: SIGKILL of training at a seeded random step, SIGTERM, a crash in the middle of a
  checkpoint save, NaN losses, SIGKILL of data preparation; for each, what survived: optimizer
  steps lost, tokens recomputed, and the max |param diff| of the resumed run against an
  uninterrupted one (fp32 CPU: expected 0);
- launcher kills: one of 2 CPU processes under DeepSpeed ZeRO-2 and FSDP2 killed (SIGKILL)
  mid-epoch and during a checkpoint write (``tests/helpers/launcher_kills.py``): seconds from the kill to
  the job's exit, steps lost, and the max |param diff| after ``--resume`` (``--no-launchers``
  skips these runs, the slowest part).

It lives outside the package because it is built from the test-suite: the fault injectors and
helpers come from ``tests/helpers/faults.py`` (shared with the resume tests), the tiny target
and recipe from ``tests/helpers/tiny.py`` and ``tests/helpers/recipes.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from helpers.faults import (  # noqa: E402
    FAULT_TRAIN,
    PREP_KILLER,
    FaultyEagle3,
    checkpoint_step,
    curve_diff,
    final_params,
    max_param_diff,
    read_metrics,
    train_cmd,
    wait_for_step,
)
from helpers.launcher_kills import format_kill_table, launcher_kill_rows  # noqa: E402
from helpers.recipes import PROMPTS, tiny_recipe  # noqa: E402
from helpers.tiny import build_tiny_target, write_jsonl  # noqa: E402

from draftsmith.recipe import Recipe, dump_recipe  # noqa: E402
from draftsmith.train.checkpoint import find_checkpoints  # noqa: E402
from draftsmith.models.eagle3.training import Eagle3Method  # noqa: E402


# ---------------------------------------------------------------------------------------------
# the tiny run


def tiny_setup(work: Path) -> tuple[Recipe, Path, Path]:
    """Build the tiny target, prompts and recipe of the test-suite and prepare its data.

    Returns ``(recipe, prepared run dir, target dir)``."""
    from draftsmith.data_prep.prepare import prepare

    target = build_tiny_target(work / "target")
    prompts = write_jsonl(work / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(target, prompts)
    for k, v in FAULT_TRAIN.items():
        setattr(recipe.train, k, v)
    run = work / "prepared"
    prepare(recipe, run)
    return recipe, run, target


def fresh_run(prepared: Path, run: Path) -> Path:
    shutil.copytree(prepared / "data", run / "data")
    return run


# ---------------------------------------------------------------------------------------------
# bad inputs: each returns (outcome, message)


def outcome_of(fn: Callable[[], str | None]) -> tuple[str, str]:
    try:
        message = fn()
    except Exception as exc:  # the point: show what the pipeline raises
        return f"refused ({type(exc).__name__})", str(exc)
    return "continues: skipped or capped, counted", message or ""


def bad_inputs(work: Path, recipe: Recipe, prepared: Path, target: Path) -> list[tuple[str, str, str]]:
    from draftsmith.data_prep import conversations as conv
    from draftsmith.train.data import HiddenStateDataset
    from draftsmith.data_prep.prepare import DataPaths, stage_tokenize, stage_vocab
    from draftsmith.eval.acceptance import check_draft_matches_target
    from draftsmith.eval.export import export
    from draftsmith.layout import DraftCheckpointConfig, safe_path
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.model import Eagle3DraftModel
    from draftsmith.recipe import load_recipe
    from draftsmith.target import TargetInfo, validate_aux_layer_ids
    from draftsmith.train.checkpoint import check_checkpoint_shapes

    work = work / "bad"
    work.mkdir()
    info = TargetInfo.read(prepared / "data" / "target.json")
    qa = [{"role": "user", "content": "Name a quick brown animal."}, {"role": "assistant", "content": "fox"}]
    rows: list[tuple[str, Callable[[], str | None]]] = []

    def jsonl(name: str, lines: list[str]) -> str:
        (work / name).write_text("\n".join(lines) + "\n")
        return str(work / name)

    mixed = jsonl("mixed.jsonl", ['{"prompt": "ok"}', '{not json', '{"prompt": "also ok"}'])
    rows.append(("malformed JSONL row (default)", lambda: conv.load_records(mixed)[1].summary()))
    rows.append(("malformed JSONL row (data.strict)", lambda: conv.load_records(mixed, strict=True)))
    def tokenize_stats(name: str, rec: Recipe, records: list[dict]) -> str:
        (work / name).mkdir()
        stage_tokenize(rec, DataPaths(work / name), info, records, [])
        stats = json.loads((work / name / "stats.json").read_text())
        return f"stats.json: skipped {stats['skipped']}, truncated {stats['truncated']}"

    rows.append(("conversation without an assistant turn", lambda: tokenize_stats(
        "t1", recipe, [{"id": "u", "messages": qa[:1]}, {"id": "ok", "messages": qa}])))
    rows.append(("empty turn", lambda: conv.normalise_row(
        {"messages": [{"role": "user", "content": "  "}]}, "auto", "data.jsonl:3")))
    rows.append(("roles out of order", lambda: conv.normalise_row(
        {"messages": [qa[1], qa[0]]}, "auto", "data.jsonl:4")))
    long_rec = {"id": "long", "messages": [qa[0], {"role": "assistant", "content": "fox " * 200}]}
    drop = load_recipe(None, ["data.max_length=64", "data.overlong=drop"])

    rows.append(("sequence longer than max_length (overlong: drop)", lambda: tokenize_stats(
        "t2", drop, [long_rec, {"id": "ok", "messages": qa}])))
    rows.append(("dataset with zero trainable tokens", lambda: stage_tokenize(
        drop, DataPaths(work / "t3"), info, [long_rec], [])))

    def rewriting_template() -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        tok.chat_template = "{% for m in messages[-2:] %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        conv.tokenize_conversation(tok, [{"role": "system", "content": "Be terse."}, *qa, *qa])

    rows.append(("chat template that cannot give an assistant mask", rewriting_template))

    def big_vocab() -> str:
        handler, logger = _Capture(), logging.getLogger("draftsmith.prepare")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)  # main() quiets the root logger
        try:
            stage_vocab(load_recipe(None, ["data.draft_vocab_size=100000"]), DataPaths(work), info,
                        [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        return handler.text

    rows.append(("draft vocab larger than target vocab (prepare)", big_vocab))
    tiny = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=50, aux_layer_ids=[0, 1, 2], rope_theta=10000.0)
    rows.append(("draft vocab larger than target vocab (draft config)",
                 lambda: Eagle3Config(**tiny, draft_vocab_size=51)))
    rows.append(("aux layer ids out of range", lambda: validate_aux_layer_ids([1, 3, 6], 6)))
    rows.append(("aux layer ids: not three", lambda: validate_aux_layer_ids([1, 3], 6)))

    def shards(name: str, edit: Callable[[Path, dict], None], verify: bool = True) -> Callable[[], Any]:
        def run() -> Any:
            d = work / name
            shutil.copytree(prepared / "data" / "hidden_states", d)
            manifest = json.loads((d / "manifest.json").read_text())
            edit(d, manifest)
            (d / "manifest.json").write_text(json.dumps(manifest))
            return HiddenStateDataset(d, verify=verify)
        return run

    rows.append(("shard shape disagrees with manifest", shards(
        "s1", lambda d, m: m["shards"][0].update(num_tokens=m["shards"][0]["num_tokens"] + 1))))
    rows.append(("shard dtype disagrees with manifest", shards("s2", lambda d, m: m.update(dtype="float16"))))

    def truncate(d: Path, m: dict) -> None:
        f = d / m["shards"][1]["file"]
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    rows.append(("truncated shard (checksums on)", shards("s3", truncate)))
    rows.append(("truncated shard (checksums off)", shards("s4", truncate, verify=False)))
    def corrupt_manifest() -> Any:
        shutil.copytree(prepared / "data" / "hidden_states", work / "s5")
        (work / "s5" / "manifest.json").write_text('{"shards": [')
        return HiddenStateDataset(work / "s5")

    rows.append(("corrupt manifest", corrupt_manifest))
    rows.append(("shard file name leaving the directory", shards(
        "s6", lambda d, m: m["shards"][0].update(file="../../etc/passwd"))))
    rows.append(("recipe: unknown key", lambda: load_recipe(None, ["train.learning_rate=1e-3"])))
    rows.append(("recipe: wrong type", lambda: load_recipe(None, ["train.batch_size=eight"])))
    rows.append(("recipe: name with ../", lambda: load_recipe(None, ["name=../../x"])))
    rows.append(("write path from a recipe/CLI name: absolute", lambda: safe_path(work, "/etc/x", key="export.name")))

    def other_target_ckpt(declared: dict, weights: dict) -> Path:
        d = work / f"ckpt-{len(list(work.glob('ckpt-*')))}"
        d.mkdir()
        model = Eagle3DraftModel(Eagle3Config(**{**tiny, "draft_vocab_size": 20, **weights}))
        model.set_vocab_mapping(torch.zeros(20, dtype=torch.long), torch.ones(model.config.vocab_size, dtype=torch.bool))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
        cfg = Eagle3Config(**{**tiny, "draft_vocab_size": 20, **declared})
        DraftCheckpointConfig(method="eagle3", config=cfg.to_dict(), target={"name_or_path": "t"}).write(d)
        return d

    rows.append(("resume from a checkpoint of another target (hidden size)", lambda: check_checkpoint_shapes(
        other_target_ckpt({}, {"hidden_size": 32}), Eagle3DraftModel(Eagle3Config(**{**tiny, "draft_vocab_size": 20, "hidden_size": 48})))))
    rows.append(("export of a checkpoint inconsistent with its target (vocab)", lambda: export(
        other_target_ckpt({"vocab_size": 64}, {}), work / "export-out")))

    def draft_for(edit: dict) -> Callable[[], Any]:
        def run() -> Any:
            d = work / f"draft-{len(list(work.glob('draft-*')))}"
            d.mkdir()
            cfg = {"speculators_config": {"verifier": {"name_or_path": info.name_or_path, "architectures": ["LlamaForCausalLM"]}},
                   "draft_vocab_size": 128, "target_hidden_size": info.hidden_size,
                   "eagle_aux_hidden_state_layer_ids": info.aux_layer_ids,
                   "transformer_layer_config": {"hidden_size": info.hidden_size, "vocab_size": info.vocab_size}}
            (d / "config.json").write_text(json.dumps({**cfg, **edit}))
            return check_draft_matches_target(d, target)
        return run

    rows.append(("exported draft, other verifier", draft_for(
        {"speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}}})))
    rows.append(("exported draft, other vocab", draft_for(
        {"transformer_layer_config": {"hidden_size": info.hidden_size, "vocab_size": 640}})))
    rows.append(("exported draft, layer ids out of range", draft_for({"eagle_aux_hidden_state_layer_ids": [2, 3, 9]})))
    return [(name, *outcome_of(fn)) for name, fn in rows]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage()


# ---------------------------------------------------------------------------------------------
# faults: each returns a row {fault, outcome, steps_lost, tokens_recomputed, param_diff, curve_diff}


def run_ok(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def faults(work: Path, recipe: Recipe, prepared: Path, seed: int) -> list[dict[str, Any]]:
    from draftsmith.train.trainer import fit

    rows = []
    ref = fresh_run(prepared, work / "ref")
    run_ok(train_cmd(recipe, ref))
    ref_params, ref_curve = final_params(ref), read_metrics(ref)

    def compare(run: Path) -> dict[str, float]:
        return {"param_diff": max_param_diff(final_params(run), ref_params), "curve_diff": curve_diff(read_metrics(run), ref_curve)}

    # SIGKILL at a seeded random step
    kill_at = random.Random(seed).randrange(4, recipe.train.max_steps - 6, recipe.train.log_every)  # a logged step
    run = fresh_run(prepared, work / "sigkill")
    proc = subprocess.Popen(train_cmd(recipe, run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = wait_for_step(run, kill_at, proc)
    proc.kill()
    proc.wait()
    seen = max(m["step"] for m in read_metrics(run))
    kept = checkpoint_step(run)
    run_ok(train_cmd(recipe, run, "--resume"))
    rows.append({"fault": f"SIGKILL training at step >= {kill_at} (seed {seed})",
                 "outcome": f"killed after logged step {seen}; resumed from step-{kept}",
                 "steps_lost": seen - kept, "tokens_recomputed": 0, **compare(run)})

    # SIGTERM: the loop saves after the current step and exits 143
    run = fresh_run(prepared, work / "sigterm")
    proc = subprocess.Popen(train_cmd(recipe, run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_step(run, kill_at, proc)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=300)
    seen, kept = max(m["step"] for m in read_metrics(run)), checkpoint_step(run)
    run_ok(train_cmd(recipe, run, "--resume"))
    rows.append({"fault": f"SIGTERM training at step >= {kill_at}", "outcome": f"exit {code}; saved step-{kept}",
                 "steps_lost": max(0, seen - kept), "tokens_recomputed": 0, **compare(run)})

    # crash in the middle of a checkpoint save (second save: step 6)
    run = fresh_run(prepared, work / "midsave")
    try:
        fit(recipe, FaultyEagle3(recipe, run, crash_on_save=2), run, progress=False)
        outcome = "no crash?"
    except OSError:
        partial = sorted(p.name for p in (run / "checkpoints").glob(".tmp-*"))
        outcome = f"left {partial}; resumed from {find_checkpoints(run / 'checkpoints')[-1].name}"
    seen, kept = max(m["step"] for m in read_metrics(run)), checkpoint_step(run)
    fit(recipe, Eagle3Method(recipe, run), run, resume=True, progress=False)
    rows.append({"fault": "crash mid-checkpoint write (step 6)", "outcome": outcome + ", .tmp removed",
                 "steps_lost": seen - kept, "tokens_recomputed": 0, **compare(run)})

    # NaN losses: one bad step is skipped; too many in a row stop the run
    run = fresh_run(prepared, work / "nan")
    method = FaultyEagle3(recipe, run, nan_calls=(6,))  # micro-batch 6 = optimizer step 4
    fit(recipe, method, run, progress=False)
    state = json.loads((find_checkpoints(run / "checkpoints")[-1] / "train_state.json").read_text())
    finite = all(bool(torch.isfinite(t).all()) for t in final_params(run).values() if t.is_floating_point())
    rows.append({"fault": "NaN loss at step 4", "outcome": f"update skipped ({state['nonfinite_skipped']} counted), "
                 f"run finished at step {state['step']}, params finite: {finite}",
                 "steps_lost": 0, "tokens_recomputed": 0, "param_diff": None, "curve_diff": None})
    run = fresh_run(prepared, work / "nan-many")
    bad = recipe.model_copy(deep=True)
    bad.train.max_nonfinite_steps = 3
    try:
        fit(bad, FaultyEagle3(bad, run, nan_calls=tuple(range(4, 100))), run, progress=False)
        outcome = "no error?"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    rows.append({"fault": "NaN loss from step 3 on (max_nonfinite_steps 3)", "outcome": outcome,
                 "steps_lost": 0, "tokens_recomputed": 0, "param_diff": None, "curve_diff": None})
    return rows


def prep_faults(work: Path, recipe: Recipe, prepared: Path) -> list[dict[str, Any]]:
    from draftsmith.data_prep.shards import load_manifest

    script = work / "prep_killer.py"
    script.write_text(PREP_KILLER)
    rows = []

    def prep(run: Path, *overrides: str, kill: tuple[str, int] | None = None, stages: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        path = run / "recipe.in.yaml"
        run.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, path)
        args = [str(path), "--run-dir", str(run)] + [a for o in overrides for a in ("--set", o)]
        args += [a for s in stages for a in ("--stage", s)]
        cmd = [sys.executable, str(script), kill[0], str(kill[1]), *args] if kill else \
              [sys.executable, "-m", "draftsmith.cli.prepare", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if kill is None and done.returncode != 0:
            raise RuntimeError(f"prepare failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done

    one = "data.sequences_per_shard=1"
    ref, run = work / "prep-ref", work / "prep-killed"
    for r in (ref, run):  # same regenerated conversations: only the hidden-state stage differs
        (r / "data").mkdir(parents=True)
        shutil.copy(prepared / "data" / "regen.jsonl", r / "data" / "regen.jsonl")
    prep(ref, one)
    killed = prep(run, one, kill=("shard", 4))
    shards = run / "data" / "hidden_states"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards.glob("shard-*.safetensors")}
    kept_tokens = sum(s["num_tokens"] for s in load_manifest(shards)["shards"])
    rerun = prep(run, one)
    got, want = load_manifest(shards), load_manifest(ref / "data" / "hidden_states")
    untouched = all((shards / n).stat().st_ino == i and (shards / n).stat().st_mtime_ns == t for n, (i, t) in before.items())
    same = [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]
    ids = [i for s in got["shards"] for i in s["ids"]]
    log_line = next((line.split(": ", 1)[-1] for line in rerun.stderr.splitlines() if "already on disk" in line), "?")
    rows.append({"fault": "SIGKILL data prep during shard 4 of hidden states",
                 "outcome": f"exit {killed.returncode}; {len(before)} shards kept (inode+mtime unchanged: {untouched}); "
                 f"rerun log: '{log_line}'; shards byte-identical to uninterrupted: {same}; "
                 f"{len(ids)} ids, duplicates {len(ids) - len(set(ids))}",
                 "steps_lost": None, "tokens_recomputed": f"{got['num_tokens'] - kept_tokens} of {got['num_tokens']}",
                 "param_diff": None, "curve_diff": None})

    two = "data.regenerate.batch_size=2"
    stages = ("target", "regenerate")
    ref, run = work / "regen-ref", work / "regen-killed"
    prep(ref, two, stages=stages)
    killed = prep(run, two, kill=("regenerate", 3), stages=stages)
    cached = len((run / "data" / "regen.jsonl").read_text().splitlines())
    rerun = prep(run, two, stages=stages)
    rows_got = [json.loads(line) for line in (run / "data" / "regen.jsonl").read_text().splitlines()]
    rows_want = {json.loads(line)["id"]: json.loads(line) for line in (ref / "data" / "regen.jsonl").read_text().splitlines()}
    log_line = next((line.split(": ", 1)[-1] for line in rerun.stderr.splitlines() if "cached)" in line), "?")
    rows.append({"fault": "SIGKILL data prep during regeneration batch 3 of 4",
                 "outcome": f"exit {killed.returncode}; {cached} conversations cached; rerun log: '{log_line}'; "
                 f"result equals uninterrupted: {({r['id']: r for r in rows_got} == rows_want)}; "
                 f"duplicates {len(rows_got) - len({r['id'] for r in rows_got})}",
                 "steps_lost": None, "tokens_recomputed": f"{len(rows_got) - cached} of {len(rows_got)} conversations",
                 "param_diff": None, "curve_diff": None})
    return rows


def _recipe_file(recipe: Recipe, work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, work / "recipe.yaml")
    return work / "recipe.yaml"


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def format_tables(bad: list[tuple[str, str, str]], fault_rows: list[dict[str, Any]]) -> str:
    out = ["## Bad input", "", "| input | outcome | message |", "|---|---|---|"]
    out += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in bad]
    out += ["", "## Faults", "",
            "| fault | what happened / survived | steps lost | tokens recomputed | max abs param diff vs uninterrupted | max abs metrics.jsonl diff |",
            "|---|---|---|---|---|---|"]
    out += [f"| {_cell(r['fault'])} | {_cell(r['outcome'])} | {_cell(r['steps_lost'])} | {_cell(r['tokens_recomputed'])} "
            f"| {_cell(r['param_diff'])} | {_cell(r['curve_diff'])} |" for r in fault_rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0, help="picks the SIGKILL step")
    p.add_argument("--no-launchers", action="store_true", help="skip the DeepSpeed / FSDP launcher kills")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="draftsmith-faults-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        recipe, prepared, target = tiny_setup(work)
        bad = bad_inputs(work, recipe, prepared, target)
        fault_rows = faults(work, recipe, prepared, args.seed) + prep_faults(work, recipe, prepared)
        kill_rows = [] if args.no_launchers else launcher_kill_rows(_recipe_file(recipe, work / "launchers"),
                                                                    prepared / "data", work / "launchers")
    print(format_tables(bad, fault_rows))
    if kill_rows:
        print("\n## Launcher kills\n\n" + format_kill_table(kill_rows))
    print(f"\n(tiny target H=128, 6 layers, V=512; {recipe.train.max_steps} steps, batch 2 x accumulation 2, "
          f"checkpoint every 3, CPU fp32; {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
