"""Update the running statistics: the one owner of the guard, the write-back and the guard's counters.

A kernel is handed FP32 working statistics and updates them in place as torch's kernels update
running stats (:func:`updating`); what reaches the caller's tensors, and when, is decided here:

* FP32 stats with the guard off are handed to the kernel as they are: torch's own update.
* With the guard (plain eager mode), a non-finite batch leaves the stats bit for bit. On the host
  route (CPU) the kernel updates the caller's stats and the values read on the host decide
  whether to restore a snapshot (of few channels, kept as Python floats); on the device route
  (CUDA, or CPU told to act like it) nothing is read on the host: the kernel updates a stacked
  FP32 copy, one reduction decides on the device and two selects write it back.
* 16-bit stats with an FP32 master (``keep_fp32="master"``, plain eager mode,
  :func:`updating_master`): the master takes the update, guarded the same way, and is rounded
  into the 16-bit buffers.
* Anywhere else (other 16-bit stats, tracers, ``torch.func`` transforms) FP32 copies are written
  back with ordinary in-place ops, which every tracer records as buffer updates.

The write-back runs even when the kernel raises after updating the working statistics: activation
checkpointing's early stop (non-reentrant) raises out of the recomputed kernel once the tensors it
saves are recovered, and plain torch's update, made inside its kernel, is not lost either.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple, Union

import torch

from . import _master, _record
from ._compat import foreach_copy, to_copy

_F32 = torch.float32
_INF = float("inf")
_vector_norm = torch.linalg.vector_norm
_dot = torch.dot

Kernel = Callable[[Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]


def to_fp32(t: Optional[torch.Tensor], eager: bool = False) -> Optional[torch.Tensor]:
    """``t`` as FP32, differentiably; None and FP32 tensors as they are (see :func:`_compat.to_copy`)."""
    if t is None or t.dtype is _F32:
        return t
    return to_copy(t, _F32, eager)


def updating(
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool,
    guard: bool,
    eager: bool,
    host: bool,
    kernel: Kernel,
) -> torch.Tensor:
    """``kernel(mean, var)`` on FP32 running statistics; in training, their update reaches the caller's.

    ``eager``: the call runs in plain eager mode (writes go through ``.data``, like torch's kernels'
    update: no version-counter bump, so an earlier eval call that saved the stats for its backward
    still works; the guard's decisions are counted). ``host``: values may be read on the host.
    """
    if not training or running_mean is None or running_var is None:
        return kernel(to_fp32(running_mean, eager), to_fp32(running_var, eager))
    if not guard and running_mean.dtype is _F32 and running_var.dtype is _F32:
        return kernel(running_mean, running_var)
    if guard and eager and stackable(running_mean, running_var):
        if host:
            return guarded_on_host(running_mean, running_var, kernel)
        return guarded_on_device(running_mean, running_var, kernel)
    mean, var = _working_copy(running_mean, guard), _working_copy(running_var, guard)
    try:
        return kernel(mean, var)
    finally:
        _write_back((running_mean, running_var), (mean, var), guard, eager)


def updating_master(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    guard: bool,
    host: bool,
    kernel: Kernel,
) -> torch.Tensor:
    """``kernel(mean, var)`` on the FP32 master of 16-bit running stats (plain eager mode, see ``_master``).

    In training the master takes the update (guarded as in :func:`updating`, all on its one
    stacked tensor) and is rounded into the 16-bit buffers.
    """
    master = _master.values(running_mean, running_var)
    mean, var = master.unbind()
    if not training:
        return kernel(mean, var)
    if not guard:
        try:
            return kernel(mean, var)
        finally:
            _master.commit(running_mean, running_var, master)
    if host:
        try:
            return guarded_on_host(mean, var, kernel, running_mean)
        finally:
            # After a skip the master is as it was, and so are the buffers rounded from it.
            _master.commit(running_mean, running_var, master)
    work = master.clone()  # as in guarded_on_device, one select for both stats
    work_mean, work_var = work.unbind()
    try:
        return kernel(work_mean, work_var)
    finally:
        finite = _vector_norm(work, _INF) < _INF
        # .data: an eval call may have saved the master for its backward, as torch's kernels'
        # own update does not count as a change of the stats.
        torch.where(finite, work, master.data, out=master.data)
        _record.checked_on_device(running_mean, finite)
        _master.commit(running_mean, running_var, master)


def stackable(running_mean: torch.Tensor, running_var: torch.Tensor) -> bool:
    """Whether the two stats can share one FP32 working tensor (a mismatch is torch's to report)."""
    return (
        running_mean.dtype is _F32
        and running_var.dtype is _F32
        and running_mean.shape == running_var.shape
        and running_mean.numel() > 0  # no value to decide on for zero channels
        # Both on the CPU is the common case, cheaper to test than comparing device objects.
        and ((running_mean.is_cpu and running_var.is_cpu) or running_mean.device == running_var.device)
    )


# The guarded routes, each in two halves around the kernel (public for ``_compute.common``, which
# calls its kernel between them). They need no ``torch.no_grad()`` (a microsecond a call): nothing
# they touch requires grad (``_decide`` leaves stats that do to torch).
def guarded_on_host(mean: torch.Tensor, var: torch.Tensor, kernel: Kernel,
                    counted_for: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel updates ``mean`` and ``var`` itself, as torch's do; a non-finite update is undone.

    A skip is counted for ``counted_for`` (the module's running mean when these are its master's).
    """
    before = snapshot_on_host(mean, var)
    try:
        return kernel(mean, var)
    finally:
        settle_on_host(mean, var, before, counted_for)


# Up to this many channels the host guard keeps and judges the stats as Python floats, with no
# tensor op: reading 2 x 32 values costs less than an op's dispatch, and in a training loop far
# less (each op's code and memory come back cold). Beyond, the reads grow with the channels and
# three ops are cheaper: a joined copy, a dot product of the two stats and its read.
LISTED_CHANNELS = 32

Snapshot = Union[Tuple[List[float], List[float]], torch.Tensor]


def snapshot_on_host(mean: torch.Tensor, var: torch.Tensor) -> Snapshot:
    """What :func:`settle_on_host` restores ``mean`` and ``var`` from.

    A finite float32 value round-trips exactly through a Python float; a NaN may not (a signalling
    one comes back quiet), so stats that are not finite already are copied as a tensor.
    """
    if mean.dim() == 1 and var.dim() == 1 and mean.numel() <= LISTED_CHANNELS and var.numel() <= LISTED_CHANNELS:
        before = mean.tolist(), var.tolist()
        if _listed_finite(*before):
            return before
    return _snapshot(mean, var)


def _listed_finite(mean: List[float], var: List[float]) -> bool:
    """Whether every value is finite: the sum of float32 values in double overflows for no count
    that fits in memory, so it is finite exactly when each value is."""
    return math.isfinite(sum(mean) + sum(var))


def settle_on_host(mean: torch.Tensor, var: torch.Tensor, before: Snapshot,
                   counted_for: Optional[torch.Tensor] = None) -> None:
    """Undo the update of ``mean`` and ``var`` since ``before`` if it left a value that is not finite."""
    if type(before) is tuple:
        if _listed_finite(mean.tolist(), var.tolist()):
            return
        old = torch.tensor(before[0], dtype=mean.dtype), torch.tensor(before[1], dtype=var.dtype)
    else:
        if _finite_on_host(mean, var):
            return
        old = tuple(before.view(2, *mean.shape).unbind())
    # .data: an eval call may have saved the stats for its backward.
    foreach_copy((mean.data, var.data), old)
    _record.skipped(mean if counted_for is None else counted_for)


def _finite_on_host(mean: torch.Tensor, var: torch.Tensor) -> bool:
    """Whether every value of both stats is finite: their dot product (finite only if every value
    is; it can also overflow where none is), else (it overflowed, or the stats are not 1-D, which
    torch rejects in its own words) the values themselves."""
    if mean.dim() == 1 and var.dim() == 1 and math.isfinite(_dot(mean, var).item()):
        return True
    return bool(torch.isfinite(mean).all()) and bool(torch.isfinite(var).all())


def _snapshot(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """A copy of both stats in one tensor, ``(2, *shape)`` or, for 1-D stats, flat.

    1-D stats (BatchNorm's) are joined by ``cat``: ``stack`` makes a view of each first, and in a
    training loop that costs a microsecond or two per call.
    """
    return torch.cat((mean, var)) if mean.dim() == 1 else torch.stack((mean, var))


def guarded_on_device(running_mean: torch.Tensor, running_var: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """The kernel updates one stacked FP32 copy; two selects on the device write it back if finite."""
    work = working_on_device(running_mean, running_var)
    mean, var = work.unbind()
    try:
        return kernel(mean, var)
    finally:
        settle_on_device(running_mean, running_var, work)


def working_on_device(running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
    """The ``(2, *shape)`` FP32 copy of both stats that the kernel updates (its rows) on the device route."""
    return _snapshot(running_mean, running_var).view(2, *running_mean.shape)


def settle_on_device(running_mean: torch.Tensor, running_var: torch.Tensor, work: torch.Tensor) -> None:
    """Write the updated ``work`` into the stats if every value is finite, deciding on the device.

    Nothing is read on the host: the decision is a 0-dim device tensor (the largest magnitude is
    finite only if every value is; the reduction propagates NaN), and so is the record's count.
    """
    mean, var = work.unbind()
    finite = _vector_norm(work, _INF) < _INF
    torch.where(finite, mean, running_mean.data, out=running_mean.data)
    torch.where(finite, var, running_var.data, out=running_var.data)
    _record.checked_on_device(running_mean, finite)


def _working_copy(stat: torch.Tensor, guard: bool) -> torch.Tensor:
    """The FP32 tensor a kernel updates in place: ``stat`` itself when it needs no protection."""
    if stat.dtype is _F32 and not guard:
        return stat
    return stat.detach().to(_F32, copy=True)


@torch.no_grad()
def _write_back(stats: Tuple[torch.Tensor, torch.Tensor], new: Tuple[torch.Tensor, torch.Tensor],
                guard: bool, eager: bool) -> None:
    """Copy the updated working stats into the caller's tensors (only if finite, with ``guard``).

    Outside plain eager mode (tracers, ``torch.func`` transforms, where ``.data`` is invisible or
    forbidden) an ordinary in-place copy, which every tracer records as a buffer update.
    """
    if guard:
        # Device-side select, no host sync: a non-finite batch leaves the stats as they were.
        finite = torch.isfinite(torch.cat(new)).all()
        new = tuple(torch.where(finite, n, s.to(_F32)) for s, n in zip(stats, new))  # type: ignore[assignment]
        if eager:
            _record.checked_on_device(stats[0], finite)
    for stat, value in zip(stats, new):
        if value is not stat:
            (stat.data if eager else stat).copy_(value)
