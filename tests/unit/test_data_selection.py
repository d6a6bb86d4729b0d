"""Data selection (``data.select``, SFDD arXiv:2601.18902): the per-sequence scores written at
capture against a hand-computed entropy / flatness of the tiny target's own logits, the scores of
shards captured without them (``hidden_states score``: resumable, atomic), which sequences the
selection keeps, that the validation set does not change with it, and that off changes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.data_prep.hidden_states import generate_hidden_states
from draftsmith.data_prep.scores import (
    SCORES,
    SCORES_FILE,
    SequenceScorer,
    read_scores,
    score_shards,
    scores_entry,
    select_top,
    sequence_scores,
    token_scores,
    vocab_key,
)
from draftsmith.data_prep.shards import ShardSpec
from draftsmith.layout import RunLayout
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.target import load_target
from draftsmith.train.data import HiddenStateDataset
from draftsmith.train.selection import DataSelectionError, dry_run_line, select_training
from draftsmith.train.validation import dataset_ids

from helpers.tiny import TINY_AUX, make_records

VD = 64  # draft vocab of the tests (of the tiny target's 512 ids)


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_target(tiny_target)


def draft_vocab(V: int, Vd: int = VD, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    return d2t, t2d


def hand_scores(model, record: dict, t2d: torch.Tensor) -> tuple[float, float]:
    """Entropy and cos(p, u) of the target's own logits (the full model's forward, lm_head
    included) restricted to the draft vocab, averaged over positions s with loss_mask[s+1] = 1,
    in float64 with plain sums."""
    ids = torch.tensor([record["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()[:, t2d]  # (T, Vd)
    ents, flats = [], []
    for s in range(len(record["input_ids"]) - 1):
        if not record["loss_mask"][s + 1]:
            continue
        z = logits[s] - logits[s].max()
        p = z.exp() / z.exp().sum()
        ents.append(float(-(p * p.log()).sum()))
        u = torch.full_like(p, 1.0 / p.numel())
        flats.append(float((p * u).sum() / (p.norm() * u.norm())))
    return sum(ents) / len(ents), sum(flats) / len(flats)


def capture_run(model, run: Path, records: list[dict], scored: bool = True, seed: int = 0) -> Path:
    """``run/data``: the vocab file and the shards of ``records`` (3 per shard), with capture
    scores when ``scored``."""
    paths = RunLayout(run).data
    paths.root.mkdir(parents=True, exist_ok=True)
    d2t, t2d = draft_vocab(model.config.vocab_size, seed=seed)
    save_file({"d2t": d2t, "t2d": t2d}, str(paths.vocab))
    scorer = SequenceScorer(lambda: model.lm_head.weight.detach()[t2d], vocab_key(d2t)) if scored else None
    spec = ShardSpec(model.config.hidden_size, TINY_AUX, "float32")
    generate_hidden_states(model, records, paths.hidden_states, spec, sequences_per_shard=3, batch_tokens=40,
                           progress=False, scorer=scorer)
    return run


def stored_records(paths, records: list[dict]) -> list[dict]:
    """``records`` in the shards' sequence order."""
    by_id = {r["id"]: r for r in records}
    return [by_id[i] for i in dataset_ids(HiddenStateDataset(paths.hidden_states))]


def test_token_scores_equal_the_definitions_in_float64_and_do_not_depend_on_the_chunk():
    g = torch.Generator().manual_seed(0)
    final, weight = torch.randn(11, 16, generator=g), torch.randn(40, 16, generator=g) * 3
    ent, flat = token_scores(final, weight, chunk_rows=4)
    p = torch.softmax(final.double() @ weight.double().T, dim=-1)
    torch.testing.assert_close(ent.double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat.double(), 1 / (math.sqrt(40) * p.norm(dim=-1)), rtol=1e-5, atol=1e-6)
    ent1, flat1 = token_scores(final, weight)
    torch.testing.assert_close(ent1, ent)
    torch.testing.assert_close(flat1, flat)
    # a sequence without a trained position has no score (kept last by the selection)
    none = sequence_scores(final, torch.zeros(11, dtype=torch.long), weight)
    assert scores_entry("v", [none])["entropy"] == [None]
    # the mean is over the positions s with loss_mask[s + 1] = 1 only
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0])
    torch.testing.assert_close(sequence_scores(final, mask, weight), torch.stack([ent[[2, 3, 6]].mean(),
                                                                                  flat[[2, 3, 6]].mean()]))
    # the bounds: uniform logits give log Vd and cos 1
    e0, f0 = token_scores(torch.zeros(1, 16), weight)
    assert e0.item() == pytest.approx(math.log(40), rel=1e-6) and f0.item() == pytest.approx(1.0, rel=1e-6)


