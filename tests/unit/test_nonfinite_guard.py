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
