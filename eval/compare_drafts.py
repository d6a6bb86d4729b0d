"""Compare trained drafts of different types on one target: acceptance at each temperature,
per-position acceptance, parameters and training cost, as one Markdown table.

    draftsmith compare --target embedded:SmolLM2-135M-Instruct \\
        --run runs/smollm2_135m --run runs/smollm2_135m_medusa --run runs/smollm2_135m_mlp_speculator \\
        --prompts builtin:mt_bench --max-prompts 20 --max-new-tokens 128 \\
        --k 3 --temperatures 0,0.7 --out runs/compare/compare.json

Every draft is measured with the reference speculative decoder (:mod:`draftsmith.eval.spec_decode`),
because vLLM >= 0.33 no longer loads Medusa or MLP speculators, so one
decoder measures all three types the same way: chain drafting, batch 1, K draft tokens per
round, greedy acceptance at T=0 and lossless rejection sampling at T>0 with the draft tokens
chosen as ``--draft-sampling`` says (default greedy, vLLM's default). The figures follow
vLLM's definitions: mean acceptance length ``1 + accepted / drafts``
and per-position acceptance ``accepted at position i / drafts``.

Each ``--run`` is a training run directory: the exported draft is read from
``RUN/export`` (the folder holding ``config.json``, or its only sub-folder that does), the
method, training tokens and training wall time from the last checkpoint's
``train_state.json`` / ``draft_config.json``. "Parameters" counts the exported tensors
(``d2t``/``t2d`` index buffers excluded); "trained" leaves out tensors the run kept frozen
(the target embedding EAGLE-3 shares with vLLM is not exported, so it is in neither).
Plain decoding of the same prompts gives the speed reference for each draft's wall-clock
speedup (batch 1, this machine).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ..layout import DRAFT_CONFIG_FILE, RunLayout

INDEX_TENSORS = ("d2t", "t2d")


class RunError(ValueError):
    """A ``--run`` directory without an export or a finished checkpoint; names the path."""


def find_export(run_dir: Path) -> Path:
    """The exported draft folder of ``run_dir``: ``RUN/export`` if it holds ``config.json``,
    else its only sub-folder that does.

    Raises:
        RunError: no export, or several to choose from.
    """
    root = run_dir / "export"
    if (root / "config.json").is_file():
        return root
    found = sorted(p.parent for p in root.glob("*/config.json"))
    if len(found) != 1:
        raise RunError(f"{root}: expected one exported draft (a folder with config.json), found "
                       f"{[str(p) for p in found] or 'none'}; run `draftsmith export {run_dir}` first")
    return found[0]


def training_figures(run_dir: Path) -> dict[str, Any]:
    """Method, optimizer steps, training tokens and wall time of the run's last checkpoint.

    Returns:
        ``{"method", "steps", "train_tokens", "train_seconds", "checkpoint"}``; ``train_seconds``
        is None for checkpoints written before it was recorded.

    Raises:
        RunError: no checkpoint with ``train_state.json``.
    """
    from ..train.checkpoint import find_checkpoints, read_draft

    ckpts = find_checkpoints(RunLayout(run_dir).checkpoints)
    if not ckpts:
        raise RunError(f"{run_dir / 'checkpoints'}: no finished checkpoint")
    ckpt = ckpts[-1]
    state = json.loads((ckpt / "train_state.json").read_text())
    method = read_draft(ckpt, weights=False).method if (ckpt / DRAFT_CONFIG_FILE).is_file() else None
    return {"method": method, "steps": state["step"], "train_tokens": state["tokens"],
            "train_seconds": state.get("train_seconds"), "checkpoint": str(ckpt)}


def count_parameters(export_dir: Path, run_dir: Path | None = None) -> dict[str, int]:
    """Elements of the exported tensors (index buffers excluded) and, from the run's recipe,
    how many of them were trained (a frozen EAGLE-3 ``lm_head`` is not)."""
    from safetensors import safe_open

    from ..recipe import load_recipe

    sizes: dict[str, int] = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name not in INDEX_TENSORS:
                    sizes[name] = _numel(fh.get_slice(name).get_shape())
    total = sum(sizes.values())
    frozen = 0
    recipe_file = RunLayout(run_dir).recipe if run_dir is not None else None
    if recipe_file is not None and recipe_file.is_file():
        recipe = load_recipe(recipe_file)
        if getattr(recipe.draft, "freeze_lm_head", False):  # an eagle3 key (other sections have none)
            frozen = sum(v for k, v in sizes.items() if k.startswith("lm_head."))
    return {"parameters": total, "trained_parameters": total - frozen}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def markdown_table(results: dict[str, Any]) -> str:
    """One row per draft and temperature: AL, per-position acceptance, speedup, parameters,
    training tokens, time and tokens per second (tokens / wall time of the training loop)."""
    k = results["k"]
    head = ("| draft | T | mean acceptance length | per position (1.." + str(k) + ") | acceptance rate | "
            "speedup vs plain (batch 1) | parameters (trained) | training tokens | training time | training tok/s |")
    lines = [head, "|" + "---|" * 10]
    for t in results["temperatures"]:
        for name, d in results["drafts"].items():
            r = d["acceptance"].get(str(t))
            if r is None:
                continue
            pp = " / ".join(f"{p:.3f}" for p in r["per_position_acceptance"] or [])
            secs = d["train_seconds"]
            lines.append(
                f"| {name} | {t:g} | {r['mean_acceptance_length']:.3f} | {pp} | {r['acceptance_rate']:.3f} | "
                f"{r['speedup']:.2f}x | {d['parameters'] / 1e6:.1f}M ({d['trained_parameters'] / 1e6:.1f}M) | "
                f"{d['train_tokens']:,} | {'n/a' if secs is None else f'{secs / 60:.1f} min'} | "
                f"{'n/a' if not secs else format(d['train_tokens'] / secs, ',.0f')} |")
    return "\n".join(lines)


def compare(target: str, run_dirs: list[Path], prompts: str, max_prompts: int | None, k: int,
            temperatures: list[float], max_new_tokens: int, seed: int = 0, draft_sampling: str = "greedy",
            dtype: str = "auto", progress=print, device: str | None = None) -> dict[str, Any]:
    """Measure every run's draft at every temperature on the same prompts (module docstring).
    Target and drafts run on ``device`` (default: this process's accelerator,
    :func:`draftsmith.target.default_device`) in ``dtype`` (``"auto"``: bfloat16 on
    CUDA, float32 on the CPU, :func:`draftsmith.runtime.resolve_dtype`).

    Returns:
        ``{"target", "prompts", "num_prompts", "k", "max_new_tokens", "temperatures", "dtype",
        "plain": {T: {"output_tokens", "seconds", "output_tokens_per_s"}},
        "drafts": {name: {method, export, steps, train_tokens, train_seconds, parameters,
        trained_parameters, "acceptance": {T: spec_decode figures + "speedup"}}}}``.

    Raises:
        RunError: a run without export or checkpoint (before anything is measured).
        DraftLoadError: an export that does not fit the target.
    """
    from ..target import default_device, load_target, resolve_target
    from ..runtime import resolve_dtype
    from .spec_decode import Target, evaluate, load_draft, plain_generate, prompt_token_ids, stop_token_ids

    runs = {}
    for run in run_dirs:  # everything checked before the first (slow) measurement
        export = find_export(run)
        info = training_figures(run)
        name = info["method"] or json.loads((export / "config.json").read_text()).get("model_type", export.name)
        if name in runs:
            name = f"{name} ({run.name})"
        runs[name] = {"run_dir": str(run), "export": str(export), **info, **count_parameters(export, run)}
    device = default_device(device)
    dtype = resolve_dtype(dtype, device)
    model, tokenizer = load_target(resolve_target(target), dtype=getattr(torch, dtype), device=device)
    prompt_ids = prompt_token_ids(tokenizer, prompts, max_prompts)
    stops = stop_token_ids(model, tokenizer)
    out: dict[str, Any] = {"target": target, "prompts": prompts, "num_prompts": len(prompt_ids), "k": k,
                           "max_new_tokens": max_new_tokens, "temperatures": temperatures,
                           "dtype": dtype, "draft_sampling": draft_sampling, "plain": {}, "drafts": runs}
    for t in temperatures:
        plain_target = Target(model)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        t0 = time.perf_counter()
        n = sum(len(plain_generate(plain_target, p, t, max_new_tokens, stops, gen)) for p in prompt_ids)
        secs = time.perf_counter() - t0
        out["plain"][str(t)] = {"output_tokens": n, "seconds": secs, "output_tokens_per_s": n / secs}
        progress(f"plain T={t:g}: {n / secs:.1f} tok/s ({len(prompt_ids)} prompts)")
        for name, d in runs.items():
            proposer = load_draft(Path(d["export"]), model)
            proposer.model.to(model.device, getattr(torch, dtype))
            proposer.draft_sampling = draft_sampling
            r = evaluate(model, tokenizer, proposer, prompt_ids, k, t, max_new_tokens, seed, plain=False)
            r.pop("outputs")
            r["speedup"] = r["output_tokens_per_s"] / out["plain"][str(t)]["output_tokens_per_s"]
            d.setdefault("acceptance", {})[str(t)] = r
            pp = " / ".join(f"{p:.3f}" for p in r["per_position_acceptance"] or [])
            progress(f"{name} T={t:g}: AL {r['mean_acceptance_length']:.3f} per position {pp}, "
                     f"{r['output_tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x plain)")
    return out
