"""``draftsmith opd --variant replay``: training rows where the target rejected the draft's own
proposals (Draft-OPD's replay, arXiv:2605.29343; docs/training.md, "On-policy distillation").

1. **Prefixes**: ``--conversations`` tokenised training conversations of ``RUN_DIR/data`` (seeded
   sample) and ``--prefixes`` cut points in each, drawn among its trained (assistant) tokens and
   leaving room for ``--new-tokens`` within ``data.max_length``. With ``--prompts SOURCE`` (a
   prompt set as ``draftsmith acceptance --prompts`` reads it: a JSONL file, ``builtin:<name>``,
   a Hub dataset) the prefixes are instead ``--conversations`` prompts of that set (seeded
   sample), each rendered with the target's chat template up to its generation prompt, one
   prefix per prompt: the draft replays on prompts it was not trained on, where a draft that has
   learned its training conversations still meets the rejections it will meet when served.
2. **Decode**: from each prefix the reference speculative decoder
   (:func:`~draftsmith.eval.spec_decode.speculative_generate`, the transformers target and the
   run's trained draft exported to ``opd/replay/draft``) generates ``--new-tokens`` tokens at the
   recipe's served temperature ``eval.temperature`` (greedy at 0) with K =
   ``eval.num_speculative_tokens``: the tokens are the target's own (lossless verification), and
   each round where the target rejected a draft token is recorded at the token it put in its place.
3. **Rows**: prefix + continuation, the loss mask on each rejected position and the ``--span`` - 1
   tokens after it (what the draft proposes next from the corrected context), nothing on the
   prefix. A continuation with no rejection is recorded and not trained on. Each row is one line
   of ``opd/replay/rows.jsonl`` (``id`` = ``<conversation id>@<cut>``, or ``prompt<index>@<prompt
   length>`` for ``--prompts``), flushed and fsynced as it
   is written: a killed or disk-full replay keeps every whole line, drops a partial last one, and
   a re-run decodes only the ids not yet written (no row twice).
4. **Data**: ``opd/data`` gets the run's target, vocab and recorded keys, the rows as its
   tokenised set and their hidden states from the data stage's own capture
   (:func:`~draftsmith.data_prep.prepare.stage_hidden_states`: shards already on disk are kept).
   With ``--sft-rows N`` the set also holds N of the run's own training conversations (seeded
   sample, ids ``sft:<conversation id>``) with their SFT loss masks, so that the stage trains on
   the replay rows and the SFT data together rather than on the replay rows alone; they are
   captured again with the rows and counted in the data cost.

Training then runs ``draft.opd`` on these rows: the target's distributions at the captured
states are the teachers, and the TTT steps / block slots whose chains start before a rejection
carry the split and the ``opd_gamma**k`` decay beyond it.

Target tokens scored (the data cost): each prefix once, K + 1 per verification round, each kept
row once more in the capture.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Iterator

from ..layout import RunLayout, read_tokenized
from ..recipe import Recipe

log = logging.getLogger("draftsmith.eval.opd_replay")
ROWS_FILE = "rows.jsonl"
# the files of RUN_DIR/data the replay data shares (target, draft vocab, recorded keys and counts)
SHARED_DATA_FILES = ("target.json", "vocab.safetensors", "spec.json", "stats.json")


class ReplayError(ValueError):
    """Replay cannot make training rows; the message says why (one line)."""


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The whole rows of an append-only rows file, by id; a partial last line (a kill or a full
    disk mid-write) is cut off the file so that the next append starts on a fresh line.

    Raises:
        ReplayError: a whole line that is not a JSON row (the file is not this stage's).
    """
    if not path.is_file():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: dropping a partial last line (%d bytes) left by an interrupted write", path, len(data) - end)
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    rows: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(data[:end].splitlines(), 1):
        try:
            row = json.loads(line)
            rows[str(row["id"])] = row
        except (ValueError, KeyError, TypeError):
            raise ReplayError(f"{path}:{n}: not a replay row; --overwrite starts the OPD stage over") from None
    return rows


