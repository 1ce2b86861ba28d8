"""The BatchNorm modules and inputs the tests build, and the float64 batch norm they are checked against.

``batch_norm`` is a BatchNorm1d/2d/3d with seeded parameters (and, on request, running stats) that
are not the identity, so a mix-up of weight, bias, mean or variance shows; ``half_model`` is one
cast to 16 bits as ``model.half()`` casts it. ``seeded_input`` is a seeded input in a memory
layout. Each draws from its own generator, or from one the caller shares between them, never from
torch's global one. ``fp64_batch_norm`` is torch's batch norm run in float64 on the very
same values (a float64 call is never handled by the shim), ``fp64_module`` the same with a
module's parameters, stats and flags.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from _shared import ORIGINAL

BATCH_NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
Seed = Union[int, torch.Generator]


def _generator(seed: Seed) -> torch.Generator:
    # Never torch's global generator: a test's values do not depend on what ran before it.
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)


def batch_norm(dims: int, channels: int, affine: bool = True, track_running_stats: bool = True,
               seeded_stats: bool = False, seed: Seed = 0) -> nn.Module:
    """A ``BatchNorm{dims}d(channels)`` with weight in [0.5, 1.5) and a standard normal bias, and with
    ``seeded_stats`` a standard normal running mean and a running var in [0.5, 1.5) instead of zeros
    and ones. ``seed``: an int, or a generator to go on drawing from (the input's, say)."""
    gen = _generator(seed)
    bn = BATCH_NORMS[dims](channels, affine=affine, track_running_stats=track_running_stats)
    with torch.no_grad():
        if affine:
            bn.weight.copy_(torch.rand(channels, generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(channels, generator=gen))
        if seeded_stats and track_running_stats:
            bn.running_mean.copy_(torch.randn(channels, generator=gen))
            bn.running_var.copy_(torch.rand(channels, generator=gen) + 0.5)
    return bn


def half_model(dtype: torch.dtype, dims: int, channels: int, **kwargs) -> nn.Module:
    """:func:`batch_norm` cast to ``dtype`` as ``model.to(dtype)`` casts it (with the shim's default
    ``keep_fp32="master"``: 16-bit parameters and buffers, the stats' FP32 master kept aside)."""
    return batch_norm(dims, channels, **kwargs).to(dtype)


def seeded_input(shape: Sequence[int], dtype: torch.dtype, seed: Seed = 1, scale: float = 1.0, shift: float = 0.0,
                 layout: str = "contiguous") -> torch.Tensor:
    """``randn(shape) * scale + shift`` drawn with ``seed`` (as for :func:`batch_norm`), rounded once to
    ``dtype``, ``"contiguous"`` or ``"channels_last"`` (``channels_last_3d`` for a 5-d shape)."""
    x = (torch.randn(shape, generator=_generator(seed)) * scale + shift).to(dtype)
    return channels_last(x) if layout == "channels_last" else x


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with channels_last strides (``channels_last_3d`` for 5 dimensions), as a channels_last op
    writes them: also where the shape makes them ambiguous (1x1 maps, one channel), which
    ``contiguous(memory_format=...)`` leaves as they are."""
    _, channels, *spatial = t.shape
    strides, step = [], channels
    for size in reversed(spatial):
        strides.insert(0, step)
        step *= size
    return torch.empty_strided(t.shape, (step, 1, *strides), dtype=t.dtype).copy_(t)


class Fp64(NamedTuple):
    """What :func:`fp64_batch_norm` computed, all float64: the output, the running stats after the
    call (None where none were given) and, given an output gradient, the gradients of the input,
    weight and bias (None where not given)."""

    out: torch.Tensor
    running_mean: Optional[torch.Tensor]
    running_var: Optional[torch.Tensor]
    grad_input: Optional[torch.Tensor] = None
    grad_weight: Optional[torch.Tensor] = None
    grad_bias: Optional[torch.Tensor] = None


def fp64_batch_norm(x: torch.Tensor, running_mean: Optional[torch.Tensor] = None,
                    running_var: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
                    bias: Optional[torch.Tensor] = None, training: bool = True, momentum: float = 0.1,
                    eps: float = 1e-5, grad_out: Optional[torch.Tensor] = None) -> Fp64:
    """``F.batch_norm`` with these arguments computed in float64 on the same values (16-bit ones are
    exact in float64), and its backward for ``grad_out``.

    A training call normalizes with the batch's biased variance and updates copies of the running
    stats with its unbiased one, as torch does; the tensors given are not changed.
    """
    def leaf(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.detach().double().requires_grad_(grad_out is not None)

    # A copy even of float64 stats: the call updates them in place.
    mean, var = (None if s is None else s.detach().to(torch.float64, copy=True) for s in (running_mean, running_var))
    x64, w64, b64 = leaf(x), leaf(weight), leaf(bias)
    out = ORIGINAL(x64, mean, var, w64, b64, training, momentum, eps)
    if grad_out is None:
        return Fp64(out, mean, var)
    leaves = [t for t in (x64, w64, b64) if t is not None]
    grads = iter(torch.autograd.grad(out, leaves, grad_out.double()))
    return Fp64(out.detach(), mean, var, *(None if t is None else next(grads) for t in (x64, w64, b64)))


def fp64_module(bn: nn.Module, x: torch.Tensor, grad_out: Optional[torch.Tensor] = None) -> Fp64:
    """:func:`fp64_batch_norm` of the call ``bn(x)`` makes: its parameters, its stats where it uses
    them, batch statistics in training or without tracked stats, its momentum and eps (the module is
    not changed)."""
    use_batch_stats = bn.training or bn.running_mean is None
    # A training module that tracks no stats updates none (torch passes None for them).
    tracked = not bn.training or bn.track_running_stats
    stats = (bn.running_mean, bn.running_var) if tracked else (None, None)
    return fp64_batch_norm(x, *stats, bn.weight, bn.bias, use_batch_stats, bn.momentum, bn.eps, grad_out)
