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
``assert_near`` takes the reference in float64. ``batch_norm_scales`` gives the magnitudes a
batch norm's sums work on, where a result cancels to about 0 (gradients) or the statistics are
ill-conditioned; ``assert_no_less_accurate`` holds a result to the FP32 kernel's own accuracy.

Where neither side is exact (plain torch's 16-bit kernels, or one computation run two ways, eager
and compiled say), ``rounding_bound`` and ``same_computation_bound`` count the roundings to each
dtype the two may differ by; ``assert_within`` checks any of these bounds.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple, Union

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
               scale: Union[float, torch.Tensor, None] = None,
               computed_in: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise |actual - reference| allowed for a computation in ``computed_in`` (FP32) of
    ``ops`` ``n``-term sums.

    ``scale`` is the magnitude the sums' errors are relative to (default: the reference's largest
    magnitude; a tensor gives one per element); the output's own rounding to ``out_dtype`` is
    relative to each element.
    """
    reference = reference.double()
    if scale is None:
        scale = reference.abs().max().item() if reference.numel() else 0.0
    fixed = ops * (sum_error(n, computed_in) + 2 * unit_roundoff(computed_in)) * scale
    return fixed + unit_roundoff(out_dtype) * (reference.abs() + fixed) + torch.finfo(out_dtype).tiny


def batch_norm_scales(x: torch.Tensor, weight: Union[torch.Tensor, None] = None,
                      grad_out: Union[torch.Tensor, None] = None, eps: float = 1e-5,
                      running: Union[Tuple[torch.Tensor, torch.Tensor], None] = None) -> Tuple[float, float, float]:
    """The magnitudes a batch norm's sums work on, as ``scale`` for :func:`fp32_bound`:
    ``(output, input gradient, parameter gradients)``; the gradients' are 0 without ``grad_out``.

    The batch statistics sum the input's values: their errors are relative to those values'
    magnitude, and the normalization divides them by the channel's standard deviation (large for a
    mean far from zero relative to the spread). The backward sums ``g`` and ``g * x_hat`` per
    channel (the parameter gradients); the input gradient subtracts their means, times ``x_hat``,
    from ``g``, and scales by ``weight / std``. ``running``: the (mean, var) an eval call
    normalizes with instead of the batch's.
    """
    channels = x.shape[1]
    values = x.detach().double().transpose(0, 1).reshape(channels, -1)
    if running is None:
        mean, var = values.mean(1), values.var(1, unbiased=False)
    else:
        mean, var = (s.detach().double() for s in running)
    std = (var + eps).sqrt()
    w = torch.ones(channels, dtype=torch.float64) if weight is None else weight.detach().double().abs()
    out = ((values.abs().max(1).values + mean.abs()) * w / std).max().item()
    if grad_out is None:
        return out, 0.0, 0.0
    g = grad_out.detach().double().transpose(0, 1).reshape(channels, -1).abs()
    x_hat = ((values - mean[:, None]) / std[:, None]).abs()
    params = (g * (1 + x_hat)).sum(1).max().item()
    input_grad = (g.max(1).values * (1 + x_hat.max(1).values) ** 2 * w / std).max().item()
    return out, input_grad, params


def assert_no_less_accurate(actual: torch.Tensor, kernel: torch.Tensor, reference: torch.Tensor,
                            factor: float = 4, roundings: float = 8, what: str = "") -> None:
    """``actual``'s error against the float64 ``reference`` is at most ``factor`` times that of
    ``kernel`` (torch's FP32 kernel on the same values) plus ``roundings`` FP32 roundings of the
    reference's magnitude: as accurate as the kernel, where :func:`fp32_bound` would also allow a
    long FP32 sum's error."""
    scale = reference.abs().max().item()
    kernel_error = (kernel.double() - reference).abs().max().item()
    error = (actual.double() - reference).abs().max().item()
    bound = factor * kernel_error + roundings * unit_roundoff(torch.float32) * scale
    assert error <= bound, f"{what} error {error:.3g} beyond {factor} times the FP32 kernel's {kernel_error:.3g}"


def assert_same_non_finite(actual: torch.Tensor, reference: torch.Tensor, what: str = "") -> torch.Tensor:
    """Asserts that ``actual`` is NaN, +inf and -inf exactly where ``reference`` is; returns where it is finite."""
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(actual), test(reference)), f"{what}: {test.__name__} differs from the reference"
    return torch.isfinite(reference)


def assert_near(actual: torch.Tensor, reference: torch.Tensor, n: int, ops: int = 4,
                scale: Union[float, torch.Tensor, None] = None, what: str = "", nonfinite: bool = False,
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


def rounding_bound(scale: Union[float, torch.Tensor], roundings: Union[Dict[torch.dtype, float], None] = None,
                   n: int = 1, sums: int = 0) -> Union[float, torch.Tensor]:
    """|a - b| allowed between two results neither of which is exact (plain torch's 16-bit run, say):
    ``roundings[dtype]`` roundings to each dtype, and ``sums`` FP32 ``n``-term sums at their worst
    (:func:`gamma`), of values of magnitude ``scale``."""
    rounded = sum(count * unit_roundoff(dtype) for dtype, count in (roundings or {}).items())
    return scale * (rounded + sums * gamma(n))


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: Union[float, torch.Tensor],
                  what: str = "") -> None:
    """|actual - expected| <= ``bound`` (from :func:`rounding_bound` or :func:`fp32_bound`) everywhere."""
    err = (actual.double() - expected.double()).abs()
    if not err.numel():
        return
    excess = (err - bound).max().item()
    worst = torch.as_tensor(bound).max().item()
    assert excess <= 0, f"{what} error {err.max().item():.3g} beyond the bound {worst:.3g}"


def same_computation_bound(expected: torch.Tensor, roundings: Dict[torch.dtype, float]) -> torch.Tensor:
    """|a - expected| allowed where ``a`` is one computation run another way (exported, traced,
    scripted or compiled rather than eager; or plain torch where the result is rounded to 16 bits
    all the same): ``roundings`` of each element's magnitude plus of the largest one, for values
    that cancel to about 0."""
    magnitude = expected.detach().double().abs()
    return rounding_bound(magnitude + (magnitude.max() if magnitude.numel() else 0.0), roundings)
