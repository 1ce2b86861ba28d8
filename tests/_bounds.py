"""Error bounds for comparing a result with a float64 reference.

A result computed in FP32 from sums of ``n`` terms carries the rounding errors of those sums. The
worst case (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.4) is
``gamma(n) = n*u / (1 - n*u)`` relative to the sum of the terms' magnitudes, with ``u`` the unit
roundoff (half of ``torch.finfo(dtype).eps``). Rounding errors of a long sum are independent enough
that, with probability at least ``1 - 2 exp(-lambda**2 / 2)``, they stay within
``lambda * sqrt(n) * u`` (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019): with ``lambda = 6``
that is a chance below 2e-8 of a false alarm per sum, and a bound independent of how a kernel
orders or vectorises its sum. A batch norm chains a handful of such reductions (mean, variance,
and in backward the two sums over the gradient), so the bound is counted ``ops`` times, and a
16-bit output adds the one rounding to its dtype.

These bounds are for comparisons with float64 (never two FP32 implementations with each other):
``assert_near`` takes the reference in float64.
"""

from __future__ import annotations

import math
from typing import Dict, Union

import torch

LAMBDA = 6.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's worst-case relative error of an ``n``-term sum in ``dtype``."""
    u = unit_roundoff(dtype)
    return n * u / (1 - n * u)


def sum_error(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The probabilistic relative error of an ``n``-term sum in ``dtype`` (see the module docstring)."""
    return LAMBDA * math.sqrt(max(n, 1)) * unit_roundoff(dtype)


def fp32_bound(reference: torch.Tensor, n: int, out_dtype: torch.dtype = torch.float32, ops: int = 4,
               scale: Union[float, None] = None, computed_in: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise |actual - reference| allowed for a computation in ``computed_in`` (FP32) of
    ``ops`` ``n``-term sums.

    ``scale`` is the magnitude the sums' errors are relative to (default: the reference's largest
    magnitude); the output's own rounding to ``out_dtype`` is relative to each element.
    """
    reference = reference.double()
    if scale is None:
        scale = reference.abs().max().item() if reference.numel() else 0.0
    fixed = ops * (sum_error(n, computed_in) + 2 * unit_roundoff(computed_in)) * scale
    return fixed + unit_roundoff(out_dtype) * (reference.abs() + fixed) + torch.finfo(out_dtype).tiny


def assert_same_non_finite(actual: torch.Tensor, reference: torch.Tensor, what: str = "") -> torch.Tensor:
    """Asserts that ``actual`` is NaN, +inf and -inf exactly where ``reference`` is; returns where it is finite."""
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(actual), test(reference)), f"{what}: {test.__name__} differs from the reference"
    return torch.isfinite(reference)


def assert_near(actual: torch.Tensor, reference: torch.Tensor, n: int, ops: int = 4,
                scale: Union[float, None] = None, what: str = "", nonfinite: bool = False,
                computed_in: torch.dtype = torch.float32) -> None:
    """``actual`` is ``reference`` (float64) computed in FP32 over sums of ``n`` terms, then rounded once.

    ``nonfinite``: the reference may hold NaN or inf; ``actual`` must hold the same there.
    ``computed_in``: the precision of the computation, for a float64 one checked against another
    float64 one (numpy's).
    """
    assert reference.dtype is torch.float64, "compare with a float64 reference"
    out_dtype, actual = actual.dtype, actual.double()
    if nonfinite:
        finite = assert_same_non_finite(actual, reference, what)
        actual, reference = actual[finite], reference[finite]
    bound = fp32_bound(reference, n, out_dtype, ops, scale, computed_in)
    err = (actual - reference).abs()
    excess = (err - bound).max().item() if err.numel() else 0.0
    assert excess <= 0, f"{what} error {err.max().item():.3g} beyond the bound {bound.max().item():.3g} (n={n})"


def rounding_bound(scale: float, roundings: Union[Dict[torch.dtype, float], None] = None, n: int = 1,
                   sums: int = 0) -> float:
    """|a - b| allowed between two results neither of which is exact (plain torch's 16-bit run, say):
    ``roundings[dtype]`` roundings to each dtype, and ``sums`` FP32 ``n``-term sums at their worst
    (:func:`gamma`), of values of magnitude ``scale``."""
    rounded = sum(count * unit_roundoff(dtype) for dtype, count in (roundings or {}).items())
    return scale * (rounded + sums * gamma(n))


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: Union[float, torch.Tensor],
                  what: str = "") -> None:
    """|actual - expected| <= ``bound`` (from :func:`rounding_bound` or :func:`fp32_bound`) everywhere."""
    err = (actual.double() - expected.double()).abs()
    excess = (err - bound).max().item() if err.numel() else 0.0
    assert excess <= 0, f"{what} error {err.max().item():.3g} beyond the bound {torch.as_tensor(bound).max().item():.3g}"
