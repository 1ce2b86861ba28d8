"""Run a plan: a handled call's FP32 arithmetic, on the cheapest kernel its device and mode allow.

One function, :func:`run`. The door passes in what computes torch's batch norm for it (``F.batch_norm``,
the op below the dispatcher's autocast key, SyncBatchNorm's syncing function) and the
:class:`~._plan.Plan`. The kernel runs inside one statistics session: autocast excluded, the running
stats handed to it (the caller's, a guarded working copy, or the rows of their FP32 master from
``_master``), and afterwards the guard's decision and the master's commit. No object is made for
it: on the common call every step's Python shows.

The kernel is the first row of :data:`KERNELS` that takes the call, for a float16/bfloat16 input:

* A half model's training call outside autocast, in plain eager mode: its output is torch's own,
  and only the batch's FP32 statistics are brought to the running stats.
* Output in the input's dtype (``input``, or a half model outside autocast) in plain eager mode on
  a device whose kernel computes a 16-bit input with FP32 parameters and statistics in FP32 (CPU
  for contiguous and channels_last inputs, CUDA's native and cuDNN kernels): the input goes
  straight to torch's kernel, with no copy.
* FP32 output in plain eager mode (:mod:`._kernels`): statistics reduced from the 16-bit input and
  the output written from it, no FP32 copy of it made or kept. On the route a CUDA call takes for
  large calls, training and eval; on the host route (CPU) for large training calls.
* Otherwise the reference: ``original(input.float(), ...)`` with FP32 parameters and statistics.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

import torch

from . import _guard, _kernels, _master, _tuning
from ._compat import (RECOMPUTE_STOPPED, cudnn_enabled, device_type, exclude_autocast, function_mode_enabled,
                      plain_eager, restore_autocast, to_copy)
from ._plan import Plan

_F32 = torch.float32

# Device types whose batch-norm kernels accept a 16-bit input with FP32 parameters and running
# stats and compute in FP32 (CPU: ``batch_norm_cpu`` mixed type; CUDA: native and cuDNN kernels).
_MIXED_KERNEL_DEVICES = frozenset({"cpu", "cuda"})

Original = Callable[..., torch.Tensor]


def _torch_own_f_batch_norm() -> Optional[Original]:
    """torch's own ``F.batch_norm`` function, found through any wrappers in place that say what they
    wrap (``__wrapped__``: wrapt's, ``functools.wraps``); None when something else replaced it."""
    found = inspect.unwrap(torch.nn.functional.batch_norm)
    if (inspect.isfunction(found) and found.__module__ == "torch.nn.functional"
            and found.__qualname__ == "batch_norm"):
        return found
    return None


_F_BATCH_NORM = _torch_own_f_batch_norm()


# ---- The kernels, in order: each first says whether it takes the call (else NOT_THIS), then runs it ----
#
# A kernel gets what :func:`run` knows, by position: ``original``, the call in ``F.batch_norm``'s order
# with the running stats to update in place of the caller's, the plan, and whether the call is in
# plain eager mode (``eager``: only then may a kernel use what tracers would not record faithfully,
# a ``.data`` write, a Python autograd.Function, a backward hook, scratch tensors), on the host
# route (``host``), and computed by torch's own batch norm (``native``).

# A kernel's answer for a call it does not take.
NOT_THIS: Any = object()

Kernel = Callable[[Original, Tuple[Any, ...], Plan, bool, bool, bool], Any]


def _statistics_only(original: Original, call: Tuple[Any, ...], plan: Plan, eager: bool, host: bool,
                     native: bool) -> Any:
    """torch's own output is made: in eager mode only the batch's statistics remain. torch's op for
    them updates FP32 stats as its kernels do (no output, about half a batch norm on CPU). It
    mutates stats its schema does not mark as written, which tracers would miss, and has no meta kernel."""
    input = call[0]
    if not (plan.torch_output and eager) or input.is_meta:
        return NOT_THIS
    if input.numel():  # an empty batch leaves the stats, as torch's kernels do
        torch.batch_norm_update_stats(input, call[1], call[2], call[6])
    return None


def _mixed(original: Original, call: Tuple[Any, ...], plan: Plan, eager: bool, host: bool, native: bool) -> Any:
    """The input's dtype out where torch's kernel for its device computes it exactly in FP32 (a layout
    the kernel takes): the input as it is, FP32 weight and bias."""
    input = call[0]
    if not (native and eager and plan.out_dtype is input.dtype):
        return NOT_THIS
    cpu = input.is_cpu
    if not (_kernels.mixed_kernel_takes(input) if cpu else device_type(input) in _MIXED_KERNEL_DEVICES):
        return NOT_THIS
    if not plan.plain:  # a plain plan's are FP32 already
        call = (*call[:3], to_fp32(call[3], True), to_fp32(call[4], True), *call[5:])
    return _kernels.mixed_batch_norm(original, call) if cpu else original(*call)


def _fp32_route(original: Original, call: Tuple[Any, ...], plan: Plan, eager: bool, host: bool,
                native: bool) -> Any:
    """An FP32 output from the 16-bit input (``_kernels``) where it pays: on the host route large
    training calls, on the device route large calls (``_tuning``). A half model's 16-bit weight and
    bias are read as they are."""
    if not (native and eager and plan.out_dtype is _F32) or (host and call[5] is not True):
        return NOT_THIS
    values = call[0].numel()
    if host:
        # MIN_VALUES is min_values() at one thread: no call below it asks for the thread count.
        if values < _tuning.MIN_VALUES or values < _tuning.min_values():
            return NOT_THIS
    elif values < _tuning.DEVICE_MIN_VALUES:
        return NOT_THIS
    chunked = _kernels.fp32_route(host, call)
    return NOT_THIS if chunked is None else _kernels.fp32_batch_norm(call, chunked)


def _reference(original: Original, call: Tuple[Any, ...], plan: Plan, eager: bool, host: bool,
               native: bool) -> Any:
    """Every call: the input cast to FP32 once, torch's FP32 kernel. A region strict export records
    takes the input as it comes under the ``input`` policy (no output dtype): torch's mixed-dtype
    kernels compute it in FP32 there."""
    input, mean, var, weight, bias, training, momentum, eps = call
    x = input if plan.out_dtype is None else to_copy(input, _F32, eager)
    if not plan.plain:  # a plain plan's are FP32 already
        weight, bias = to_fp32(weight, eager), to_fp32(bias, eager)
    return original(x, mean, var, weight, bias, training, momentum, eps)


KERNELS: Tuple[Kernel, ...] = (_statistics_only, _mixed, _fp32_route, _reference)


def run(original: Original, call: Tuple[Any, ...], plan: Plan, *, native: bool = True) -> torch.Tensor:
    """Compute ``call`` (``F.batch_norm``'s eight arguments) with FP32 statistics, normalization and
    running-stat update, as ``plan`` says; the result is ``plan.out_dtype``.

    ``original`` has ``F.batch_norm``'s signature and is called with FP32 statistics; ``native``:
    it computes torch's own batch norm, so an equivalent kernel may stand in for it (False for
    SyncBatchNorm's syncing function, which must see every call). With ``plan.guard``, a training
    step whose statistics are not finite leaves the running stats untouched (the output still
    carries the inf/NaN, so GradScaler sees it).

    The kernel runs inside one statistics session: autocast excluded (nothing inside is recast
    half-way, and the dispatcher door at autocast's key is not re-entered), the master's values
    taken where the plan has one, and the running stats to update handed out (``_guard.begin``).
    After it, also when it raises after updating them (activation checkpointing's early stop raises
    out of the recomputed kernel, and torch's own update is kept then too), autocast is restored,
    the guard decides (``_guard.finish``) and the master is rounded into the 16-bit buffers.
    """
    shown = stopped = None
    if plan.torch_output:
        # torch's own output (its kernel on the call as given, bit for bit); the kernel then has
        # nothing to differentiate and only brings the batch's FP32 statistics to the running stats.
        input, mean, var, weight, bias, training, momentum, eps = call
        try:
            shown = original(input, None, None, weight, bias, training, momentum, eps)
        except RECOMPUTE_STOPPED as stop:
            # Stopped at the tensors that call saves, where torch's kernel has updated the stats:
            # the update below stands too, and then the recompute stops.
            stopped = stop
        call = (input.detach(), mean, var, None, None, training, momentum, eps)
    input, running_mean, running_var, weight, bias, training, _, _ = call
    plain = plan.plain
    eager = plain or plain_eager(input, running_mean, running_var, weight, bias)
    if plain and not function_mode_enabled():  # exact types, and no mode: no override sees the call
        original = past_checks(original, call)
    host = eager and _tuning.host_route(input)
    update = bool(training) and running_mean is not None and running_var is not None
    held = token = None
    excluded = exclude_autocast(device_type(input), eager=eager)
    try:
        if not (plan.master and eager):
            mean, var = running_mean, running_var
        elif update:  # the master takes the update, and is rounded into the buffers at the end
            held = _master.for_update(running_mean, running_var, host)
            mean, var = held.rows
        else:
            mean, var = _master.for_reading(running_mean, running_var, host)
        given = mean, var
        if update:
            mean, var, token = _guard.begin(mean, var, guard=plan.guard, eager=eager, host=host, plain=plain,
                                            rows_of=None if held is None else held.values)
        elif not plain:  # a plain plan's stats are FP32 already
            mean, var = to_fp32(mean, eager), to_fp32(var, eager)
    except BaseException:
        restore_autocast(excluded)
        raise
    try:
        call = (input, mean, var, *call[3:])
        for kernel in KERNELS:
            out = kernel(original, call, plan, eager, host, native)
            if out is not NOT_THIS:
                break
    finally:
        # Autocast first: the guard's and the master's ops are FP32 and recast nothing, and under
        # torch.export a block of its own that only writes the stats back (no outputs) makes a
        # program that torch.export.load refuses.
        restore_autocast(excluded)
        if update:
            _guard.finish(given[0], given[1], mean, var, token, eager, running_mean)
            if held is not None:
                _master.commit(running_mean, running_var, held)
    if stopped is not None:
        raise stopped
    if shown is not None:
        return shown
    out_dtype = plan.out_dtype
    return out if out_dtype is None or out.dtype is out_dtype else to_copy(out, out_dtype, eager)


def past_checks(original: Original, call: Tuple[Any, ...]) -> Original:
    """What ``original`` runs for ``call``, a call no torch function override sees (the caller
    knows: exact types, and no mode; a default-device mode would see it again).

    torch's own ``F.batch_norm`` (not another library's wrapper of it) runs ``torch.batch_norm``
    once its Python checks pass: a boolean ``training``, in training more than one value per
    channel, and a positive eps (else its errors, from it). ``torch.batch_norm`` is looked up
    at each call, as there.
    """
    training, eps = call[5], call[7]
    if original is not _F_BATCH_NORM or type(eps) is not float or not eps > 0.0:
        return original
    if training is False:
        return _torch_f_batch_norm
    if training is not True:
        return original
    shape = call[0].shape  # read once: a C read each of dim(), numel() and size(1) costs more
    return _torch_f_batch_norm if len(shape) >= 2 and shape.numel() != shape[1] else original


def _torch_f_batch_norm(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                        weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], training: bool, momentum: float,
                        eps: float) -> torch.Tensor:
    """``F.batch_norm`` for a call its Python checks pass: its last line."""
    return torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled())


def to_fp32(t: Optional[torch.Tensor], eager: bool = False) -> Optional[torch.Tensor]:
    """``t`` as FP32, differentiably; None and FP32 tensors as they are (see :func:`_compat.to_copy`)."""
    if t is None or t.dtype is _F32:
        return t
    return to_copy(t, _F32, eager)