def test_capture_writes_each_sequences_entropy_and_flatness_over_the_draft_vocab(tiny, tmp_path):
    model, _ = tiny
    records = make_records(7, model.config.vocab_size, seed=3)
    run = capture_run(model, tmp_path / "run", records)
    paths = RunLayout(run).data
    d2t, t2d = draft_vocab(model.config.vocab_size)
    manifest = json.loads((paths.hidden_states / "manifest.json").read_text())
    assert all(s["scores"]["vocab"] == vocab_key(d2t) for s in manifest["shards"])
    scores = read_scores(paths.hidden_states, vocab_key(d2t))
    assert set(scores) == set(SCORES)
    for k, record in enumerate(stored_records(paths, records)):
        ent, flat = hand_scores(model, record, t2d)
        assert scores["entropy"][k] == pytest.approx(ent, rel=1e-4, abs=1e-5), record["id"]
        assert scores["flatness"][k] == pytest.approx(flat, rel=1e-4, abs=1e-6), record["id"]
    assert read_scores(paths.hidden_states, "another-vocab") is None  # scores are of one draft vocab
    # the scores differ between sequences (a selection has something to choose between)
    assert len({round(v, 4) for v in scores["entropy"]}) > 3


def test_a_wrong_score_goes_red(tiny):
    """The hand-computed reference catches the mistakes a scorer could make: the position whose
    distribution counts (loss_mask[s] instead of loss_mask[s + 1]) and the vocab (all ids)."""
    model, _ = tiny
    record = make_records(1, model.config.vocab_size, seed=5)[0]
    record["loss_mask"] = [0] * 6 + [1] * (len(record["input_ids"]) - 6)
    d2t, t2d = draft_vocab(model.config.vocab_size)
    ids = torch.tensor([record["input_ids"]])
    with torch.no_grad():
        final = model.model(input_ids=ids).last_hidden_state[0]
    ent, _ = hand_scores(model, record, t2d)
    good = SequenceScorer(lambda: model.lm_head.weight.detach()[t2d], "v")(final, record["loss_mask"])
    assert good[0].item() == pytest.approx(ent, rel=1e-4)
    shifted = SequenceScorer(lambda: model.lm_head.weight.detach()[t2d], "v")(final, record["loss_mask"][1:] + [0])
    full_vocab = SequenceScorer(lambda: model.lm_head.weight.detach(), "v")(final, record["loss_mask"])
    assert shifted[0].item() != pytest.approx(ent, rel=1e-3)
    assert full_vocab[0].item() != pytest.approx(ent, rel=1e-3)


def test_scores_of_shards_captured_without_them_are_computed_resumably(tiny, tmp_path):
    model, _ = tiny
    records = make_records(8, model.config.vocab_size, seed=4)
    with_scores = RunLayout(capture_run(model, tmp_path / "a", records)).data
    old = RunLayout(capture_run(model, tmp_path / "b", records, scored=False)).data
    d2t, t2d = draft_vocab(model.config.vocab_size)
    assert "scores" not in json.loads((old.hidden_states / "manifest.json").read_text())["shards"][0]
    assert read_scores(old.hidden_states, vocab_key(d2t)) is None
    scorer = SequenceScorer(lambda: model.lm_head.weight.detach()[t2d], vocab_key(d2t))
    assert score_shards(old.hidden_states, scorer, progress=False) == {"shards": 3, "scored": 3, "sequences": 8}
    want, got = read_scores(with_scores.hidden_states, vocab_key(d2t)), read_scores(old.hidden_states, vocab_key(d2t))
    for name in SCORES:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6)
    # resumable: a rerun scores nothing; a shard whose entry is lost (killed before its write) is redone alone
    assert score_shards(old.hidden_states, scorer, progress=False)["scored"] == 0
    side = json.loads((old.hidden_states / SCORES_FILE).read_text())
    del side["shards"]["shard-00001.safetensors"]
    (old.hidden_states / SCORES_FILE).write_text(json.dumps(side))
    assert score_shards(old.hidden_states, scorer, progress=False)["scored"] == 1
    assert read_scores(old.hidden_states, vocab_key(d2t)) == got
    assert not list(old.hidden_states.glob(".*.tmp-*"))  # written atomically
    # scores.json is draftsmith's: --overwrite-data deletes it with the shards, nothing is foreign
    from draftsmith.data_prep.agreement import data_files

    assert data_files(tmp_path / "b")[1] == []


def test_select_top_keeps_the_highest_scores_deterministically():
    scores = [0.5, 2.0, None, 1.0, 2.0, 0.1]
    assert select_top([0, 1, 2, 3, 4, 5], scores, 0.5) == [1, 3, 4]
    assert select_top([0, 1, 3, 5], scores, 0.5) == [1, 3]  # within the given (training) indices only
    assert select_top([0, 1, 2, 3, 4, 5], scores, 0.34) == [1, 4]  # round(2.04) = 2; the tie by index
    assert select_top([2, 5], scores, 0.5) == [5]  # no score: last
    assert select_top([0, 1, 2], scores, 1.0) == [0, 1, 2]
    assert select_top([0, 1, 2], scores, 0.01) == [1]  # at least one
    with pytest.raises(ValueError, match=r"data.select.keep_fraction=1.5"):
        select_top([0], scores, 1.5)


