"""Compute: a handled call's FP32 arithmetic, on the cheapest route its device and mode allow.

Device-agnostic and stateless: the runtime (``_patch``) passes in the original
``torch.nn.functional.batch_norm`` and the :class:`~._decide.Plan`; the running statistics'
update belongs to :mod:`._stats`.

Routes, for a float16/bfloat16 input:

* Output in the input's dtype (``input``, or a half model outside autocast) in plain eager mode on
  a device whose kernel computes a 16-bit input with FP32 parameters and statistics in FP32 (CPU
  for contiguous and channels_last inputs, CUDA's native and cuDNN kernels): the input goes
  straight to torch's kernel, with no copy.
* FP32 output in training on CPU, large inputs (:mod:`._kernels`): statistics reduced from the
  16-bit input, no FP32 copy of it kept.
* Otherwise the reference: ``original(input.float(), ...)`` with FP32 parameters and statistics.
"""

from __future__ import annotations

import inspect
from math import isfinite
from typing import Callable, Optional

import torch

from . import _kernels, _stats, _tuning
from ._compat import (LANE_AUTOCAST_KEYS, autocast_disabled, autocast_excluded, cudnn_enabled, function_mode_enabled,
                      key_excluded, plain_eager, set_key_excluded, to_copy)
from ._decide import BatchNormCall, Plan
from ._stats import to_fp32

# Device types whose batch-norm kernels accept a 16-bit input with FP32 parameters and running
# stats and compute in FP32 (CPU: ``batch_norm_cpu`` mixed type; CUDA: native and cuDNN kernels).
_MIXED_KERNEL_DEVICES = frozenset({"cpu", "cuda"})

Original = Callable[..., torch.Tensor]

def _torch_own_f_batch_norm() -> Optional[Callable[..., torch.Tensor]]:
    """torch's own ``F.batch_norm`` function, found through any wrappers in place that say what they
    wrap (``__wrapped__``: wrapt's, ``functools.wraps``); None when something else replaced it."""
    found = inspect.unwrap(torch.nn.functional.batch_norm)
    if (inspect.isfunction(found) and found.__module__ == "torch.nn.functional"
            and found.__qualname__ == "batch_norm"):
        return found
    return None


_F_BATCH_NORM = _torch_own_f_batch_norm()


