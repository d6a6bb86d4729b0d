"""Data preparation CLI: conversations -> token ids + loss masks -> draft vocab -> hidden states.

    python -m draftsmith.data_prep.prepare RECIPE.yaml --run-dir runs/x [--stage STAGE] [--set k=v]

Stages (each reruns alone and skips finished work): ``target`` (resolve / dequantise the
target), ``regenerate`` (target replies, cached), ``tokenize`` (chat template + assistant
mask), ``vocab`` (draft vocab d2t/t2d), ``hidden-states`` (aux + final states, sharded).
Everything lands under ``RUN_DIR/data``. The hidden-states stage captures with
``data.hidden_states_engine`` (transformers hooks or vLLM's ``extract_hidden_states``) and
splits its shards across processes launched with ``RANK``/``WORLD_SIZE`` (torchrun,
``accelerate launch``; one GPU per process via ``CUDA_VISIBLE_DEVICES``):

    torchrun --nproc-per-node 8 -m draftsmith.data_prep.prepare RECIPE.yaml --run-dir runs/x --stage hidden-states
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import conversations as conv
from . import hidden_states as hs
from .capture import CaptureEngine, LazyCapture, TransformersCapture
from .shards import MANIFEST, ShardError, ShardSpec, distributed_rank
from . import regenerate as regen
from . import target as tgt
from . import vocab
from ..layout import DataPaths, RunLayout, read_tokenized
from ..recipe import Recipe, add_recipe_arguments, dump_recipe, recipe_from_args

log = logging.getLogger("draftsmith.prepare")
STAGES = ["target", "regenerate", "tokenize", "vocab", "hidden-states"]


def stage_target(recipe: Recipe, paths: DataPaths) -> dict:
    """Resolve the target and fix the aux layer ids; writes ``target.json``."""
    path = tgt.resolve_target(recipe.target.name_or_path, recipe.target.trust_remote_code)
    config = tgt.load_target_config(path, recipe.target.trust_remote_code)
    text = tgt.text_config(config)
    n = tgt.num_decoder_layers(config)
    ids = recipe.data.aux_layer_ids or tgt.default_aux_layer_ids(n)
    ids = tgt.validate_aux_layer_ids(ids, n)
    info = {
        "name_or_path": recipe.target.name_or_path,
        "verifier": tgt.verifier_name(recipe.target.name_or_path),
        "path": str(path),
        "architectures": list(getattr(config, "architectures", None) or []),
        "num_hidden_layers": n,
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "aux_layer_ids": ids,
    }
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.target_info.write_text(json.dumps(info, indent=1))
    log.info("target %s: %d layers, H=%d, V=%d, aux layers %s", path, n, info["hidden_size"], info["vocab_size"], ids)
    return info


def load_sources(recipe: Recipe) -> tuple[list[dict], list[str]]:
    records, reports = [], []
    for src in recipe.data.sources:
        recs, report = conv.load_records(src.path, src.format, src.split, src.max_rows, recipe.data.strict)
        log.info(report.summary())
        reports.append(report.summary())
        records.extend(recs)
    return records, reports


def _engine_factory(recipe: Recipe, target_dir: Path, device: str | None = None):
    """``() -> ChatEngine`` for ``data.regenerate.engine``: vLLM with the recipe's ``vllm``,
    or transformers on ``device`` (:func:`draftsmith.data_prep.target.default_device`)."""
    engine = recipe.data.regenerate.engine
    if engine == "auto":
        engine = "vllm" if regen.vllm_available() else "transformers"
    log.info("regeneration engine: %s", engine)

    def make():
        if engine == "vllm":
            return regen.VllmChatEngine(target_dir, recipe.seed, recipe.vllm,
                                        trust_remote_code=recipe.target.trust_remote_code)
        model, tok = tgt.load_target(target_dir, getattr(torch, recipe.target.dtype), recipe.target.trust_remote_code,
                                     device=device)
        return regen.TransformersChatEngine(model, tok, recipe.seed)

    return make


def stage_regenerate(recipe: Recipe, paths: DataPaths, info: dict, device: str | None = None) -> list[dict]:
    records, reports = load_sources(recipe)
    cfg = recipe.data.regenerate
    if cfg.enabled:
        harmony = False
        if cfg.reasoning_effort:  # only harmony (gpt-oss) templates read reasoning_effort
            from transformers import AutoTokenizer

            harmony = conv.is_harmony_template(
                AutoTokenizer.from_pretrained(info["path"], trust_remote_code=recipe.target.trust_remote_code))
        records = regen.regenerate(
            records, paths.regen, _engine_factory(recipe, Path(info["path"]), device), cfg.temperatures,
            cfg.max_new_tokens, cfg.batch_size, reasoning_effort=cfg.reasoning_effort, harmony=harmony,
            seed=recipe.seed,
        )
    return records, reports


def stage_tokenize(recipe: Recipe, paths: DataPaths, info: dict, records: list[dict], reports: list[str]) -> list[dict]:
    """Tokenise, mask, and apply the over-long policy; writes ``tokenized.jsonl`` and stats.

    Raises:
        DataError: the data yields zero trainable (assistant) tokens.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(info["path"], trust_remote_code=recipe.target.trust_remote_code)
    max_len = recipe.data.max_length
    channels = tuple(recipe.data.harmony_channels) if conv.is_harmony_template(tok) else None
    if channels is not None:
        log.info("harmony chat template: loss on assistant channels %s", channels)
    out, skipped = [], {"no_assistant_turn": 0, "invalid": 0, "overlong_dropped": 0}
    truncated = 0
    first_bad = None
    for r in records:
        try:
            if "input_ids" in r:
                ids, mask = r["input_ids"], r["loss_mask"]
                bad = [t for t in ids if not 0 <= t < info["vocab_size"]]
                if bad:
                    raise conv.DataError(
                        f"row {r['id']}: token id {bad[0]} outside the target vocab of {info['vocab_size']} "
                        "(tokenised with another tokenizer?)"
                    )
                is_long = len(ids) > max_len
                t = {"input_ids": ids[:max_len], "loss_mask": mask[:max_len], "truncated": is_long}
            else:
                conv.validate_messages(r["messages"], f"row {r['id']}")
                if not conv.has_assistant_turn(r):
                    skipped["no_assistant_turn"] += 1
                    continue
                # gpt-oss: the effort the reply was regenerated at (data.regenerate.reasoning_effort)
                t = conv.tokenize_conversation(tok, r["messages"], max_len, channels, r.get("reasoning_effort"))
        except conv.DataError as exc:
            if recipe.data.strict:
                raise
            skipped["invalid"] += 1
            first_bad = first_bad or str(exc)
            continue
        if t["truncated"]:
            if recipe.data.overlong == "drop":
                skipped["overlong_dropped"] += 1
                continue
            truncated += 1
        if sum(t["loss_mask"]) < 2:
            skipped["no_assistant_turn"] += 1
            continue
        out.append({"id": r["id"], "input_ids": t["input_ids"], "loss_mask": t["loss_mask"]})
    n_tok = sum(len(r["input_ids"]) for r in out)
    n_asst = sum(sum(r["loss_mask"]) for r in out)
    if n_asst == 0:
        raise conv.DataError(f"the data yields zero trainable assistant tokens (skipped: {skipped}; first: {first_bad})")
    with paths.tokenized.open("w", encoding="utf-8") as fh:
        for r in out:
            fh.write(json.dumps(r) + "\n")
    stats = {
        "sources": reports,
        "sequences": len(out),
        "tokens": n_tok,
        "assistant_tokens": n_asst,
        "truncated": truncated,
        "skipped": skipped,
        "first_skipped_reason": first_bad,
    }
    paths.stats.write_text(json.dumps(stats, indent=1))
    log.info("tokenised %d sequences, %d tokens (%d assistant); truncated %d; skipped %s",
             len(out), n_tok, n_asst, truncated, skipped)
    return out


