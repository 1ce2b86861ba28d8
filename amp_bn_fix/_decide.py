"""Decide: whether the shim computes a batch-norm call, and with which output dtype.

Pure and cheap: a handful of attribute reads per call, no tensor op, no state but the few plans
the common call has (:func:`common`). The runtime (``_patch``) passes in the policy in force
and the settings.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from ._compat import autocast_dtype, autocast_enabled, has_internal_overlap, is_autocast_enabled, untraced

LOW_PRECISION = (torch.float16, torch.bfloat16)
_F32 = torch.float32
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


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


class Plan(NamedTuple):
    """How the shim computes one call: FP32 arithmetic, then this output dtype."""

    out_dtype: torch.dtype
    # Skip a training step's running-stat update when the new statistics are not finite.
    guard: bool
    # What :func:`amp_bn_fix.report` counts the call under: what it did, not the setting's name
    # (a call outside autocast returns the input's dtype, so it counts as ``input``).
    counted_as: str
    # The 16-bit running stats have an FP32 master (``AMP_BN_FIX_KEEP_FP32=master``, see ``_master``).
    master: bool = False


def plan(call: BatchNormCall, policy: str, guard: bool, keep: str,
         has_master: Callable[[torch.Tensor, torch.Tensor], bool] = lambda mean, var: False) -> Optional[Plan]:
    """The plan for a call on a float16/bfloat16 input, or ``None`` when torch computes it.

    ``policy`` is the one in force for the call's device type (``"off"`` for a type the settings
    leave out), ``keep`` the ``keep_fp32`` setting. One pass over the tensors: this runs on every
    16-bit call. With ``keep="master"``, 16-bit running stats are computed with an FP32 master
    under autocast; outside autocast only those that have one (``has_master``: a model cast while
    the shim was enabled), so other all-16-bit calls there stay torch's, bit for bit.
    """
    input = call.input
    dtype = input.dtype
    if dtype is not torch.float16 and dtype is not torch.bfloat16:
        return None
    mixed = _mixed_or_torch_decides(call, dtype)
    if mixed is None:
        return None
    if policy == "off":
        return Plan(dtype, False, "input") if _left_by_keep_stats(call, dtype) else None
    master = keep == "master" and _has_16_bit_stats(call)
    # A meta tensor has no values for the guard to judge (and none for report() to read), and stats
    # on another device than the input's are torch's error to report, not the guard's to read.
    guard = guard and not input.is_meta and _on_device_of(input, call.running_mean, call.running_var)
    device_type = input.device.type
    if autocast_enabled(device_type):
        if policy == "fp32":
            return Plan(_F32, guard, policy, master)
        if policy == "autocast":
            return Plan(autocast_dtype(device_type), guard, policy, master)
        return Plan(dtype, guard, policy, master)
    if master:
        master = has_master(call.running_mean, call.running_var)  # type: ignore[arg-type]
    if mixed or master:
        # Outside autocast the caller chose half precision; only the arithmetic is FP32.
        return Plan(dtype, guard, "input", master)
    return None


def common(args: tuple, device_type: str, policy: str, guard: bool) -> Optional[Plan]:
    """The plan of ``args`` (``F.batch_norm``'s eight, by position) if they are the call autocast makes most.

    That is: autocast on for ``device_type`` (``"cpu"`` or ``"cuda"``, the input's), plain eager
    mode, a 16-bit input (its dtype the caller's to check) of two dimensions or more, FP32 (or
    absent) weight, bias and running stats (tensors of exact types: no subclass, no other object),
    ``training`` a bool; in training, both running stats or neither, 1-D, of one shape and on the
    input's device, not requiring grad, contiguous. Such a call raises none of :func:`plan`'s
    questions (masters, mixed dtypes, what torch rejects or must update itself): its plan under
    ``policy`` (not ``"off"``) is the one :func:`plan` would make, decided in a few attribute
    reads. Any other call gets None, and is decided by :func:`plan`.
    """
    input, mean, var, weight, bias, training, _, _ = args
    if type(input) is not _Tensor or input.dim() < 2 or not is_autocast_enabled(device_type):
        return None
    for t in (weight, bias, mean, var):
        if t is not None and ((type(t) is not _Tensor and type(t) is not _Parameter) or t.dtype is not _F32):
            return None
    if training is True:
        if (mean is not None or var is not None) and (
            mean is None
            or var is None
            or mean.requires_grad
            or var.requires_grad
            or mean.dim() != 1  # 1-D, of one shape, contiguous, with values: one joined copy
            or var.shape != mean.shape
            or not mean.is_contiguous()
            or not var.is_contiguous()
            or mean.numel() == 0
            or not (mean.is_cpu and var.is_cpu if device_type == "cpu"
                    else mean.get_device() == var.get_device() == input.get_device())
        ):
            return None
    elif training is not False:
        return None
    if not untraced(input, mean, var, weight, bias):
        return None
    # The few plans this makes, each made once (a NamedTuple costs a Python call).
    out_dtype = _F32 if policy == "fp32" else autocast_dtype(device_type) if policy == "autocast" else input.dtype
    key = (out_dtype, guard, policy)
    found = _common_plans.get(key)
    if found is None:
        found = _common_plans[key] = Plan(out_dtype, guard, policy)
    return found


_common_plans: Dict[Tuple[torch.dtype, bool, str], Plan] = {}


def _on_device_of(input: torch.Tensor, *stats: Optional[torch.Tensor]) -> bool:
    device = input.device
    return all(stat is None or stat.device == device for stat in stats)


def _has_16_bit_stats(call: BatchNormCall) -> bool:
    mean, var = call.running_mean, call.running_var
    return mean is not None and var is not None and mean.dtype in LOW_PRECISION and var.dtype is mean.dtype


def _mixed_or_torch_decides(call: BatchNormCall, dtype: torch.dtype) -> Optional[bool]:
    """``None`` when ``call`` goes to torch untouched, else whether a tensor's dtype differs from the input's.

    To torch go calls it rejects or whose update it owns: a non-tensor parameter or statistic
    gets torch's own ``TypeError``, and one of another dtype than FP32 or 16 bits (integer or
    float64 running stats) torch's own dtype error; in training, running stats that require grad
    get torch's refusal, and stats whose elements share memory (expanded, stride 0) get torch's
    own update, which no copy-and-write-back can reproduce. A mixed call is one native kernels
    reject with a half input (e.g. half weight with FP32 stats, what ``model.half()`` leaves when
    the running stats are kept FP32).
    """
    mixed = False
    for t in (call.running_mean, call.running_var, call.weight, call.bias):
        if t is None:
            continue
        if not isinstance(t, _Tensor):
            return None
        t_dtype = t.dtype
        if t_dtype is not dtype:
            if t_dtype is not _F32 and t_dtype not in LOW_PRECISION:
                return None  # integer, float64...: torch's error ("expect parameter to have scalar type of Float")
            mixed = True
    if call.training:
        for stat in (call.running_mean, call.running_var):
            if stat is not None and (stat.requires_grad or (not stat.is_contiguous() and has_internal_overlap(stat))):
                return None
    return mixed


def _left_by_keep_stats(call: BatchNormCall, dtype: torch.dtype) -> bool:
    """Whether ``call`` has FP32 running stats next to weight and bias in the 16-bit input's dtype.

    That is what a 16-bit cast leaves with ``AMP_BN_FIX_KEEP_FP32=stats``, and torch's kernels
    reject it ("expected scalar type Half but found Float"), so where the policy would pass the
    call through (``off``, a device type left out) it is computed anyway, as outside autocast
    (FP32 arithmetic, the input's dtype out, no guard). Any other mix is torch's to accept or reject.
    """
    mean, var, weight, bias = call.running_mean, call.running_var, call.weight, call.bias
    if mean is None or var is None or (weight is None and bias is None):
        return False
    return (
        mean.dtype is _F32
        and var.dtype is _F32
        and (weight is None or weight.dtype is dtype)
        and (bias is None or bias.dtype is dtype)
    )
