"""The whole pipeline of the recipe's draft method (EAGLE-3 in the demo recipe) in one command
(what ``make demo`` runs).

    python -m draftsmith.cli.demo recipes/smollm2_135m.yaml --run-dir runs/smollm2_135m
        [--eval-prompts builtin:mt_bench] [--set key=value ...]

Stages: prepare data (target, regenerate, tokenize, vocab, hidden states) -> train
(TTT) -> export (speculators format) -> acceptance in vLLM on the recipe's held-out prompts
(and any extra prompt sets: ``builtin:mt_bench`` fetches MT-bench from the Hub with ``datasets``,
a local FastChat ``question.jsonl`` works too), beside vLLM's ``ngram`` method on the same prompts.
Each stage skips work already on disk, so a rerun continues where the last one stopped.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from .data_prep.prepare import prepare
from .eval.acceptance import measure
from .eval.export import export
from .methods import get_method
from .recipe import Recipe, dump_recipe
from .target import TargetInfo
from .train.checkpoint import find_checkpoints
from .train.trainer import fit

log = logging.getLogger("draftsmith.demo")


def demo(recipe: Recipe, run: Path, recipe_file: str, eval_prompts: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Prepare, train, export and measure the draft of ``recipe`` in ``run`` (the module docstring's
    stages; each skips work already on disk), measuring on the recipe's ``data.eval_prompts`` and
    ``eval_prompts``.

    Returns:
        The report also written to ``RUN/eval/acceptance.json``: ``recipe`` (``recipe_file``),
        ``data`` (the prepare summary), ``train`` (steps, tokens, seconds, tokens_per_s,
        final_metrics, checkpoint; only the checkpoint when training had finished), ``acceptance``
        (prompt set -> method -> figures), ``timings`` (seconds per stage: ``prepare_s``,
        ``train_s``, ``eval_s``, ``total_s``) and ``draft`` (the export folder).
    """
    spec = get_method(recipe.draft.method)
    run.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, run / "recipe.yaml")
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    t = time.perf_counter()
    data_summary = prepare(recipe, run)
    timings["prepare_s"] = time.perf_counter() - t

    t = time.perf_counter()
    ckpts = find_checkpoints(run / "checkpoints")
    if ckpts and json.loads((ckpts[-1] / "train_state.json").read_text()).get("finished"):
        log.info("training already finished: %s", ckpts[-1])
        train_summary = {"checkpoint": str(ckpts[-1])}
    else:
        # no checkpoint yet: whatever a killed earlier attempt logged is started over
        result = fit(recipe, spec.training_method(recipe, run), run, resume=bool(ckpts), overwrite=not ckpts)
        train_summary = {"steps": result.steps, "tokens": result.tokens, "seconds": result.seconds,
                         "tokens_per_s": result.tokens_per_s, "final_metrics": result.last_metrics,
                         "checkpoint": str(result.checkpoint)}
    timings["train_s"] = time.perf_counter() - t

    draft = export(Path(train_summary["checkpoint"]), run / "export" / spec.name,
                   num_speculative_tokens=recipe.eval.num_speculative_tokens)
    if recipe.eval.export_legacy:
        export(Path(train_summary["checkpoint"]), run / "export" / f"{spec.name}-legacy", legacy=True)
    target_dir = Path(TargetInfo.read(run / "data" / "target.json").path)

    t = time.perf_counter()
    e = recipe.eval
    common = dict(target=target_dir, k=e.num_speculative_tokens, temperature=e.temperature,
                  max_new_tokens=e.max_new_tokens, max_prompts=e.max_prompts, seed=recipe.seed, engine=recipe.vllm,
                  ngram_min=e.ngram_prompt_lookup_min, ngram_max=e.ngram_prompt_lookup_max)
    prompt_sets = ([recipe.data.eval_prompts] if recipe.data.eval_prompts else []) + list(eval_prompts)
    acceptance: dict[str, dict] = {}
    for prompts in prompt_sets:
        acceptance[prompts] = {}
        methods = [spec.name] + (["ngram"] if e.compare_ngram else [])
        for m in methods:
            r = measure(method=m, draft=draft if m == spec.name else None, prompts=prompts,
                        log_path=run / "eval" / f"vllm_{m}_{Path(prompts).stem.replace(':', '_')}.log", **common)
            r.pop("outputs")
            acceptance[prompts][m] = r
    timings["eval_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_all

    report = {"recipe": recipe_file, "data": data_summary, "train": train_summary, "acceptance": acceptance,
              "timings": timings, "draft": str(draft)}
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "acceptance.json").write_text(json.dumps(report, indent=1))
    return report
