"""Run a plan: a handled call's FP32 arithmetic, on the cheapest route its device and mode allow.

One function, :func:`run`. The door passes in what computes torch's batch norm for it (``F.batch_norm``,
the op below the dispatcher's autocast key, SyncBatchNorm's syncing function) and the
:class:`~._plan.Plan`. The running stats it hands the kernel come from ``_guard`` (the caller's,
a guarded working copy, or the rows of their FP32 master from ``_master``).

Kernels, for a float16/bfloat16 input:

* Output in the input's dtype (``input``, or a half model outside autocast) in plain eager mode on
  a device whose kernel computes a 16-bit input with FP32 parameters and statistics in FP32 (CPU
  for contiguous and channels_last inputs, CUDA's native and cuDNN kernels): the input goes
  straight to torch's kernel, with no copy.
* FP32 output in plain eager mode (:mod:`._kernels`): statistics reduced from the 16-bit input and
  the output written from it, no FP32 copy of it made or kept. On the route a CUDA call takes for
  every valid call, training and eval; on the host route (CPU) for large training calls.
* Otherwise the reference: ``original(input.float(), ...)`` with FP32 parameters and statistics.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple

import torch

from . import _guard, _kernels, _master, _tuning
from ._compat import cudnn_enabled, exclude_autocast, function_mode_enabled, plain_eager, restore_autocast, to_copy
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


def run(original: Original, call: Tuple, plan: Plan, native: bool = True) -> torch.Tensor:
    """Compute ``call`` (``F.batch_norm``'s eight arguments) with FP32 statistics, normalization and
    running-stat update, as ``plan`` says; the result is ``plan.out_dtype``.

    ``original`` has ``F.batch_norm``'s signature and is called with FP32 statistics; ``native``:
    it computes torch's own batch norm, so an equivalent kernel may stand in for it (False for
    SyncBatchNorm's syncing function, which must see every call). With ``plan.guard``, a training
    step whose statistics are not finite leaves the running stats untouched (the output still
    carries the inf/NaN, so GradScaler sees it).
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    plain = plan.plain
    # Only in plain eager mode may a route use what tracers would not record faithfully (a
    # ``.data`` write, a Python autograd.Function, a backward hook, scratch tensors).
    eager = plain or plain_eager(input, running_mean, running_var, weight, bias)
    host = eager and _tuning.host_route(input)
    shown = None
    if plan.torch_output:
        # torch's own output (its kernel on the call as given, bit for bit); below, with nothing to
        # differentiate, only the batch's FP32 statistics are brought to the running stats.
        shown = original(input, None, None, weight, bias, training, momentum, eps)
        input, weight, bias = input.detach(), None, None
    out_dtype = plan.out_dtype
    # A 16-bit input's FP32 output in eager mode may take the FP32 route, which reads 16-bit weight
    # and bias as they are; every other kernel takes them FP32.
    if not plain and not (eager and out_dtype is _F32 and input.dtype is not _F32):
        weight, bias = to_fp32(weight, eager), to_fp32(bias, eager)
    master = plan.master and eager
    # Nothing inside is recast half-way, and the dispatcher door at autocast's key is not re-entered.
    autocast = exclude_autocast("cpu" if input.is_cpu else input.device.type, eager)
    try:
        if master:
            # The master takes the update (and is read in eval); it is rounded into the 16-bit buffers.
            master_values = _master.values(running_mean, running_var, host)
            mean, var = master_values.unbind()
        else:
            mean, var = running_mean, running_var
        update = bool(training) and mean is not None and var is not None
        if update:
            work_mean, work_var, token = _guard.begin(mean, var, plan.guard, eager, host, plain)
        elif plain:  # FP32 stats already
            work_mean, work_var = mean, var
        else:
            work_mean, work_var = to_fp32(mean, eager), to_fp32(var, eager)
        try:
            # torch's own F.batch_norm (not another library's wrapper of it) is torch.batch_norm once
            # its checks pass: no torch function override (exact types, and no mode: a default-device
            # mode would see the call again), more than one value per channel and a positive eps
            # (else its errors, from it). torch.batch_norm is looked up at each call, as there.
            if (plain and original is _F_BATCH_NORM and type(eps) is float and eps > 0.0
                    and not function_mode_enabled() and not (training and input.numel() == input.size(1))):
                original = _torch_f_batch_norm
            # With torch's own output, in eager mode only the batch's statistics remain: torch's op
            # for them updates FP32 stats as its kernels do (no output, about half a batch norm on
            # CPU). It mutates stats its schema does not mark as written, which tracers would miss,
            # and has no meta kernel.
            stats_only = shown is not None and eager and not input.is_meta
            layout = (_mixed_kernel_layout(input) if native and eager and out_dtype is input.dtype and not stats_only
                      else None)
            if stats_only:
                if input.numel():  # an empty batch leaves the stats, as torch's kernels do
                    torch.batch_norm_update_stats(input, work_mean, work_var, momentum)
            elif layout is not None:
                if input.is_cpu:
                    out = _kernels.mixed_batch_norm(original, layout, input, work_mean, work_var, weight, bias,
                                                    training, momentum, eps)
                else:
                    out = original(input, work_mean, work_var, weight, bias, training, momentum, eps)
            elif (native and eager and out_dtype is _F32
                  # The sizes below which no route takes a call, read before a call to ask the route.
                  and input.numel() >= (_tuning.MIN_VALUES if host else _tuning.DEVICE_MIN_VALUES)
                  and (chunked := _kernels.fp32_route(host, input, work_mean, work_var, weight, bias, training,
                                                      momentum, eps)) is not None):
                out = _kernels.fp32_batch_norm(input, work_mean, work_var, weight, bias, training, momentum, eps,
                                               chunked)
            else:
                # A region strict export records takes the input as it comes under the ``input``
                # policy (no output dtype): torch's mixed-dtype kernels compute it in FP32 there.
                x = input if out_dtype is None else to_copy(input, _F32, eager)
                if not plain:  # a 16-bit input's FP32 output kept 16-bit weight and bias for the route
                    weight, bias = to_fp32(weight, eager), to_fp32(bias, eager)
                out = original(x, work_mean, work_var, weight, bias, training, momentum, eps)
        finally:
            # Also when the kernel raises after updating the stats: activation checkpointing's
            # early stop raises out of the recomputed kernel, and torch's own update is kept then too.
            if update:
                _guard.finish(mean, var, work_mean, work_var, token, eager, running_mean)
            if master and update:
                _master.commit(running_mean, running_var, master_values)
    finally:
        restore_autocast(autocast)
    if shown is not None:
        return shown
    return out if out_dtype is None or out.dtype is out_dtype else to_copy(out, out_dtype, eager)


def _torch_f_batch_norm(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                        weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], training: bool, momentum: float,
                        eps: float) -> torch.Tensor:
    """``F.batch_norm`` for a call its Python checks pass: its last line."""
    return torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled())


def _mixed_kernel_layout(input: torch.Tensor) -> Optional[torch.memory_format]:
    """The layout in which torch's kernel for ``input``'s device computes it exactly in FP32, if any."""
    if input.is_cpu:
        return _kernels.mixed_kernel_layout(input)
    return torch.preserve_format if input.device.type in _MIXED_KERNEL_DEVICES else None


def to_fp32(t: Optional[torch.Tensor], eager: bool = False) -> Optional[torch.Tensor]:
    """``t`` as FP32, differentiably; None and FP32 tensors as they are (see :func:`_compat.to_copy`)."""
    if t is None or t.dtype is _F32:
        return t
    return to_copy(t, _F32, eager)
