"""Decide one batch-norm call: whether the shim computes it, and how (:func:`plan`).

Pure and cheap: attribute reads, no tensor op, no state but the settings and scopes (``_state``) and
whether 16-bit stats have an FP32 master (``_master``); one exception, a float16 model's eval call
outside autocast, reads on the host whether its buffers overflowed. Every door asks :func:`plan`
and nothing else.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from . import _master, _state
from ._compat import (LOW_PRECISION, autocast_dtype, autocast_enabled, function_mode_enabled, has_internal_overlap,
                      is_compiling, is_exporting, recorded_autocast_dtype, untraced)

_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_is_autocast_enabled = torch.is_autocast_enabled


class BatchNormCall(NamedTuple):
    """The arguments of one ``F.batch_norm`` call, by name (a door may pass the same eight by position)."""

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


class Plan(NamedTuple):
    """How the shim computes one call: FP32 arithmetic, then this output dtype."""

    # None only in a region strict export records (policy ``input``): the kernel's result as it is.
    out_dtype: Optional[torch.dtype]
    # Skip a training step's running-stat update when the new statistics are not finite.
    guard: bool
    # What :func:`amp_bn_fix.report` counts the call under: what it did, not the setting's name
    # (a call outside autocast returns the input's dtype, so it counts as ``input``).
    counted_as: str
    # The 16-bit running stats have an FP32 master (``keep_fp32="master"``, see ``_master``).
    master: bool = False
    # The call BatchNorm modules make under autocast in plain eager mode: exact tensor types, FP32
    # (or absent) parameters and 1-D stats of one shape. ``_compute`` need not ask it anything.
    plain: bool = False
    # A call strict torch.export records inside an autocast block without entering it: the input's
    # dtype when the program runs is not known (see ``_compat.recorded_autocast_dtype``).
    recorded: bool = False
    # A half model's training call outside autocast: the output is torch's kernel's on the call as
    # given (bit for bit plain torch's), and the shim's FP32 kernel only updates the master.
    torch_output: bool = False


def plan(call: Tuple[Any, ...], guard: bool = True) -> Optional[Plan]:
    """The plan for ``call`` (``F.batch_norm``'s eight arguments), or ``None`` when torch computes it.

    ``guard`` False: the running stats are not the caller's to guard (InstanceNorm's per-sample
    copies, whose average the door guards). First the test every call pays: a 16-bit input, or an
    FP32 one under a TorchFunctionMode (strict export's records autocast regions without entering
    them) or next to 16-bit weights or stats. Then the common call (the one BatchNorm modules make
    under autocast), decided in a few reads, and a half model's eval call outside autocast, left to
    torch in a few more; every other call by the questions below them.
    """
    input, mean, var, weight, bias, training, _, _ = call
    dtype = getattr(input, "dtype", None)
    if dtype is not _F16 and dtype is not _BF16 and (
            dtype is not _F32 or not (function_mode_enabled() or _any_16_bit(mean, var, weight, bias))):
        return None
    config = _state.config
    guard = guard and config.guard
    device_type = "cpu" if input.is_cpu else "cuda" if input.is_cuda else None
    if (
        device_type is not None
        and dtype is not _F32
        and type(input) is _Tensor
        and input.dim() >= 2
        and _is_autocast_enabled(device_type)
        and (training is False or training is True)
    ):
        plain = True
        # FP32 (or absent) weight, bias and stats of exact types (no subclass, no other object).
        for t in (weight, bias, mean, var):
            if t is not None and ((type(t) is not _Tensor and type(t) is not _Parameter) or t.dtype is not _F32):
                plain = False
        # In training, both stats or neither; 1-D, of one shape, contiguous, with values, not
        # requiring grad and on the input's device (so the guard's snapshot is one joined copy).
        if plain and training and (mean is not None or var is not None):
            plain = not (
                mean is None
                or var is None
                or mean.requires_grad
                or var.requires_grad
                or mean.dim() != 1
                or var.shape != mean.shape
                or not mean.is_contiguous()
                or not var.is_contiguous()
                or mean.numel() == 0
                or not (mean.is_cpu and var.is_cpu if device_type == "cpu"
                        else mean.get_device() == var.get_device() == input.get_device())
            )
        if plain and untraced(input, mean, var, weight, bias):
            policy = _state.policy(device_type, False)
            if policy == "off":
                return None
            # The few plans of the common call, each made once: a NamedTuple costs a Python call.
            key = (policy, dtype, guard, autocast_dtype(device_type) if policy == "autocast" else None)
            found = _plain_plans.get(key)
            if found is None:
                found = _plain_plans[key] = Plan(_out_dtype(policy, device_type, dtype), guard, policy, False, True)
            return found
    # A half model's eval call outside autocast (every tensor in the input's dtype) is torch's own,
    # whatever the policy: decided here, unless float16 buffers overflowed that have a master.
    if (training is False and device_type is not None and not _is_autocast_enabled(device_type)
            and not function_mode_enabled() and not _mixed(call, dtype) and mean is not None and var is not None
            and not (dtype is _F16 and config.keep_fp32 == "master" and _master.holds_more(mean, var))):
        return None
    device_type = input.device.type
    policy = _state.policy(device_type)
    # Strict torch.export traces with dynamo too, but keeps no compiled code a scope could miss.
    if is_compiling() and not is_exporting():
        _state.compiled_policies.add(policy)
    if policy != "off":
        region_dtype = recorded_autocast_dtype(device_type)
        if region_dtype is not None:
            out_dtype = None if policy == "input" else _out_dtype(policy, device_type, _F32, region_dtype)
            return Plan(out_dtype, guard, policy, recorded=True)
    # An FP32 input is the shim's only next to 16-bit weights or stats: what the ``fp32`` policy
    # hands a half model's next BatchNorm (through a concatenation or a pooling), which torch rejects.
    if (dtype is _F32 and not _any_16_bit(mean, var, weight, bias)) or _left_to_torch(call):
        return None
    if policy == "off":
        return Plan(dtype, False, "input") if _left_by_keep_stats(call, dtype) else None
    master = config.keep_fp32 == "master" and _has_16_bit_stats(mean, var)
    # A meta tensor has no values for the guard to judge (and none for report() to read), and stats
    # on another device than the input's are torch's error to report, not the guard's to read.
    guard = guard and not input.is_meta and _on_device_of(input, mean, var)
    if autocast_enabled(device_type):
        return Plan(_out_dtype(policy, device_type, dtype), guard, policy, master)
    if dtype is _F32:  # outside autocast such a mix keeps torch's own error
        return None
    # Outside autocast the caller chose half precision, and the output is torch's own: a call torch
    # computes as it is gets torch's kernel, and the master the FP32 update of its running stats
    # (started here if there is none). A mix torch's kernels reject gets FP32 arithmetic.
    if _mixed(call, dtype):
        return Plan(dtype, guard, "input", master)
    if master and (training or _master.holds_more(mean, var)):  # type: ignore[arg-type]
        return Plan(dtype, guard, "input", True, torch_output=bool(training))
    return None


def _out_dtype(policy: str, device_type: str, input_dtype: torch.dtype,
               autocast: Optional[torch.dtype] = None) -> torch.dtype:
    """The output dtype ``policy`` gives under autocast: the one rule."""
    if policy == "fp32":
        return _F32
    if policy == "autocast":
        return autocast if autocast is not None else autocast_dtype(device_type)
    return input_dtype


_plain_plans: Dict[Tuple[str, torch.dtype, bool, Optional[torch.dtype]], Plan] = {}


def _any_16_bit(*tensors: Any) -> bool:
    return any(getattr(t, "dtype", None) in LOW_PRECISION for t in tensors)


def _on_device_of(input: torch.Tensor, *stats: Optional[torch.Tensor]) -> bool:
    device = input.device
    return all(stat is None or stat.device == device for stat in stats)


def _has_16_bit_stats(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> bool:
    return mean is not None and var is not None and mean.dtype in LOW_PRECISION and var.dtype is mean.dtype


def _left_to_torch(call: Tuple[Any, ...]) -> bool:
    """Whether torch must see ``call`` as it is: to reject it, or to update the stats itself.

    A non-tensor parameter or statistic gets torch's own ``TypeError``, one of another dtype than
    FP32 or 16 bits (integer, float64) torch's own dtype error ("expect parameter to have scalar
    type of Float"); in training, running stats that require grad get torch's refusal, and stats
    whose elements share memory (expanded, stride 0) torch's own update, which no copy-and-write-back
    can reproduce.
    """
    _, mean, var, weight, bias, training, _, _ = call
    for t in (mean, var, weight, bias):
        if t is not None and (not isinstance(t, _Tensor) or (t.dtype is not _F32 and t.dtype not in LOW_PRECISION)):
            return True
    if training:
        for stat in (mean, var):
            if stat is not None and (stat.requires_grad or (not stat.is_contiguous() and has_internal_overlap(stat))):
                return True
    return False


def _mixed(call: Tuple[Any, ...], dtype: torch.dtype) -> bool:
    """Whether a tensor's dtype differs from the 16-bit input's: a mix torch's kernels reject outside
    autocast (half weight with FP32 stats, what ``model.half()`` leaves when the stats are kept FP32)."""
    return any(t is not None and getattr(t, "dtype", None) is not dtype for t in call[1:5])


def _left_by_keep_stats(call: Tuple[Any, ...], dtype: torch.dtype) -> bool:
    """Whether ``call`` has FP32 running stats next to weight and bias in the 16-bit input's dtype.

    That is what a 16-bit cast leaves with ``AMP_BN_FIX_KEEP_FP32=stats``, and torch's kernels
    reject it ("expected scalar type Half but found Float"), so where the policy would pass the
    call through (``off``, a device type left out) it is computed anyway, as outside autocast
    (FP32 arithmetic, the input's dtype out, no guard). Any other mix is torch's to accept or reject.
    """
    _, mean, var, weight, bias, _, _, _ = call
    if mean is None or var is None or (weight is None and bias is None):
        return False
    return (
        mean.dtype is _F32
        and var.dtype is _F32
        and (weight is None or weight.dtype is dtype)
        and (bias is None or bias.dtype is dtype)
    )
