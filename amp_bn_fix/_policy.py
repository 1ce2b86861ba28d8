"""The batch-norm policy: which calls are handled and how a handled call is computed.

Device-agnostic and stateless. The runtime (``_patch``) passes in the original
``torch.nn.functional.batch_norm``, the active policy and the settings; nothing here reads globals.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import _kernels
from ._compat import autocast_disabled, autocast_dtype, autocast_enabled

LOW_PRECISION = (torch.float16, torch.bfloat16)


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


def output_dtype(policy: str, call: BatchNormCall) -> Optional[torch.dtype]:
    """The output dtype of a handled call, or ``None`` when the call runs natively.

    The caller has already checked that the input is float16/bfloat16 on a selected device.
    """
    if policy == "off":
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
    # A differentiable cast: gradients flow back to the original tensor in its own dtype.
    # Non-float tensors are left for the kernel to reject with torch's own error.
    return t if t is None or t.dtype is torch.float32 or not t.is_floating_point() else t.float()


def _working_stat(stat: Optional[torch.Tensor], updates: bool, guard: bool) -> Optional[torch.Tensor]:
    """The FP32 tensor the kernel reads (and, in training, updates in place).

    It is ``stat`` itself when that is already FP32 and needs no protection, so module buffers
    see the update directly; otherwise an FP32 copy that is written back afterwards.
    """
    if stat is None or not stat.is_floating_point():
        return stat  # a non-float stat is left for the kernel to reject with torch's own error
    if stat.dtype is torch.float32 and not (updates and guard):
        return stat
    return stat.detach().to(torch.float32, copy=True)


@torch.no_grad()
def _write_back(stats: Tuple[torch.Tensor, ...], new: Tuple[torch.Tensor, ...], guard: bool) -> None:
    """Copy the updated working stats into the caller's tensors."""
    if guard:
        # Device-side select, no host sync: a non-finite batch leaves the stats exactly as they were.
        finite = torch.isfinite(torch.cat(new)).all()
        new = tuple(torch.where(finite, n, s.to(torch.float32)) for s, n in zip(stats, new))
    for stat, value in zip(stats, new):
        if value is not stat:
            # Through ``.data``, like the native kernels' update, the write bumps no version
            # counter: an earlier eval-mode call may have saved ``stat`` for its backward.
            stat.data.copy_(value)


def with_working_stats(
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    updates: bool,
    guard: bool,
    compute: Callable[[Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor],
) -> torch.Tensor:
    """``compute(mean, var)`` on FP32 running stats, then the update written back to the caller's.

    FP32 stats that need no protection are passed as they are (updated in place); others, and
    all of them with ``guard`` in training, as FP32 copies written back afterwards, which the
    guard skips when the new statistics are not finite.
    """
    work_mean = _working_stat(running_mean, updates, guard)
    work_var = _working_stat(running_var, updates, guard)
    out = compute(work_mean, work_var)
    if updates and running_mean is not None and running_var is not None:
        if work_mean is not running_mean or work_var is not running_var:
            _write_back((running_mean, running_var), (work_mean, work_var), guard)  # type: ignore[arg-type]
    return out


def fp32_batch_norm(original, call: BatchNormCall, out_dtype: torch.dtype, guard: bool) -> torch.Tensor:
    """Compute ``call`` with FP32 statistics, normalization and running-stat update.

    Autocast is off inside so nothing recasts half-way; the result is cast to ``out_dtype``.
    With ``guard``, a training step whose statistics are not finite leaves the running stats
    untouched (the output still carries the inf/NaN, so GradScaler sees it).
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    weight, bias = to_fp32(weight), to_fp32(bias)

    def compute(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
        with autocast_disabled(input.device.type):
            # The fast paths compute what the reference ``original(input.float(), ...)`` computes,
            # without copying the input to FP32 for the statistics (see ``_kernels``).
            fast = _kernels.fast_path_applies(input, mean, var, weight, bias)
            if fast and out_dtype is input.dtype and _kernels.mixed_kernel_layout(input) is not None:
                return _kernels.mixed_batch_norm(original, input, mean, var, weight, bias, training, momentum, eps)
            if fast and _kernels.fp32_train_eligible(input, mean, var, weight, bias, training, momentum, eps):
                return _kernels.fp32_train_batch_norm(input, mean, var, weight, bias, momentum, eps)
            return original(input.float(), mean, var, weight, bias, training, momentum, eps)

    out = with_working_stats(running_mean, running_var, bool(training), guard, compute)
    return out if out.dtype is out_dtype else out.to(out_dtype)