def batch_norm(original: Original, call: BatchNormCall, plan: Plan) -> torch.Tensor:
    """Compute ``call`` with FP32 statistics, normalization and running-stat update, as ``plan`` says.

    The result is ``plan.out_dtype``. With ``plan.guard``, a training step whose statistics are not
    finite leaves the running stats untouched (the output still carries the inf/NaN, so GradScaler
    sees it).
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    # Only in plain eager mode may a route use what tracers would not record faithfully (a
    # ``.data`` write, a Python autograd.Function, a backward hook, scratch tensors).
    eager = plain_eager(input, running_mean, running_var, weight, bias)
    host = eager and _tuning.host_route(input)
    weight, bias = to_fp32(weight, eager), to_fp32(bias, eager)
    out_dtype = plan.out_dtype
    layout = _mixed_kernel_layout(input) if eager and out_dtype is input.dtype else None

    def kernel(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
        if layout is not None:
            if input.is_cpu:
                return _kernels.mixed_batch_norm(original, layout, input, mean, var, weight, bias, training, momentum, eps)
            return original(input, mean, var, weight, bias, training, momentum, eps)
        if host and _tuning.fast_paths and _kernels.fp32_train_eligible(input, mean, var, weight, bias, training, momentum, eps):
            return _kernels.fp32_train_batch_norm(input, mean, var, weight, bias, momentum, eps)
        return original(to_copy(input, torch.float32, eager), mean, var, weight, bias, training, momentum, eps)

    # Nothing inside is recast half-way (and a kernel registered at autocast's key is not re-entered).
    device_type = input.device.type
    with autocast_excluded(device_type) if eager else autocast_disabled(device_type):
        if plan.master and eager:
            out = _stats.updating_master(running_mean, running_var, bool(training), plan.guard, host, kernel)
        else:
            out = _stats.updating(running_mean, running_var, bool(training), plan.guard, eager, host, kernel)
    return out if out.dtype is out_dtype else out.to(out_dtype)


def common(original: Original, args: tuple, plan: Plan, device_type: str) -> torch.Tensor:
    """:func:`batch_norm` of a call :func:`amp_bn_fix._decide.common` accepted (``args`` by position).

    The same routes and results, without the questions that call has settled: plain eager mode on
    CPU or CUDA, FP32 (or absent) parameters and 1-D statistics of one shape. Written flat (the
    guard's two halves around the kernel, the autocast key by its C functions): on the call every
    BatchNorm module makes, each Python frame costs a tenth of a microsecond or more.
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = args
    values = input.numel()
    host = device_type == "cpu" and not _tuning.emulate_device
    out_dtype = plan.out_dtype
    # torch's own F.batch_norm (not another library's wrapper of it) is torch.batch_norm once its
    # checks pass: no torch function override (exact types, and no mode: a default-device mode
    # would see the call again), more than one value per channel and a positive eps (else its
    # errors, from it). torch.batch_norm is looked up at each call, as there, so that a patch applies.
    direct = (original is _F_BATCH_NORM and type(eps) is float and eps > 0.0 and not function_mode_enabled()
              and not (training and values == input.size(1)))
    same_dtype = out_dtype is input.dtype
    layout = _mixed_kernel_layout(input) if same_dtype else None
    guard = training and running_mean is not None and plan.guard
    mean, var = running_mean, running_var
    # The host guard of few channels, written out (the halves in ``_stats`` cost two frames more):
    # the stats (1-D, of one shape here) kept and checked as Python floats, as there; the restore
    # and its count are ``settle_on_host``'s. The lane's tests hold the two spellings to one result.
    listed = guard and host and mean.numel() <= _stats.LISTED_CHANNELS
    key = LANE_AUTOCAST_KEYS[device_type]
    was_excluded = key_excluded(key)  # as autocast_excluded in batch_norm, at a quarter of the cost
    if not was_excluded:
        set_key_excluded(key, True)
    try:
        if listed:
            before = mean.tolist(), var.tolist()
            listed = isfinite(sum(before[0]) + sum(before[1]))  # else snapshot_on_host's exact copy
        if guard and not listed:
            if host:
                before = _stats.snapshot_on_host(mean, var)
            else:
                work = _stats.working_on_device(mean, var)
                mean, var = work.unbind()
        try:
            if layout is not None and input.is_cpu:
                out = _kernels.mixed_batch_norm(_torch_f_batch_norm if direct else original, layout, input,
                                                mean, var, weight, bias, training, momentum, eps)
            elif (layout is None and host and training and _tuning.fast_paths
                  and values >= _tuning.MIN_VALUES  # min_values()'s floor, without its call
                  and values >= _tuning.min_values()
                  and _kernels.fp32_train_eligible(input, mean, var, weight, bias, training, momentum, eps)):
                out = _kernels.fp32_train_batch_norm(input, mean, var, weight, bias, momentum, eps)
            else:
                x = input if layout is not None else input.float()
                if direct:
                    out = torch.batch_norm(x, weight, bias, mean, var, training, momentum, eps, cudnn_enabled())
                else:
                    out = original(x, mean, var, weight, bias, training, momentum, eps)
        finally:
            if listed:
                if not isfinite(sum(mean.tolist()) + sum(var.tolist())):
                    _stats.settle_on_host(running_mean, running_var, before)
            elif guard:
                if host:
                    _stats.settle_on_host(running_mean, running_var, before)
                else:
                    _stats.settle_on_device(running_mean, running_var, work)
    finally:
        if not was_excluded:
            set_key_excluded(key, False)
    return out if out.dtype is out_dtype else out.to(out_dtype)


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


def recorded_region_batch_norm(
    original: Original, call: BatchNormCall, policy: str, region_dtype: torch.dtype, guard: bool
) -> torch.Tensor:
    """Record ``call`` as the policy computes it when the recorded autocast region runs.

    Strict ``torch.export`` traces the body of an autocast block without autocast (see
    :func:`~amp_bn_fix._compat.recorded_autocast_dtype`): the input it sees has no telling dtype,
    so the graph gets the casts that give the policy's result whatever the input's dtype when it
    runs. ``fp32``: the input cast to FP32, an FP32 batch norm. ``autocast``: the same, its output
    cast to ``region_dtype``. ``input``: the input as it comes, with FP32 weight, bias and
    statistics, which torch's mixed-dtype kernels compute in FP32 and return in the input's dtype.
    Running stats as in every traced call: FP32 working copies, guarded, written back in place.
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    x = input if policy == "input" else to_copy(input, torch.float32)
    weight, bias = to_fp32(weight), to_fp32(bias)

    def kernel(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
        return original(x, mean, var, weight, bias, training, momentum, eps)

    out = _stats.updating(running_mean, running_var, bool(training), guard, False, False, kernel)
    return to_copy(out, region_dtype) if policy == "autocast" else out