def test_keep_fraction_outside_0_1_is_one_clear_recipe_error():
    with pytest.raises(RecipeError, match=r"data.select.keep_fraction"):
        load_recipe(None, ["data.select={score: entropy, keep_fraction: 0}"])
    with pytest.raises(RecipeError, match=r"data.select.score"):
        load_recipe(None, ["data.select={score: perplexity, keep_fraction: 0.5}"])
    with pytest.raises(RecipeError, match=r"data.select needs data.hidden_states_mode: offline"):
        load_recipe(None, ["data.select={score: entropy, keep_fraction: 0.5}", "data.hidden_states_mode=online"])
    assert load_recipe(None, []).data.select is None  # off by default


def _trainer_data(run: Path, recipe):
    """The trainer's datasets as ``Trainer._build_data`` builds them, for a stub method over the
    run's shards: ``(training sequence indices, validation sequence indices)``."""
    from draftsmith.train.trainer import Trainer

    method = SimpleNamespace(dataset=lambda: HiddenStateDataset(RunLayout(run).data.hidden_states),
                             uses_attention=False)
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)
    trainer = Trainer(recipe, method, run, accelerator=acc)
    trainer._build_data()
    train = trainer.loader.dataset
    train_idx = list(range(len(train.dataset))) if train.indices is None else list(train.indices)
    val_idx = None if trainer.val_set is None else list(trainer.val_set.indices)
    return train_idx, val_idx


def test_selection_keeps_the_top_training_sequences_and_leaves_validation_alone(tiny, tmp_path):
    model, _ = tiny
    records = [dict(r, id=f"c{i // 2}_gen{i % 2}") for i, r in enumerate(make_records(12, model.config.vocab_size))]
    run = capture_run(model, tmp_path / "run", records)
    paths = RunLayout(run).data
    d2t, _ = draft_vocab(model.config.vocab_size)
    entropy = read_scores(paths.hidden_states, vocab_key(d2t))["entropy"]
    base = ["train.batch_size=2", "data.validation_fraction=0.34"]
    all_train, val = _trainer_data(run, load_recipe(None, base))
    assert val and len(all_train) + len(val) == 12
    kept, val_sel = _trainer_data(run, load_recipe(None, base + ["data.select={score: entropy, keep_fraction: 0.5}"]))
    assert val_sel == val  # the validation set does not change with the selection
    assert len(kept) == round(0.5 * len(all_train)) and set(kept) <= set(all_train)
    dropped = set(all_train) - set(kept)
    assert min(entropy[i] for i in kept) >= max(entropy[i] for i in dropped)
    # off (the default) trains on every sequence, as before; without validation the selection takes all
    assert _trainer_data(run, load_recipe(None, ["train.batch_size=2"])) == (list(range(12)), None)
    top, _ = _trainer_data(run, load_recipe(None, ["data.select={score: flatness, keep_fraction: 0.25}"]))
    flat = read_scores(paths.hidden_states, vocab_key(d2t))["flatness"]
    assert top == sorted(sorted(range(12), key=lambda i: -flat[i])[:3])
    # the dry run counts what it keeps
    line = dry_run_line(load_recipe(None, base + ["data.select={score: entropy, keep_fraction: 0.5}"]), run)
    assert line.startswith(f"data.select: keeps {len(kept)} of {len(all_train)} training sequences (")


def test_selection_without_scores_names_the_key_and_the_command(tiny, tmp_path):
    model, _ = tiny
    run = capture_run(model, tmp_path / "run", make_records(4, model.config.vocab_size), scored=False)
    recipe = load_recipe(None, ["data.select={score: flatness, keep_fraction: 0.5}"])
    dataset = HiddenStateDataset(RunLayout(run).data.hidden_states)
    with pytest.raises(DataSelectionError, match=r"^data.select.score=flatness: .*hidden_states has no scores.*"
                                                 r"python -m draftsmith.cli.hidden_states score "):
        select_training(dataset, None, recipe.data.select, RunLayout(run).data)
    assert "hidden_states score" in dry_run_line(recipe, run)
    with pytest.raises(DataSelectionError, match="needs the hidden-state shards"):
        select_training(object(), None, recipe.data.select, RunLayout(run).data)


def test_the_score_command_scores_a_prepared_run_from_the_target_checkpoint(tiny, tiny_target, tmp_path, capsys):
    from draftsmith.cli.hidden_states import main
    from draftsmith.target import TargetInfo

    model, _ = tiny
    records = make_records(5, model.config.vocab_size, seed=6)
    want = read_scores(RunLayout(capture_run(model, tmp_path / "a", records)).data.hidden_states,
                       vocab_key(draft_vocab(model.config.vocab_size)[0]))
    run = capture_run(model, tmp_path / "b", records, scored=False)
    assert main(["score", str(run)]) == 1  # no target.json: one line naming it and the stage
    assert "target.json missing: run draftsmith prepare RECIPE" in capsys.readouterr().err
    TargetInfo(path=str(tiny_target)).write(RunLayout(run).data.target_info)
    assert main(["score", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["scored"] == 2
    got = read_scores(RunLayout(run).data.hidden_states, vocab_key(draft_vocab(model.config.vocab_size)[0]))
    for name in SCORES:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6)