def stage_vocab(recipe: Recipe, paths: DataPaths, info: dict, records: list[dict]) -> dict:
    V = info["vocab_size"]
    Vd = min(recipe.data.draft_vocab_size, V)
    if recipe.data.draft_vocab_size > V:
        log.warning("draft_vocab_size %d > target vocab %d: capped at %d", recipe.data.draft_vocab_size, V, V)
    counts = vocab.count_assistant_tokens(records)
    d2t, t2d = vocab.build_draft_vocab(counts, V, Vd)
    save_file({"d2t": d2t, "t2d": t2d}, str(paths.vocab))
    cov = vocab.coverage(counts, t2d)
    log.info("draft vocab: %d of %d target ids, covering %.2f%% of assistant tokens", Vd, V, 100 * cov)
    return {"draft_vocab_size": Vd, "coverage": cov, "distinct_assistant_tokens": len(counts)}


def stage_hidden_states(recipe: Recipe, paths: DataPaths, info: dict, records: list[dict],
                        device: str | None = None) -> dict:
    """Capture the shards with ``data.hidden_states_engine``; under torchrun / accelerate each
    rank computes its share of the shards (``hidden_states.generate_hidden_states``). The
    transformers engine runs the target on ``device`` (default: this process's accelerator,
    :func:`draftsmith.data_prep.target.default_device`); vLLM runs with the recipe's
    ``vllm`` at ``target.dtype``, its context raised to ``data.max_length`` if shorter."""
    from . import vllm_hidden_states as vhs

    engine = vhs.resolve_engine(recipe.data.hidden_states_engine)
    log.info("hidden-states engine: %s (data.hidden_states_engine=%s)", engine, recipe.data.hidden_states_engine)
    target_dir = Path(info["path"])

    def make() -> CaptureEngine:  # built on first use: nothing starts when every shard exists
        if engine == "vllm":
            v = recipe.vllm
            # the states must be those of the dtype the transformers engine would capture at
            v = v.model_copy(update={"dtype": recipe.target.dtype, "max_model_len": None if v.max_model_len is None
                                     else max(v.max_model_len, recipe.data.max_length)})
            return vhs.VllmHiddenStateCapture(target_dir, info["aux_layer_ids"], v, recipe.seed,
                                              trust_remote_code=recipe.target.trust_remote_code)
        model, _ = tgt.load_target(target_dir, getattr(torch, recipe.target.dtype), recipe.target.trust_remote_code,
                                   device=device)
        return TransformersCapture(model, info["aux_layer_ids"], recipe.data.capture_batch_tokens)

    spec = ShardSpec(info["hidden_size"], info["aux_layer_ids"], recipe.data.hidden_states_dtype)
    manifest = hs.generate_hidden_states(
        LazyCapture(engine, make), records, paths.hidden_states, spec, recipe.data.sequences_per_shard,
        recipe.data.capture_batch_tokens, target_id=info["name_or_path"],
    )
    rate = manifest["throughput_tok_s"]
    log.info("hidden states: %d shards, %d tokens%s", len(manifest["shards"]), manifest["num_tokens"],
             f", captured at {rate:.0f} tok/s" if rate else " (all shards already on disk)")
    return manifest


