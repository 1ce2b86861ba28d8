"""The running-stat update's guard: a non-finite batch leaves the stats bit for bit.

Two halves around whatever updates the stats (a batch-norm kernel, InstanceNorm's average):
:func:`begin` hands out the FP32 tensors to update, :func:`finish` decides whether the update stands
and brings it to the caller's stats. One form per place the decision can be made:

* host (CPU): the stats are updated in place; a snapshot (few channels: Python floats) restores
  them when the values read on the host are not finite.
* device (CUDA, or CPU under ``amp_bn_fix.testing.device_route()``): nothing is read on the host.
  A stacked FP32 copy is updated; one reduction decides on the device and two selects write it back.
* copies (16-bit stats without a master, tracers, ``torch.func`` transforms): FP32 copies, written
  back with ordinary in-place ops that every tracer records as buffer updates, behind a select
  (in plain eager mode on the host route, behind a decision read there, as the host form's).

FP32 stats with the guard off are updated as they are: torch's own update. The guard needs no
``torch.no_grad()`` (a microsecond a call): the plan leaves stats that require grad to torch.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, Union

import torch

from . import _record
from ._compat import foreach_copy

_F32 = torch.float32
_INF = float("inf")
_isfinite = math.isfinite
_vector_norm = torch.linalg.vector_norm
_dot = torch.dot
_copy = torch.ops.aten.copy.out

# Up to this many channels the host guard keeps and judges the stats as Python floats, with no
# tensor op: reading 2 x 32 values costs less than an op's dispatch, and in a training loop far
# less (each op's code and memory come back cold). Beyond, the reads grow with the channels and
# three ops are cheaper: a joined copy, a dot product of the two stats and its read.
LISTED_CHANNELS = 32

Snapshot = Union[Tuple[List[float], List[float]], torch.Tensor]
# What :func:`finish` needs: how the stats were handed out, and the snapshot or the working copy.
_HOST, _DEVICE, _COPIES = 1, 2, 3
Token = Optional[Tuple[int, Any]]


def begin(mean: torch.Tensor, var: torch.Tensor, *, guard: bool, eager: bool, host: bool, plain: bool = False,
          rows_of: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Token]:
    """The FP32 tensors an update of ``mean`` and ``var`` writes into, and the token :func:`finish` takes.

    ``eager``: plain eager mode (the write-back goes through ``.data``, like torch's kernels'
    update: no version-counter bump, so an earlier eval call that saved the stats for its backward
    still works; decisions are counted). ``host``: values may be read on the host. ``plain``: the
    stats are known to be FP32, 1-D, of one shape with values and on one device, in plain eager
    mode (a ``plain`` plan's), so none of that is asked again. ``rows_of``: the ``(2, *shape)``
    tensor whose rows ``mean`` and ``var`` are (a master's values), which one select writes.
    """
    fp32 = plain or (mean.dtype is _F32 and var.dtype is _F32)
    if not guard and fp32:
        return mean, var, None
    # Both stats in one working tensor, FP32.
    if plain or (guard and eager and fp32 and joinable(mean, var)):
        if host:
            # A finite float32 value round-trips exactly through a Python float; a NaN may not (a
            # signalling one comes back quiet), so stats that are not finite already are copied.
            if (plain or mean.dim() == 1) and mean.numel() <= LISTED_CHANNELS:
                before = mean.tolist(), var.tolist()
                if _finite_floats(before):
                    return mean, var, (_HOST, before)
            return mean, var, (_HOST, _joined(mean, var))
        work = _joined(mean, var).view(2, *mean.shape)
        work_mean, work_var = work.unbind()
        return work_mean, work_var, (_DEVICE, (work, rows_of))
    return _working_copy(mean), _working_copy(var), (_COPIES, (guard, host and eager))


def joinable(mean: torch.Tensor, var: torch.Tensor) -> bool:
    """Whether both stats go into one working tensor: of one shape (a mismatch is torch's to
    report), with values to decide on, on one device (both on the CPU: cheaper to test than device
    objects)."""
    return mean.shape == var.shape and mean.numel() > 0 and ((mean.is_cpu and var.is_cpu) or mean.device == var.device)


def finish(mean: torch.Tensor, var: torch.Tensor, updated_mean: torch.Tensor, updated_var: torch.Tensor,
          token: Token, eager: bool, counted_for: torch.Tensor) -> None:
    """Bring the update into ``mean`` and ``var`` if it is finite (always, when not guarded).

    ``counted_for``: the tensor the decision is recorded for, the module's running mean (``mean``
    itself, or the stats these are its FP32 master's rows of).
    """
    if token is None:
        return
    kind, data = token
    if kind == _HOST:
        # A snapshot of Python floats says the stats are few and 1-D (:func:`begin`): read them so again.
        if _finite_floats((mean.tolist(), var.tolist())) if type(data) is tuple else host_finite(mean, var):
            return
        _restore(mean, var, data)
        _record.skipped(counted_for)
    elif kind == _DEVICE:
        work, rows_of = data
        finite = _all_finite(work)
        if rows_of is not None:
            torch.where(finite, work, rows_of.data, out=rows_of.data)
        else:
            torch.where(finite, updated_mean, mean.data, out=mean.data)
            torch.where(finite, updated_var, var.data, out=var.data)
        _record.checked_on_device(counted_for, finite)
    else:
        _write_back(mean, var, updated_mean, updated_var, data, eager, counted_for)


def host_finite(mean: torch.Tensor, var: torch.Tensor) -> bool:
    """Whether every value of ``mean`` and ``var`` is finite, read on the host."""
    if mean.dim() == 1 and var.dim() == 1 and mean.numel() <= LISTED_CHANNELS:
        return _finite_floats((mean.tolist(), var.tolist()))
    # Their dot product is finite only if every value is (it can also overflow where none is);
    # when it is not, or the stats are not 1-D (torch's error to report), the values themselves.
    return (mean.dim() == 1 and var.dim() == 1 and math.isfinite(_dot(mean, var).item())
            or bool(torch.isfinite(mean).all()) and bool(torch.isfinite(var).all()))


def _all_finite(joined: torch.Tensor) -> torch.Tensor:
    """Whether every value of ``joined`` is finite (true when it has none), as a tensor on its
    device: no host read. Two kernels: its largest magnitude, in which a NaN propagates, below
    infinity (``isfinite`` is four)."""
    if not joined.numel():  # the inf-norm of nothing has no identity
        return torch.ones((), dtype=torch.bool, device=joined.device)
    return _vector_norm(joined, _INF) < _INF


def _finite_floats(stats: Tuple[List[float], List[float]]) -> bool:
    # The sum of float32 values in double overflows for no count that fits in memory, so it is
    # finite exactly when each value is.
    return _isfinite(sum(stats[0]) + sum(stats[1]))


def _restore(mean: torch.Tensor, var: torch.Tensor, before: Snapshot) -> None:
    if type(before) is tuple:
        # On the stats' device: not the default device a ``torch.set_default_device`` names.
        old = (torch.tensor(before[0], dtype=mean.dtype, device=mean.device),
               torch.tensor(before[1], dtype=var.dtype, device=var.device))
    else:
        old = tuple(before.view(2, *mean.shape).unbind())
    # .data: an eval call may have saved the stats for its backward.
    foreach_copy((mean.data, var.data), old)


def _joined(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """A copy of both stats in one tensor, ``(2, *shape)`` or, for 1-D stats, flat.

    1-D stats (BatchNorm's) are joined by ``cat``: ``stack`` makes a view of each first, and in a
    training loop that costs a microsecond or two per call.
    """
    return torch.cat((mean, var)) if mean.dim() == 1 else torch.stack((mean, var))


def _working_copy(stat: torch.Tensor) -> torch.Tensor:
    return stat.detach().to(_F32, copy=True)


def _write_back(mean: torch.Tensor, var: torch.Tensor, new_mean: torch.Tensor, new_var: torch.Tensor,
                how: Tuple[bool, bool], eager: bool, counted_for: torch.Tensor) -> None:
    """Copy the updated working copies into the stats (only if finite, with ``how``'s guard).

    ``how``: whether to guard, and whether the decision is read on the host (plain eager mode on
    the host route: counted, and the first skip warned, as the host form's); else a select on the
    device. Outside plain eager mode (tracers, ``torch.func`` transforms, where ``.data`` is
    invisible or forbidden) an ordinary in-place copy, which every tracer records as a buffer update.
    """
    guard, host = how
    if guard and host:
        if not host_finite(new_mean, new_var):
            _record.skipped(counted_for)
            return
    elif guard:
        # A select on the device, no host sync: a non-finite batch leaves the stats as they were.
        finite = _all_finite(torch.cat((new_mean, new_var)))
        new_mean = torch.where(finite, new_mean, mean.to(_F32))
        new_var = torch.where(finite, new_var, var.to(_F32))
        if eager:
            _record.checked_on_device(counted_for, finite)
    for stat, value in ((mean, new_mean), (var, new_var)):
        if eager:
            stat.data.copy_(value)
            continue
        try:
            stat.copy_(value)
        except RuntimeError as refused:
            # A torch.func grad or jvp transform refuses in-place ops on stats the function captured
            # from outside (and on their views), before they run, not an op's ``out=`` argument
            # (which carries no forward-mode tangent: the stats it is given take the in-place copy).
            if "captured" not in str(refused):
                raise
            _copy(stat, value, out=stat)
