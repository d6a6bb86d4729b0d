"""The tolerances the numeric comparisons derive from the dtype's rounding (helpers/tolerance.py)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tolerance import (lambda_for, probable_relative_error, residual_stream_roundings, unit_roundoff,
                               worst_relative_error)


def test_unit_roundoff_is_half_an_ulp_of_one():
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert unit_roundoff(torch.float32) == 2.0 ** -24
    # rounding 1 + u/2 to the dtype gives 1; 1 + 2u is representable
    assert float(torch.tensor(1 + unit_roundoff(torch.bfloat16) / 2).to(torch.bfloat16)) == 1.0
    assert float(torch.tensor(1 + 2 * unit_roundoff(torch.bfloat16)).to(torch.bfloat16)) > 1.0


def test_lambda_inverts_the_probability_of_higham_and_mary():
    for fraction in (0.5, 0.95, 0.999):
        lam = lambda_for(fraction)
        assert 1 - 2 * math.exp(-lam ** 2 / 2) == pytest.approx(fraction)
    assert lambda_for(0.95) == pytest.approx(2.716, abs=1e-3)
    with pytest.raises(ValueError, match="fraction"):
        lambda_for(1.0)


def test_bounds_grow_with_the_computation_and_the_worst_case_bounds_the_probable_one_for_long_ones():
    short, long = residual_stream_roundings(1), residual_stream_roundings(6)
    assert (short, long) == (2 * 5, 2 * 25)
    assert residual_stream_roundings(1, engines=1, summation=64) == 2 * 65 + 1
    for dtype in (torch.bfloat16, torch.float32):
        assert probable_relative_error(dtype, short) < probable_relative_error(dtype, long)
        assert worst_relative_error(dtype, short) < worst_relative_error(dtype, long)
        assert probable_relative_error(dtype, long) < worst_relative_error(dtype, long)
    with pytest.raises(ValueError, match="no bound"):
        worst_relative_error(torch.bfloat16, 256)


def test_random_roundings_stay_within_the_probable_bound_at_its_level():
    """A long bf16 running sum against the fp32 one: the relative error of 95 % of the sums stays
    within the bound at the 95 % level (the worst case is far looser)."""
    g = torch.Generator().manual_seed(0)
    n, trials = 64, 2000
    x = torch.rand(trials, n, generator=g) + 0.5  # positive terms: no cancellation
    acc = torch.zeros(trials, dtype=torch.bfloat16)
    for i in range(n):
        acc = (acc + x[:, i].to(torch.bfloat16)).to(torch.bfloat16)  # one rounding a term
    exact = x.to(torch.bfloat16).double().sum(-1)
    rel = ((acc.double() - exact).abs() / exact)
    assert torch.quantile(rel, 0.95) <= probable_relative_error(torch.bfloat16, n)
    assert rel.max() <= worst_relative_error(torch.bfloat16, n)