def stage_outputs(recipe: Recipe, paths: DataPaths) -> dict[str, list[Path]]:
    """The files each stage leaves behind when it has finished (``regenerate``'s cache is
    completed by rerunning it, so it counts as done once ``tokenize`` is)."""
    return {
        "target": [paths.target_info],
        "regenerate": [paths.tokenized],
        "tokenize": [paths.tokenized],
        "vocab": [paths.vocab],
        "hidden-states": [] if recipe.data.hidden_states_mode == "online" else [paths.hidden_states / MANIFEST],
    }


def missing_stages(recipe: Recipe, run_dir: Path) -> list[str]:
    """The stages to run so that ``run_dir/data`` is ready for training: the first stage whose
    output is missing and every stage after it (in :data:`STAGES` order); ``[]`` when ready."""
    outputs = stage_outputs(recipe, RunLayout(run_dir).data)
    for i, stage in enumerate(STAGES):
        if not all(p.is_file() for p in outputs[stage]):
            return STAGES[i:]
    return []


def prepare(recipe: Recipe, run_dir: Path, stages: list[str] | None = None, device: str | None = None) -> dict:
    """Run the data stages in order; returns a summary dict (also saved as ``data/summary.json``).
    ``device``: where the transformers engines run the target (default: this process's
    accelerator, :func:`draftsmith.data_prep.target.default_device`)."""
    stages = stages or STAGES
    paths = RunLayout(run_dir).data
    paths.root.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    t0 = time.perf_counter()
    info = stage_target(recipe, paths) if "target" in stages or not paths.target_info.is_file() else json.loads(paths.target_info.read_text())
    records = None
    if "regenerate" in stages or "tokenize" in stages:
        t = time.perf_counter()
        raw, reports = stage_regenerate(recipe, paths, info, device)
        summary["regenerate_s"] = time.perf_counter() - t
        if "tokenize" in stages:
            records = stage_tokenize(recipe, paths, info, raw, reports)
    if "vocab" in stages:
        records = records if records is not None else read_tokenized(paths)
        summary["vocab"] = stage_vocab(recipe, paths, info, records)
    if "hidden-states" in stages and recipe.data.hidden_states_mode == "online":
        log.info("hidden_states_mode=online: no shards; the trainer runs the target on each batch")
    elif "hidden-states" in stages:
        records = records if records is not None else read_tokenized(paths)
        t = time.perf_counter()
        m = stage_hidden_states(recipe, paths, info, records, device)
        summary["hidden_states"] = {"tokens": m["num_tokens"], "throughput_tok_s": m["throughput_tok_s"],
                                    "seconds": time.perf_counter() - t}
    summary["seconds"] = time.perf_counter() - t0
    if distributed_rank()[0] == 0:  # one writer when every rank runs the hidden-states stage
        paths.summary.write_text(json.dumps(summary, indent=1))
    return summary


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``data_prep/prepare.py`` (``draftsmith prepare``)."""
    from ..cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", required=True, type=Path, help="run directory; the data lands in RUN_DIR/data")
    p.add_argument("--stage", action="append", choices=STAGES, help="run only these stages (repeatable; default: all)")
    p.add_argument("--device", help=tgt.DEVICE_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    recipe = recipe_from_args(args)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, RunLayout(args.run_dir).recipe)
    try:
        summary = prepare(recipe, args.run_dir, args.stage, args.device)
    except (conv.DataError, ShardError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
