"""Numeric tolerances derived from the dtype's rounding and the computation's length, so that a
comparison holds on every CPU and GPU instead of at the edge of the one machine it was first
measured on.

Two engines computing the same function with different kernels (vLLM against transformers,
a fused kernel against a loop) round at different places. Each rounding adds a relative error of
at most the dtype's unit roundoff ``u = eps / 2`` (bf16: ``2**-8``; fp32: ``2**-24``). After
``n`` roundings the worst case (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
ed., Lemma 3.1) is ``gamma_n = n u / (1 - n u)``; when the errors are independent and of mean
zero, as they are between unrelated kernels, the probabilistic bound of Higham and Mary (SIAM J.
Sci. Comput. 41(5), 2019) holds instead: ``lambda * sqrt(n) * u`` with probability at least
``1 - 2 exp(-lambda**2 / 2)``. A test of a quantile (most states) takes the probabilistic bound at
the ``lambda`` of that quantile; a test of the maximum takes the worst case.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """``eps / 2`` of ``dtype``: the largest relative error of one round-to-nearest."""
    return torch.finfo(dtype).eps / 2


def lambda_for(fraction: float) -> float:
    """The ``lambda`` of Higham and Mary's bound that holds with probability ``fraction``:
    ``1 - 2 exp(-lambda**2 / 2) = fraction`` (0.95 -> 2.72)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    return math.sqrt(2 * math.log(2 / (1 - fraction)))


def probable_relative_error(dtype: torch.dtype, roundings: int, fraction: float = 0.95) -> float:
    """Relative error that ``fraction`` of the results stay within after ``roundings``
    independent roundings in ``dtype`` (counted over both engines of a comparison):
    ``lambda(fraction) * sqrt(roundings) * u``."""
    return lambda_for(fraction) * math.sqrt(roundings) * unit_roundoff(dtype)


def worst_relative_error(dtype: torch.dtype, roundings: int) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative error no result exceeds after ``roundings``
    roundings in ``dtype``, however they correlate.

    Raises:
        ValueError: ``n u >= 1`` (the bound says nothing).
    """
    nu = roundings * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{roundings} roundings in {dtype}: n*u = {nu:.3g} >= 1, no bound")
    return nu / (1 - nu)


def residual_stream_roundings(num_layers: int, engines: int = 2, summation: int = 1) -> int:
    """The roundings of a decoder's residual stream up to the state after ``num_layers`` layers,
    over ``engines`` engines: each layer adds two sublayer outputs (attention, MLP or MoE) to the
    stream; each add is rounded once and each sublayer output ``summation`` times, plus the final
    norm (``+ 1``). ``summation``: 1 where the matmuls accumulate in a wider type and round their
    output once (bf16 kernels accumulate in fp32); the inner-product length (the hidden size)
    where they accumulate in the dtype itself (fp32: every partial sum is rounded, Higham's
    ``gamma_K`` of a dot product of ``K`` terms)."""
    return engines * (2 * num_layers * (1 + summation) + 1)


def relative_error(got: torch.Tensor, want: torch.Tensor, hidden: int) -> torch.Tensor:
    """Per token and state: max |got - want| over the H channels over the reference state's L2
    norm; ``(T, k*H)`` -> ``(T, k)``."""
    T = len(want)
    diff = (got.float() - want.float()).reshape(T, -1, hidden).abs().amax(-1)
    return diff / want.float().reshape(T, -1, hidden).norm(dim=-1)
