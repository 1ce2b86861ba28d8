r"""Helpers for testing code that runs under amp_bn_fix, on a machine without a GPU.

A CUDA call takes another route through the shim than a CPU call: nothing is read from the device
on the host (the guard decides with ops on the device, and its counters stay there until
:func:`amp_bn_fix.report` reads them), and the CPU's own kernels are not used. Under
:func:`device_route`, CPU calls take exactly that route, so a test suite without a GPU runs the
logic a GPU user meets.

Example::

    >>> import torch, amp_bn_fix
    >>> from amp_bn_fix.testing import device_route
    >>> bn = torch.nn.BatchNorm1d(4)
    >>> x = torch.randn(8, 4, dtype=torch.bfloat16)
    >>> x[0, 0] = float("inf")
    >>> with device_route(), torch.autocast("cpu", dtype=torch.bfloat16):
    ...     _ = bn(x)
    >>> bool(torch.isfinite(bn.running_mean).all())   # the guard kept them, deciding "on the device"
    True
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from . import _tuning

_host_route = _tuning.host_route

__all__ = ["device_route"]

_lock = threading.Lock()
_depth = 0


def _no_host(tensor: torch.Tensor) -> bool:
    return False


@contextlib.contextmanager
def device_route() -> Iterator[None]:
    r"""Within the block, every call the shim computes takes the route a CUDA call takes.

    That is: no host reads of tensor values (the guard's decision and its count stay tensors on
    the device), no CPU fast paths (torch's kernels on FP32 copies, as on CUDA). Results stay within
    the bounds every route keeps; speed on CPU is not representative. Process-wide, for every
    thread (like the device a model runs on, it is not a per-thread setting); nestable.

    Example::

        >>> import torch, amp_bn_fix
        >>> from amp_bn_fix.testing import device_route
        >>> with device_route(), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch.nn.BatchNorm2d(3)(torch.randn(2, 3, 4, 4)).dtype
        torch.float32
    """
    global _depth
    with _lock:
        if _depth == 0:
            _tuning.host_route = _no_host
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _tuning.host_route = _host_route