def append_row(f: Any, row: dict[str, Any]) -> None:
    """Write ``row`` as one line of the open rows file and make it durable (flush + fsync).

    Raises:
        ReplayError: the disk is full (the rows written so far are kept; re-running continues).
    """
    try:
        f.write((json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ReplayError(f"{f.name}: disk full while writing replay row {row['id']}: the rows written so far "
                              "are kept; free space and re-run the command to continue") from None
        raise


def pick_prefixes(ids: list[str], masks: list[Any], conversations: int, prefixes: int, max_prefix: int,
                  seed: int) -> list[tuple[str, int, int]]:
    """``(row id, conversation index, cut)`` of the prefixes to decode from: ``conversations``
    conversations (seeded sample, file order kept), each with up to ``prefixes`` distinct cuts
    ``p`` (1 <= p <= ``max_prefix``) at trained tokens (``masks[i][p]``: the prefix ends just
    before an assistant token). Deterministic in ``seed``: a re-run picks the same prefixes."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(ids)), min(conversations, len(ids))))
    out = []
    for i in chosen:
        cuts = [p for p in range(1, min(len(masks[i]), max_prefix + 1)) if masks[i][p]]
        for p in sorted(rng.sample(cuts, min(prefixes, len(cuts)))):
            out.append((f"{ids[i]}@{p}", i, p))
    return out


def pick_prompts(prompt_ids: list[list[int]], conversations: int, max_prefix: int,
                 seed: int) -> list[tuple[str, list[int]]]:
    """``(row id, prefix)`` of the prompts to decode from (``--prompts``): ``conversations`` of the
    rendered prompts ``prompt_ids`` no longer than ``max_prefix`` tokens (seeded sample, file order
    kept), each id ``prompt<index in the set>@<length>``. Deterministic in ``seed``."""
    fits = [i for i, ids in enumerate(prompt_ids) if 1 <= len(ids) <= max_prefix]
    chosen = sorted(random.Random(seed).sample(fits, min(conversations, len(fits))))
    return [(f"prompt{i}@{len(prompt_ids[i])}", [int(t) for t in prompt_ids[i]]) for i in chosen]


def pick_sft_rows(masks: list[Any], count: int, seed: int) -> list[int]:
    """Indices of ``count`` training conversations (``--sft-rows``) with a trained token, a seeded
    sample in file order, drawn independently of the prefixes' sample. Deterministic in ``seed``."""
    trained = [i for i, m in enumerate(masks) if any(m)]
    return sorted(random.Random(seed + 1_000_003).sample(trained, min(count, len(trained))))


def rendered_prompts(run_dir: Path, prompts: str, trust_remote_code: bool = False) -> list[list[int]]:
    """The prompts of ``prompts`` (a JSONL file, ``builtin:<name>``, a Hub dataset) rendered with
    the run's target's chat template and a generation prompt, as ``draftsmith acceptance``'s
    reference decoder renders them (:func:`~draftsmith.eval.spec_decode.prompt_token_ids`).

    Raises:
        ReplayError: the set cannot be read (the message names it).
    """
    from transformers import AutoTokenizer

    from ..data_prep.conversations import DataError
    from ..target import TargetInfo
    from .spec_decode import prompt_token_ids

    info = TargetInfo.read(RunLayout(run_dir).data.target_info)
    tokenizer = AutoTokenizer.from_pretrained(info.path, trust_remote_code=trust_remote_code)
    try:
        return prompt_token_ids(tokenizer, prompts)
    except DataError as exc:
        raise ReplayError(f"--prompts {exc}") from None


def replay_mask(prefix_len: int, new_len: int, rejections: list[int], span: int) -> list[int]:
    """``(prefix_len + new_len,)`` 0/1: 1 at each rejected position (``prefix_len + r`` for an
    output index ``r`` < ``new_len``) and the ``span - 1`` tokens after it, within the row."""
    mask = [0] * (prefix_len + new_len)
    for r in rejections:
        if r < new_len:
            for t in range(prefix_len + r, min(prefix_len + r + span, len(mask))):
                mask[t] = 1
    return mask


def _decoder(recipe: Recipe, run_dir: Path, draft: Path, device: str | None) -> tuple[Any, Any, Any, Any]:
    """``(Target, proposer, stop ids, device)``: the run's target (transformers) and the exported draft."""
    import torch

    from ..runtime import resolve_dtype
    from ..target import TargetInfo, default_device, load_target
    from .spec_decode import Target, load_draft, stop_token_ids

    info = TargetInfo.read(RunLayout(run_dir).data.target_info)
    dev = default_device(device)
    dtype = getattr(torch, resolve_dtype("auto", dev))
    model, tokenizer = load_target(Path(info.path), dtype=dtype, trust_remote_code=recipe.target.trust_remote_code,
                                   device=dev)
    proposer = load_draft(draft, model)
    proposer.model.to(model.device, dtype)
    # the draft proposes as it is served (eval.draft_sampling; vLLM's draft_sample_method, docs/temperature.md)
    proposer.draft_sampling = recipe.eval.draft_sampling
    return Target(model, proposer.aux_layer_ids), proposer, stop_token_ids(model, tokenizer), model.device


def decode_rows(recipe: Recipe, run_dir: Path, replay: Path, draft: Path, picks: list[tuple[str, list[int]]],
                span: int, new_tokens: int, seed: int, device: str | None) -> Iterator[dict[str, Any]]:
    """Decode the ``picks`` (``(row id, prefix token ids)``) not yet in ``replay/rows.jsonl`` and
    append one row each (module docstring, steps 2-3); yields each new row."""
    import torch

    from .spec_decode import SpecCounters, speculative_generate

    path = replay / ROWS_FILE
    done = read_rows(path)
    todo = [(n, pick) for n, pick in enumerate(picks) if pick[0] not in done]
    if not todo:
        return
    target, proposer, stops, dev = _decoder(recipe, run_dir, draft, device)
    k, temperature = recipe.eval.num_speculative_tokens, float(recipe.eval.temperature)
    with open(path, "ab") as f:
        for n, (rid, prefix) in todo:
            budget = min(new_tokens, recipe.data.max_length - len(prefix))
            counters, rejections = SpecCounters(k), []
            gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + n)
            out = speculative_generate(target, proposer, prefix, k, temperature, budget, stops, gen, counters,
                                       rejections)
            mask = replay_mask(len(prefix), len(out), rejections, span)
            row = {"id": rid, "input_ids": prefix + [int(t) for t in out], "loss_mask": mask,
                   "rejections": sum(1 for r in rejections if r < len(out)), "rounds": counters.drafts,
                   "accepted": counters.accepted_tokens, "scored": len(prefix) + counters.drafts * (k + 1),
                   "kept": any(mask)}
            append_row(f, row)
            yield row


def build_data(recipe: Recipe, run_dir: Path, opd: Path, rows: list[dict[str, Any]]) -> int:
    """``opd/data``: the run's shared files, ``rows`` (the kept ones, in order) as the tokenised
    set and their hidden states captured by the data stage (step 4). Returns the tokens captured.

    Raises:
        DiskFullError: less free space than the shards need (the data stage's check).
    """
    from ..data_prep.prepare import stage_hidden_states
    from ..layout import write_tokenized_rows
    from ..target import TargetInfo

    src, paths = RunLayout(run_dir).data, RunLayout(opd).data
    paths.root.mkdir(parents=True, exist_ok=True)
    for name in SHARED_DATA_FILES:
        if (src.root / name).is_file() and not (paths.root / name).is_file():
            shutil.copy2(src.root / name, paths.root / name)
    if not paths.tokenized_done.is_file():  # written once, after every row: a re-run captures the same rows
        write_tokenized_rows(paths, ({"id": r["id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
                                     for r in rows))
    records = read_tokenized(paths)
    if recipe.data.hidden_states_mode != "online":
        stage_hidden_states(recipe, paths, TargetInfo.read(paths.target_info), records)
    return sum(len(r["input_ids"]) for r in rows)


def sft_rows(run_dir: Path, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` of RUN_DIR's tokenised training conversations (:func:`pick_sft_rows`) as rows of
    the stage's set: ``{"id": "sft:<id>", "input_ids", "loss_mask"}``, their masks unchanged."""
    if count < 1:
        return []
    tokenized = read_tokenized(RunLayout(run_dir).data, format=None)
    masks = [list(m) for m in tokenized["loss_mask"]]
    return [{"id": f"sft:{tokenized[i]['id']}", "input_ids": [int(t) for t in tokenized[i]["input_ids"]],
             "loss_mask": [int(m) for m in masks[i]]} for i in pick_sft_rows(masks, count, seed)]


def build_replay_data(recipe: Recipe, run_dir: Path, opd: Path, checkpoint: Path, opts: Any) -> dict[str, Any]:
    """Steps 1-4 (module docstring) into ``opd/replay`` and ``opd/data``; resumable.

    Args:
        recipe: the OPD run's recipe; checkpoint: the run's trained checkpoint the draft starts from.
        opts: :class:`~draftsmith.eval.opd.OpdOptions` (prompts, conversations, prefixes, new_tokens, span, seed,
            sft_rows, device); the settings of the first attempt (``opd/replay/settings.json``) are kept on a re-run.

    Returns:
        the replay's settings and figures: continuations decoded, rows (kept: with a rejection), rejections, rounds,
        observed acceptance length, trained positions (of the replay rows; of the SFT rows added), tokens
        captured and ``target_tokens_scored``.

    Raises:
        ReplayError: the run's data has no conversation to cut (``--prompts``: the set cannot be
            read or has no prompt that fits), no row had a rejection, the disk filled while
            writing rows, or the rows file is not this stage's.
    """
    from ..eval.export import export

    replay = opd / "replay"
    replay.mkdir(parents=True, exist_ok=True)
    settings_file = replay / "settings.json"
    settings = {"prompts": opts.prompts, "conversations": opts.conversations,
                "prefixes": None if opts.prompts else opts.prefixes, "new_tokens": opts.new_tokens,
                "span": opts.span or recipe.eval.num_speculative_tokens + 1, "seed": opts.seed,
                "temperature": float(recipe.eval.temperature), "k": recipe.eval.num_speculative_tokens,
                "sft_rows": opts.sft_rows}
    if settings_file.is_file():  # the rows already written were made with these: keep them
        settings = json.loads(settings_file.read_text())
    else:
        settings_file.write_text(json.dumps(settings, indent=1))
    draft = replay / "draft"
    if not (draft / "config.json").is_file():
        export(checkpoint, draft, num_speculative_tokens=settings["k"])
    max_prefix = recipe.data.max_length - min(settings["new_tokens"], 16)
    if settings.get("prompts"):
        rendered = rendered_prompts(run_dir, settings["prompts"], recipe.target.trust_remote_code)
        picks = pick_prompts(rendered, settings["conversations"], max_prefix, settings["seed"])
        if not picks:
            raise ReplayError(f"--prompts {settings['prompts']}: no prompt of at most {max_prefix} tokens "
                              f"(data.max_length {recipe.data.max_length} less room for the new tokens)")
    else:
        tokenized = read_tokenized(RunLayout(run_dir).data, format=None)
        ids = [str(x) for x in tokenized["id"]]
        masks = [list(m) for m in tokenized["loss_mask"]]
        cuts = pick_prefixes(ids, masks, settings["conversations"], settings["prefixes"], max_prefix, settings["seed"])
        if not cuts:
            raise ReplayError(f"{RunLayout(run_dir).data.tokenized}: no conversation with a trained token to cut a "
                              "prefix at")
        picks = [(rid, [int(t) for t in tokenized[i]["input_ids"][:p]]) for rid, i, p in cuts]
    for _ in decode_rows(recipe, run_dir, replay, draft, picks, settings["span"], settings["new_tokens"],
                         settings["seed"], opts.device):
        pass
    written = read_rows(replay / ROWS_FILE)
    rows = [written[rid] for rid, _ in picks if rid in written]
    kept = [r for r in rows if r["kept"]]
    if not kept:
        raise ReplayError(f"replay: no rejection in {len(rows)} decoded continuations (the draft matched the target "
                          "everywhere): nothing to train on; raise --conversations / --new-tokens")
    sft = sft_rows(run_dir, settings.get("sft_rows", 0), settings["seed"])
    captured = build_data(recipe, run_dir, opd, kept + sft)
    rounds = sum(r["rounds"] for r in rows)
    figures = {**settings, "continuations": len(rows), "rows": len(kept), "rejections": sum(r["rejections"] for r in rows),
               "rounds": rounds, "acceptance_length": round(1 + sum(r["accepted"] for r in rows) / max(rounds, 1), 4),
               "trained_positions": sum(sum(r["loss_mask"]) for r in kept), "sft_rows": len(sft),
               "sft_trained_positions": sum(sum(r["loss_mask"]) for r in sft), "captured_tokens": captured,
               "target_tokens_scored": sum(r["scored"] for r in rows) + captured}
    (replay / "summary.json").write_text(json.dumps(figures, indent=1))
    return figures
