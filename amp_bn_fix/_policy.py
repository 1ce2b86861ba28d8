"""The batch-norm policy: which calls are handled and how a handled call is computed.

Device-agnostic and stateless. The runtime (``_patch``) passes in the original
``torch.nn.functional.batch_norm``, the active policy and the settings; nothing here reads globals.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch

from . import _kernels
from ._compat import autocast_disabled, autocast_dtype, autocast_enabled, has_internal_overlap, jit_tracing, plain_eager

LOW_PRECISION = (torch.float16, torch.bfloat16)
_INF = float("inf")
_aten = torch.ops.aten


class BatchNormCall(NamedTuple):
    """The arguments of one ``F.batch_norm`` call, by name."""

    input: torch.Tensor
    running_mean: Optional[torch.Tensor]
    running_var: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    training: bool
    momentum: float
    eps: float


def bind(
    input: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> BatchNormCall:
    """Bind ``F.batch_norm``'s arguments (same signature; a test keeps them in step)."""
    return BatchNormCall(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _is_mixed(call: BatchNormCall) -> bool:
    """Whether a parameter or running stat has a dtype other than the input's.

    Native kernels reject most such calls with a half input (e.g. half weight with FP32 stats,
    which is what ``model.half()`` leaves when running stats are kept in FP32).
    """
    dtype = call.input.dtype
    return any(
        t is not None and t.dtype is not dtype
        for t in (call.running_mean, call.running_var, call.weight, call.bias)
    )


def left_by_keep_stats(call: BatchNormCall) -> bool:
    """Whether ``call`` has FP32 running stats next to weight and bias in the 16-bit input's dtype.

    That is what a 16-bit cast leaves with ``AMP_BN_FIX_KEEP_FP32=stats``, and torch's kernels
    reject it ("expected scalar type Half but found Float"), so where the policy would pass the
    call through (``off``, a device type left out) it is computed anyway, as outside autocast.
    Any other mix is torch's to accept or reject.
    """
    if _torch_decides(call) or call.running_mean is None or call.running_var is None:
        return False
    dtype = call.input.dtype
    return (
        call.running_mean.dtype is torch.float32
        and call.running_var.dtype is torch.float32
        and all(t is None or t.dtype is dtype for t in (call.weight, call.bias))
        and not (call.weight is None and call.bias is None)
    )


def _torch_decides(call: BatchNormCall) -> bool:
    """Whether ``call`` goes to torch untouched: calls torch rejects, or whose update it owns.

    A non-tensor parameter or statistic gets torch's own ``TypeError``, and a non-float one (integer
    running stats) torch's own dtype error, which names the input's dtype, not FP32; in training,
    running stats that require grad get torch's refusal, and stats whose elements share memory
    (expanded, stride 0) get torch's own update, which no copy-and-write-back can reproduce.
    """
    tensors = (call.running_mean, call.running_var, call.weight, call.bias)
    if any(t is not None and not (isinstance(t, torch.Tensor) and t.is_floating_point()) for t in tensors):
        return True
    if call.training:
        for stat in (call.running_mean, call.running_var):
            if stat is not None and (stat.requires_grad or has_internal_overlap(stat)):
                return True
    return False


def output_dtype(policy: str, call: BatchNormCall) -> Optional[torch.dtype]:
    """The output dtype of a handled call, or ``None`` when the call runs natively.

    The caller has already checked that the input is float16/bfloat16 on a selected device.
    """
    if policy == "off" or _torch_decides(call):
        return None
    device_type = call.input.device.type
    if autocast_enabled(device_type):
        if policy == "fp32":
            return torch.float32
        if policy == "autocast":
            return autocast_dtype(device_type)
        return call.input.dtype
    if _is_mixed(call):
        # Outside autocast the caller chose half precision; only the arithmetic is FP32.
        return call.input.dtype
    return None


def to_fp32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # A differentiable cast: gradients flow back to the original tensor in its own dtype. As a
    # copy op, unlike ``t.float()``: torch.export pins the input dtype of ``.to`` calls, which
    # would stop an exported program from running without autocast. Under torch.jit.trace it is
    # ``.to``, the cast TorchScript's ONNX exporter knows. (Non-float tensors never get here:
    # ``_torch_decides`` leaves those calls to torch.)
    if t is None or t.dtype is torch.float32:
        return t
    return _cast(t, torch.float32)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a new tensor of ``dtype``, recorded by every tracer (see :func:`to_fp32`)."""
    if jit_tracing():
        return t.to(dtype, copy=True)
    return _aten._to_copy(t, dtype=dtype)


def _working_stat(stat: Optional[torch.Tensor], updates: bool, guard: bool) -> Optional[torch.Tensor]:
    """The FP32 tensor the kernel reads (and, in training, updates in place).

    Read-only (eval), it is ``stat`` cast to FP32 like any input, gradients included. Updated,
    it is ``stat`` itself when that is already FP32 and needs no protection, so module buffers see
    the update directly; otherwise an FP32 copy that is written back afterwards.
    """
    if stat is None:
        return stat
    if not updates:
        return to_fp32(stat)
    if stat.dtype is torch.float32 and not guard:
        return stat
    return stat.detach().to(torch.float32, copy=True)


# Told, in plain eager mode, what the guard decided for a running mean: True or False when it was
# decided on the host, a 0-dim bool tensor (all finite) when on the device. Called with no sync.
GuardCheck = Callable[[torch.Tensor, Union[bool, torch.Tensor]], None]


@torch.no_grad()
def _write_back(stats: Tuple[torch.Tensor, ...], new: Tuple[torch.Tensor, ...], guard: bool, eager: bool
                ) -> Optional[torch.Tensor]:
    """Copy the updated working stats into the caller's tensors.

    In plain eager mode the copy goes through ``.data``, like the native kernels' update: it bumps
    no version counter, so an earlier eval-mode call that saved ``stat`` for its backward still
    works. Anywhere else (tracers, ``torch.func`` transforms, where ``.data`` is invisible or
    forbidden) it is an ordinary in-place copy, which every tracer records as a buffer update.
    """
    finite = None
    if guard:
        # Device-side select, no host sync: a non-finite batch leaves the stats exactly as they were.
        finite = torch.isfinite(torch.cat(new)).all()
        new = tuple(torch.where(finite, n, s.to(torch.float32)) for s, n in zip(stats, new))
    for stat, value in zip(stats, new):
        if value is not stat:
            (stat.data if eager else stat).copy_(value)
    return finite


def _stackable(running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor]) -> bool:
    """Whether the two stats can share one FP32 working tensor (a mismatch is torch's to report)."""
    return (
        running_mean is not None
        and running_var is not None
        and running_mean.dtype is torch.float32
        and running_var.dtype is torch.float32
        and running_mean.shape == running_var.shape
        and running_mean.numel() > 0  # amax has no identity for zero channels
        and running_mean.device == running_var.device
    )


def _guarded_write_back(stats: Tuple[torch.Tensor, torch.Tensor], work: torch.Tensor, on_host: bool
                        ) -> Union[bool, torch.Tensor]:
    """Write ``work`` (the two updated stats, stacked) into ``stats`` only if it is all finite.

    The old values stay bit for bit, so a non-finite batch leaves the stats exactly as they were.
    Writes go through ``.data`` (plain eager mode only, see :func:`_write_back`); ``work`` never
    requires grad. ``on_host`` (CPU, where reading a value costs no device sync): one ``aminmax``
    (which propagates NaN) decides and the stats are copied only when every value is finite, the
    fewest kernels. Otherwise the decision stays on the device (no host sync): one check over both
    stats (``amax`` propagates NaN, and the largest magnitude is finite only if every value is)
    and one in-place select per stat. Returns whether the stats were written (a 0-dim tensor on
    the device).
    """
    if on_host:
        low, high = torch.aminmax(work)
        written = math.isfinite(low.item()) and math.isfinite(high.item())
        if written:
            stats[0].data.copy_(work[0])
            stats[1].data.copy_(work[1])
        return written
    finite = work.abs().amax() < _INF
    torch.where(finite, work[0], stats[0].data, out=stats[0].data)
    torch.where(finite, work[1], stats[1].data, out=stats[1].data)
    return finite


def with_working_stats(
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    updates: bool,
    guard: bool,
    eager: bool,
    compute: Callable[[Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor],
    on_check: Optional[GuardCheck] = None,
) -> torch.Tensor:
    """``compute(mean, var)`` on FP32 running stats, then the update written back to the caller's.

    FP32 stats that need no protection are passed as they are (updated in place); others, and
    all of them with ``guard`` in training, as FP32 copies written back afterwards, which the
    guard skips when the new statistics are not finite. ``eager``: the call runs in plain eager
    mode (see :func:`_write_back`); there ``on_check`` hears each decision of the guard.
    """
    if updates and guard and eager and _stackable(running_mean, running_var):
        # The guard's common case, FP32 stats: one copy of both, updated by ``compute``. Plain eager
        # only: under torch.func transforms a kernel's update of a view of the stack is not seen.
        work = torch.stack((running_mean.detach(), running_var.detach()))  # type: ignore[union-attr]
        out = compute(work[0], work[1])
        finite = _guarded_write_back((running_mean, running_var), work, work.is_cpu)  # type: ignore[arg-type]
        if on_check is not None:
            on_check(running_mean, finite)  # type: ignore[arg-type]
        return out
    work_mean = _working_stat(running_mean, updates, guard)
    work_var = _working_stat(running_var, updates, guard)
    out = compute(work_mean, work_var)
    if updates and running_mean is not None and running_var is not None:
        if work_mean is not running_mean or work_var is not running_var:
            finite = _write_back((running_mean, running_var), (work_mean, work_var), guard, eager)  # type: ignore[arg-type]
            if finite is not None and eager and on_check is not None:
                on_check(running_mean, finite)
    return out


def fp32_batch_norm(original, call: BatchNormCall, out_dtype: torch.dtype, guard: bool,
                    on_check: Optional[GuardCheck] = None) -> torch.Tensor:
    """Compute ``call`` with FP32 statistics, normalization and running-stat update.

    Autocast is off inside so nothing recasts half-way; the result is cast to ``out_dtype``.
    With ``guard``, a training step whose statistics are not finite leaves the running stats
    untouched (the output still carries the inf/NaN, so GradScaler sees it).
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    # The fast paths (see ``_kernels``) compute what the reference ``original(to_fp32(input), ...)``
    # computes without copying the input to FP32 for the statistics; only in plain eager mode on CPU.
    eager = plain_eager(input, running_mean, running_var, weight, bias)
    fast = eager and input.is_cpu
    weight, bias = to_fp32(weight), to_fp32(bias)

    def compute(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
        with autocast_disabled(input.device.type):
            if fast and out_dtype is input.dtype and _kernels.mixed_kernel_layout(input) is not None:
                return _kernels.mixed_batch_norm(original, input, mean, var, weight, bias, training, momentum, eps)
            if fast and _kernels.fp32_train_eligible(input, mean, var, weight, bias, training, momentum, eps):
                return _kernels.fp32_train_batch_norm(input, mean, var, weight, bias, momentum, eps)
            return original(to_fp32(input), mean, var, weight, bias, training, momentum, eps)

    out = with_working_stats(running_mean, running_var, bool(training), guard, eager, compute, on_check)
    return out if out.dtype is out_dtype else out.to(out_dtype)


def recorded_region_batch_norm(
    original, call: BatchNormCall, policy: str, region_dtype: torch.dtype, guard: bool
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
    x = input if policy == "input" else _cast(input, torch.float32)
    weight, bias = to_fp32(weight), to_fp32(bias)

    def compute(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
        return original(x, mean, var, weight, bias, training, momentum, eps)

    out = with_working_stats(running_mean, running_var, bool(training), guard, False, compute)
    return _cast(out, region_dtype) if policy == "autocast" else out
