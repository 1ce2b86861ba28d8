"""SyncBatchNorm's syncing path, under the same policy as ``F.batch_norm``.

With more than one rank (CUDA/XPU/HPU), ``nn.SyncBatchNorm`` calls
``torch.nn.modules._functions.SyncBatchNorm.apply`` instead of ``F.batch_norm``. Its wrapper gives
a handled call FP32 input, weight, bias and running stats with autocast off, so the statistics
gathered across ranks and the normalization are FP32; the output dtype follows the policy.
Stateless like ``_compute``: the runtime (``_patch``) decides which calls are handled.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from . import _stats
from ._compat import autocast_disabled, plain_eager
from ._decide import BatchNormCall
from ._stats import to_fp32


class SyncCall(NamedTuple):
    """The arguments of one ``SyncBatchNorm.apply`` call, by name."""

    input: torch.Tensor
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    running_mean: Optional[torch.Tensor]
    running_var: Optional[torch.Tensor]
    eps: float
    momentum: float
    process_group: Any
    world_size: int


def bind(*args: Any, **kwargs: Any) -> SyncCall:
    """Bind ``SyncBatchNorm.apply``'s arguments (raises ``TypeError`` for any other shape)."""
    return SyncCall(*args, **kwargs)


def as_batch_norm_call(call: SyncCall) -> BatchNormCall:
    """The same call as ``F.batch_norm`` arguments (the syncing path always trains)."""
    return BatchNormCall(
        call.input, call.running_mean, call.running_var, call.weight, call.bias, True, call.momentum, call.eps
    )


def fp32_sync_batch_norm(original: Callable[..., torch.Tensor], call: SyncCall, out_dtype: torch.dtype,
                         guard: bool) -> torch.Tensor:
    """Run the syncing ``original`` on FP32 tensors; the result is cast to ``out_dtype``.

    Running stats are handled as for ``F.batch_norm`` (:func:`_stats.updating`): the guard skips
    the update when the global statistics are not finite.
    """

    def compute(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
        with autocast_disabled(call.input.device.type):
            return original(
                to_fp32(call.input),
                to_fp32(call.weight),
                to_fp32(call.bias),
                mean,
                var,
                call.eps,
                call.momentum,
                call.process_group,
                call.world_size,
            )

    eager = plain_eager(call.input, call.weight, call.bias, call.running_mean, call.running_var)
    # The device route: the syncing path runs on devices only (CUDA, XPU, HPU).
    out = _stats.updating(call.running_mean, call.running_var, True, guard, eager, False, compute)
    return out if out.dtype is out_dtype else out.to(out_dtype)
