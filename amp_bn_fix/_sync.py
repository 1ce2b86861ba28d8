"""SyncBatchNorm's syncing path, under the same policy as ``F.batch_norm``.

With more than one rank (CUDA/XPU/HPU), ``nn.SyncBatchNorm`` calls
``torch.nn.modules._functions.SyncBatchNorm.apply`` instead of ``F.batch_norm``. Its wrapper gives
a handled call FP32 input, weight, bias and running stats with autocast off, so the statistics
gathered across ranks and the normalization are FP32; the output dtype follows the policy.
Stateless like ``_policy``: the runtime hands in its thread state and settings.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from . import _policy
from ._compat import autocast_disabled
from ._config import Config

Wrapper = Callable[[Callable[..., torch.Tensor], Any, tuple, dict], torch.Tensor]


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


def as_batch_norm_call(call: SyncCall) -> _policy.BatchNormCall:
    """The same call as ``F.batch_norm`` arguments (the syncing path always trains)."""
    return _policy.BatchNormCall(
        call.input, call.running_mean, call.running_var, call.weight, call.bias, True, call.momentum, call.eps
    )


def fp32_sync_batch_norm(
    original: Callable[..., torch.Tensor], call: SyncCall, out_dtype: torch.dtype, guard: bool
) -> torch.Tensor:
    """Run the syncing ``original`` on FP32 tensors; the result is cast to ``out_dtype``.

    Running stats are handled as for ``F.batch_norm``: FP32 ones are updated in place, others (or
    all, with ``guard``) through an FP32 copy written back, which the guard skips when the global
    statistics are not finite.
    """
    mean = _policy._working_stat(call.running_mean, True, guard)
    var = _policy._working_stat(call.running_var, True, guard)
    with autocast_disabled(call.input.device.type):
        out = original(
            call.input.float(),
            _policy._fp32(call.weight),
            _policy._fp32(call.bias),
            mean,
            var,
            call.eps,
            call.momentum,
            call.process_group,
            call.world_size,
        )
    if call.running_mean is not None and call.running_var is not None:
        if mean is not call.running_mean or var is not call.running_var:
            _policy._write_back((call.running_mean, call.running_var), (mean, var), guard)
    return out if out.dtype is out_dtype else out.to(out_dtype)


def wrapper(thread: Any, current_config: Callable[[], Config]) -> Wrapper:
    """The wrapt wrapper for ``SyncBatchNorm.apply``.

    ``thread`` is the runtime's thread-local state (``inside``: re-entrancy flag, ``policy``: scoped
    override); ``current_config()`` gives the process-wide settings at each call.
    """

    def sync_batch_norm_wrapper(
        wrapped: Callable[..., torch.Tensor], instance: Any, args: tuple, kwargs: dict
    ) -> torch.Tensor:
        input = args[0] if args else kwargs.get("input")
        if getattr(input, "dtype", None) not in _policy.LOW_PRECISION or thread.inside:
            return wrapped(*args, **kwargs)
        try:
            call = bind(*args, **kwargs)
        except TypeError:
            return wrapped(*args, **kwargs)  # raises torch's own error for a malformed call
        config = current_config()
        if config.devices is not None and call.input.device.type not in config.devices:
            return wrapped(*args, **kwargs)
        out_dtype = _policy.output_dtype(thread.policy or config.policy, as_batch_norm_call(call))
        if out_dtype is None:
            return wrapped(*args, **kwargs)
        thread.inside = True
        try:
            return fp32_sync_batch_norm(wrapped, call, out_dtype, config.guard)
        finally:
            thread.inside = False

    return sync_batch_norm_wrapper
