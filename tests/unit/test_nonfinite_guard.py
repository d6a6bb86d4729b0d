"""The non-finite guard in-process: non-finite gradients are skipped on the device, and runs of
them are counted up to the limit."""

from __future__ import annotations

import pytest
import torch
from draftsmith.train.checkpoint import TrainState
from draftsmith.train.components.nonfinite import NonFiniteGuard, NonFiniteLossError


def _params_and_optimizer(fused: bool) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    return params, torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=fused or None)


def _one_step(params, optimizer, guard, grads: list[torch.Tensor], loss: float = 1.0, norm: float | None = None):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    guard.note_loss(torch.tensor(loss))
    if norm is not None:
        guard.note_grad_norm(torch.tensor(norm))
    optimizer.step()
    guard.end_step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "fallback"])
def test_guard_skips_nonfinite_gradients_on_the_device(fused):
    """``check_grads`` (DeepSpeed: the partition ZeRO hands the optimizer): one NaN gradient element
    skips the whole step, parameters, moments, step count and weight decay included."""
    params, optimizer = _params_and_optimizer(fused)
    guard = NonFiniteGuard(optimizer, torch.device("cpu"), num_processes=1, check_grads=True)
    assert guard.fused is fused
    good = [torch.ones(4, 3), torch.ones(5)]
    _one_step(params, optimizer, guard, good)
    snapshot = [p.detach().clone() for p in params]
    state = {i: {k: v.clone() for k, v in optimizer.state[p].items()} for i, p in enumerate(params)}
    bad = [torch.ones(4, 3), torch.ones(5)]
    bad[1][2] = float("nan")
    _one_step(params, optimizer, guard, bad)
    assert all(torch.equal(a, p) for a, p in zip(snapshot, params))
    for i, p in enumerate(params):
        for k, v in state[i].items():
            assert torch.equal(v, optimizer.state[p][k]), (i, k)
    _one_step(params, optimizer, guard, good)
    assert not torch.equal(snapshot[0], params[0])
    assert [int(x) for x in optimizer.state[params[0]]["step"].reshape(1).tolist()] == [2]

    state_out = TrainState(step=3)
    guard.absorb(guard.read(), state_out, max_in_a_row=5, last_ckpt=None)
    assert (state_out.nonfinite_skipped, state_out.nonfinite_in_a_row) == (1, 0)


def test_guard_counts_runs_and_stops_at_the_limit():
    params, optimizer = _params_and_optimizer(True)
    guard = NonFiniteGuard(optimizer, torch.device("cpu"), num_processes=1)
    ones = [torch.ones(4, 3), torch.ones(5)]
    for loss in (float("nan"), 1.0, float("inf"), float("nan"), float("nan")):
        _one_step(params, optimizer, guard, ones, loss=loss)
    state = TrainState(step=5)
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row"):
        guard.absorb(guard.read(), state, max_in_a_row=3, last_ckpt=None)
    assert (state.nonfinite_skipped, state.nonfinite_in_a_row) == (4, 3)
    # a non-finite gradient norm (one process / DDP / FSDP2: the clipped global norm) skips too
    guard.restore(0)
    _one_step(params, optimizer, guard, ones, norm=float("inf"))
    guard.absorb(guard.read(), state, max_in_a_row=3, last_ckpt=None)
    assert (state.nonfinite_skipped, state.nonfinite_in_a_row) == (5, 1)


# -- NonFiniteShards: which shard handed the trainer non-finite hidden states

SHARD_FILES = ("shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors")


def _shard_reader(tmp_path):
    """A reader of three shards of two sequences each (global sequences 0-5), as
    :class:`~draftsmith.train.components.nonfinite.NonFiniteShards` reads it."""
    from types import SimpleNamespace

    shards = [{"file": f, "ids": [f"rec-{k}-{i}" for i in range(2)]} for k, f in enumerate(SHARD_FILES)]
    index = [(f, i, 8) for f in SHARD_FILES for i in range(2)]
    return SimpleNamespace(manifest={"shards": shards}, index=index, dir=tmp_path / "data" / "hidden_states")


def _states_batch(sequences: list[int], T: int = 8):
    """Finite aux ``(B, T, 3*16)`` / final ``(B, T, 16)`` states of rows of ``sequences``, every token real;
    the ``(B, T)`` sequence index of each token."""
    g = torch.Generator().manual_seed(0)
    B = len(sequences)
    batch = {"input_ids": torch.randint(0, 50, (B, T), generator=g),
             "aux_hidden_states": torch.randn(B, T, 48, generator=g).to(torch.bfloat16),
             "final_hidden_states": torch.randn(B, T, 16, generator=g).to(torch.bfloat16),
             "attention_mask": torch.ones(B, T, dtype=torch.long)}
    return batch, torch.tensor(sequences)[:, None].expand(B, T).contiguous()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("key", ["final_hidden_states", "aux_hidden_states"], ids=["final_only", "aux_only"])
def test_shards_with_nonfinite_states_are_named_whichever_states_are_bad(tmp_path, caplog, key, bad):
    """A shard whose FINAL hidden states alone are non-finite (its aux states finite) is counted and
    named like one with bad aux states; a bad value under padding is not counted."""
    from draftsmith.train.components.nonfinite import NonFiniteShards

    faults = NonFiniteShards(_shard_reader(tmp_path), torch.device("cpu"))
    batch, sequence = _states_batch([1, 3, 4])  # shard 0, shard 1 (its 2nd sequence), shard 2
    batch[key][1, 2, 5] = bad  # one element of one token of sequence 3
    batch[key][1, 6, :] = bad  # and a whole token of it
    batch[key][2, 7, 0] = bad  # sequence 4's last token, padding here
    batch["attention_mask"][2, 7] = 0
    assert all(batch[k].isfinite().all() for k in ("aux_hidden_states", "final_hidden_states") if k != key)
    faults.note(batch, sequence)
    none = len(faults.reader.index)
    assert faults.values(torch.float32).tolist() == [0.0, 2.0, 0.0, none, 3, none]

    state = TrainState(step=1)
    caplog.set_level("WARNING", logger="draftsmith.train")
    faults.absorb(faults.values(torch.float32).tolist(), state)
    where = f"{tmp_path / 'data' / 'hidden_states' / SHARD_FILES[1]} (sequence 1 of the shard, id 'rec-1-1')"
    warnings = [r.getMessage() for r in caplog.records if "non-finite hidden states in" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"non-finite hidden states in {where}: "), warnings
    assert state.nonfinite_shards == {SHARD_FILES[1]: where}
    assert faults.cause() == (f"first shard with non-finite hidden states: {where}; recompute it with: "
                              f"draftsmith prepare RECIPE --run-dir {tmp_path} --verify-shards (prepare checks the shards "
                              "it keeps and recomputes a damaged one)")


def test_finite_states_name_no_shard(tmp_path):
    from draftsmith.train.components.nonfinite import NonFiniteShards

    faults = NonFiniteShards(_shard_reader(tmp_path), torch.device("cpu"))
    batch, sequence = _states_batch([0, 5])
    faults.note(batch, sequence)
    assert faults.counts.tolist() == [0.0, 0.0, 0.0] and faults.cause() is None
