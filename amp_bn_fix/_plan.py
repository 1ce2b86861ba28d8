"""Decide one batch-norm call: whether the shim computes it, and how (:func:`plan`).

The decision is one ordered table, :data:`ROUTES`: the first route whose predicate holds makes the
plan, or leaves the call to torch. Before it, the one test every call pays (:func:`considered`): a
16-bit input, or an FP32 one under a TorchFunctionMode (strict export records autocast regions
without entering them) or next to 16-bit weights or stats.

Pure: the routes read the call, the settings and the policy in force, and nothing else; one reads
tensor values (a float16 model's eval call outside autocast reads whether its buffers overflowed),
and says so by returning a :class:`Deferred` plan. In plain eager mode the table's answer is kept,
keyed by what the routes read (:func:`_key`), so the call BatchNorm modules make pays for the
table once per kind of call.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

from . import _guard, _master, _state
from ._compat import (LOW_PRECISION, any_autocast_enabled, autocast_dtype, autocast_enabled, device_type,
                      function_mode_enabled, has_internal_overlap, recorded_autocast_dtype, untraced)
from _amp_bn_fix_boot.settings import Config

_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_has_torch_function = torch._C._has_torch_function_variadic
_dispatch_modes = torch._C._len_torch_dispatch_stack


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
    # (or absent) parameters and 1-D stats of one shape on the input's device. ``_compute`` and
    # ``_guard`` need not ask it anything.
    plain: bool = False
    # A call strict torch.export records inside an autocast block without entering it: the input's
    # dtype when the program runs is not known (see ``_compat.recorded_autocast_dtype``).
    recorded: bool = False
    # A half model's training call outside autocast: the output is torch's kernel's on the call as
    # given (bit for bit plain torch's), and the shim's FP32 kernel only updates the running stats
    # (the master, or 16-bit stats through FP32 copies, rounded).
    torch_output: bool = False


class Deferred(NamedTuple):
    """A plan that holds only where ``when(running_mean, running_var)`` reads true: the call's values decide."""

    plan: Plan
    when: Callable[[torch.Tensor, torch.Tensor], bool]


Decision = Union[Plan, Deferred, None]


class Ask(NamedTuple):
    """What the routes read besides the call: read once per decision."""

    call: Tuple[Any, ...]
    config: Config
    device_type: str
    policy: str
    # The caller guards the running stats (InstanceNorm's per-sample copies are not the caller's).
    guard: bool
    untraced: bool


# ---- The rules the routes share, each once ----


def _out_dtype(policy: str, device_type: str, input_dtype: torch.dtype,
               autocast: Optional[torch.dtype] = None) -> torch.dtype:
    """The output dtype ``policy`` gives under autocast: the one rule."""
    if policy == "fp32":
        return _F32
    if policy == "autocast":
        return autocast if autocast is not None else autocast_dtype(device_type)
    return input_dtype


def _guarded(ask: Ask) -> bool:
    """Whether the guard judges this call's update: a training call's, asked for, of stats it can
    read. A meta tensor has no values, and stats on another device than the input's are torch's
    error to report."""
    input, mean, var, _, _, training = ask.call[:6]
    return (bool(training) and ask.guard and ask.config.guard and not input.is_meta
            and _on_device_of(input, mean, var))


def _has_master(ask: Ask) -> bool:
    """Whether the 16-bit stats have an FP32 master: under ``keep_fp32="master"`` (made at the first
    update if none is), else where one was made while it was (the setting applies to casts made
    after it changes: a model cast before goes on with its master)."""
    mean, var = ask.call[1], ask.call[2]
    return _has_16_bit_stats(mean, var) and (ask.config.keep_fp32 == "master" or _master.has(mean, var))


def _is_plain(ask: Ask) -> bool:
    """Whether an autocast call is the one BatchNorm modules make in plain eager mode (``Plan.plain``)."""
    input, mean, var, weight, bias, training = ask.call[:6]
    if not (ask.untraced and ask.device_type in ("cpu", "cuda") and input.dtype is not _F32
            and type(input) is _Tensor and input.dim() >= 2 and (training is True or training is False)):
        return False
    # FP32 (or absent) weight, bias and stats of exact types (no subclass, no other object).
    for t in (weight, bias, mean, var):
        if t is not None and ((type(t) is not _Tensor and type(t) is not _Parameter) or t.dtype is not _F32):
            return False
    if not training or (mean is None and var is None):
        return True
    # In training, both stats, 1-D, contiguous, not requiring grad, on the input's device and
    # joinable (so the guard's snapshot is one joined copy).
    return (mean is not None and var is not None and mean.dim() == 1 and not mean.requires_grad
            and not var.requires_grad and mean.is_contiguous() and var.is_contiguous()
            and _guard.joinable(mean, var) and _on_device_of(input, mean))


def shim_dtypes(call: Tuple[Any, ...]) -> bool:
    """Whether the dtypes of ``call`` (its first five arguments) are the shim's: a 16-bit input, or
    an FP32 one next to 16-bit weights or stats (a half model's, after an FP32 output)."""
    dtype = getattr(call[0], "dtype", None)
    if dtype is _F16 or dtype is _BF16:
        return True
    return dtype is _F32 and _16_bit_beside(call)


def _16_bit_beside(call: Tuple[Any, ...]) -> bool:
    """Whether a weight or stat of ``call`` is 16-bit."""
    # A loop, not ``any()`` over a generator: an FP32 call under autocast pays this.
    for t in call[1:5]:
        dtype = getattr(t, "dtype", None)
        if dtype is _F16 or dtype is _BF16:
            return True
    return False


def _on_device_of(input: torch.Tensor, *stats: Optional[torch.Tensor]) -> bool:
    device = input.device
    return all(stat is None or stat.device == device for stat in stats)


def _has_16_bit_stats(mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> bool:
    return mean is not None and var is not None and mean.dtype in LOW_PRECISION and var.dtype is mean.dtype


def _left_to_torch(call: Tuple[Any, ...], untraced: bool) -> bool:
    """Whether torch must see ``call`` as it is: to reject it, or to update the stats itself.

    A non-tensor parameter or statistic gets torch's own ``TypeError``, one of another dtype than
    FP32 or 16 bits (integer, float64) torch's own dtype error ("expect parameter to have scalar
    type of Float"); in training, running stats that require grad get torch's refusal, and stats
    whose elements share memory (expanded, stride 0) torch's own update, which no
    copy-and-write-back can reproduce. ``untraced``: in plain eager mode, also stats of another
    size than the input's channels get torch's size error (a master's update runs torch's
    statistics op there, which checks no size and would write past them; a tracer's shapes are
    not compared, and its calls reach only torch's checked kernels).
    """
    input, mean, var, weight, bias, training, _, _ = call
    for t in (mean, var, weight, bias):
        if t is not None and (not isinstance(t, _Tensor) or (t.dtype is not _F32 and t.dtype not in LOW_PRECISION)):
            return True
    if training:
        channels = input.shape[1:2] if untraced else None
        for stat in (mean, var):
            if stat is not None and (stat.requires_grad or (untraced and stat.shape != channels)
                                     or (not stat.is_contiguous() and has_internal_overlap(stat))):
                return True
    return False


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


# ---- The routes, in order: a predicate and a plan of a few lines each ----


def _recorded(ask: Ask) -> bool:
    return ask.policy != "off" and recorded_autocast_dtype(ask.device_type) is not None


def _plan_recorded(ask: Ask) -> Decision:
    # The input's dtype when the program runs is not known: ``input`` keeps what comes.
    region = recorded_autocast_dtype(ask.device_type)
    out = None if ask.policy == "input" else _out_dtype(ask.policy, ask.device_type, _F32, region)
    return Plan(out, _guarded(ask), ask.policy, recorded=True)


def _torchs(ask: Ask) -> bool:
    """An FP32 input with nothing 16-bit next to it, or a call torch must see as it is: to reject
    it, or to update the stats itself (:func:`_left_to_torch`)."""
    call = ask.call
    return (call[0].dtype is _F32 and not shim_dtypes(call)) or _left_to_torch(call, ask.untraced)


def _off(ask: Ask) -> bool:
    return ask.policy == "off"


def _plan_off(ask: Ask) -> Decision:
    # What torch's kernels reject (FP32 stats kept next to 16-bit weights) is computed anyway.
    dtype = ask.call[0].dtype
    return Plan(dtype, False, "input") if _left_by_keep_stats(ask.call, dtype) else None


def _autocast(ask: Ask) -> bool:
    return autocast_enabled(ask.device_type)


def _plan_autocast(ask: Ask) -> Decision:
    out = _out_dtype(ask.policy, ask.device_type, ask.call[0].dtype)
    return Plan(out, _guarded(ask), ask.policy, _has_master(ask), _is_plain(ask))


def _fp32_input(ask: Ask) -> bool:  # outside autocast such a mix keeps torch's own error
    return ask.call[0].dtype is _F32


def _mixed_dtypes(ask: Ask) -> bool:
    """Whether a tensor's dtype differs from the 16-bit input's: a mix torch's kernels reject outside
    autocast (half weight with FP32 stats, what ``model.half()`` leaves when the stats are kept FP32)."""
    call = ask.call
    dtype = call[0].dtype
    return any(t is not None and getattr(t, "dtype", None) is not dtype for t in call[1:5])


def _plan_mixed(ask: Ask) -> Decision:
    # A mix torch's kernels reject outside autocast gets FP32 arithmetic, the input's dtype out.
    return Plan(ask.call[0].dtype, _guarded(ask), "input", _has_master(ask))


def _half_update(ask: Ask) -> bool:
    return bool(ask.call[5]) and _has_16_bit_stats(ask.call[1], ask.call[2])


def _plan_half_update(ask: Ask) -> Decision:
    # torch's own output, and the batch's FP32 statistics for the master, or for the 16-bit stats
    # themselves (through FP32 copies, rounded into them).
    return Plan(ask.call[0].dtype, _guarded(ask), "input", _has_master(ask), torch_output=True)


def _plan_master_eval(ask: Ask) -> Decision:
    # Read only where float16 buffers overflowed that the master holds finite.
    return Deferred(Plan(ask.call[0].dtype, _guarded(ask), "input", True), _master.holds_more)


def _none(ask: Ask) -> Decision:
    return None


class Route(NamedTuple):
    name: str
    applies: Callable[[Ask], bool]
    decide: Callable[[Ask], Decision]


# The decision, first match wins; a call no route takes is torch's. Outside autocast the caller chose
# half precision, and the output is torch's own: a call torch computes as it is gets torch's kernel,
# and the running stats their FP32 update (a master's, or 16-bit stats' own, rounded).
ROUTES = (
    Route("strict export's recorded region", _recorded, _plan_recorded),
    Route("torch's own", _torchs, _none),
    Route("policy off", _off, _plan_off),
    Route("autocast", _autocast, _plan_autocast),
    Route("an FP32 input outside autocast", _fp32_input, _none),
    Route("mixed dtypes", _mixed_dtypes, _plan_mixed),
    Route("16-bit stats' update", _half_update, _plan_half_update),
    Route("a master's eval", _has_master, _plan_master_eval),
)


def considered(call: Tuple[Any, ...]) -> bool:
    """The test every call pays: whether ``call`` may be the shim's at all, by its dtypes
    (:func:`shim_dtypes`), or an FP32 input under a TorchFunctionMode (strict export records
    autocast regions without entering them)."""
    dtype = getattr(call[0], "dtype", None)  # read once: a subclass sees its reads
    if dtype is _F16 or dtype is _BF16:
        return True
    return dtype is _F32 and (_16_bit_beside(call) or function_mode_enabled())


def unseen_fp32(call: Tuple[Any, ...]) -> bool:
    """Whether ``call`` has an FP32 input that neither autocast nor a torch function override
    (a subclass, a mode) sees: the table leaves it to torch (its routes before "an FP32 input
    outside autocast" need autocast or a mode), and nothing brings it back to a door.

    Read with four C calls and two attributes, as every call an FP32 model makes outside
    autocast pays it: autocast off for every device type the one C call asks (all but MPS, MTIA
    and MAIA) and a CPU or CUDA input; no override and no TorchDispatchMode.
    """
    # Autocast first: the calls the shim computes leave at once. Then overrides (given every
    # argument: the three beyond the tensors are plain numbers, and slicing them off costs more),
    # before any attribute is read: a subclass sees its reads. Then TorchDispatchModes, which may
    # call F.batch_norm from inside torch's kernel: that call goes to torch, as from any door.
    if any_autocast_enabled() or _has_torch_function(*call) or _dispatch_modes():
        return False
    input = call[0]
    try:
        return input.dtype is _F32 and (input.is_cpu or input.is_cuda)
    except AttributeError:  # not a tensor: torch's error, where every other call goes
        return False


def plan(call: Tuple[Any, ...], guard: bool = True) -> Optional[Plan]:
    """The plan for ``call`` (``F.batch_norm``'s eight arguments), or ``None`` when torch computes it.

    ``guard`` False: the running stats are not the caller's to guard (InstanceNorm's per-sample
    copies, whose average the door guards). The table's answer is kept for untraced calls with a
    boolean ``training``; other calls walk it each time.
    """
    if not considered(call):
        return None
    input, mean, var, weight, bias, training = call[:6]
    config = _state.config
    found: Any = _MISSING
    if (training is True or training is False) and untraced(input, mean, var, weight, bias):
        kind = device_type(input)
        policy = _state.policy(kind)
        key = _key(call, guard, policy, kind, config.keep_fp32 == "master")
        if key is not None:
            owner, memo = _memo
            if owner is not config:
                memo = _new_memo(config)
            found = memo.get(key, _MISSING)
            if found is _MISSING:
                if len(memo) >= _MEMO_SIZE:  # calls of ever new shapes: start again rather than grow
                    memo.clear()
                found = memo[key] = decide(Ask(call, config, kind, policy, guard, True))
    if found is _MISSING:
        kind = device_type(input)
        found = decide(Ask(call, config, kind, _state.policy(kind), guard, False))
    if type(found) is Deferred:
        return found.plan if found.when(mean, var) else None
    return found


def decide(ask: Ask) -> Decision:
    """Walk :data:`ROUTES`: the first route that applies decides; a call none takes is torch's."""
    for route in ROUTES:
        if route.applies(ask):
            return route.decide(ask)
    return None


# ---- The memo: the table's answer by what the routes read ----

_MISSING = object()
_MEMO_SIZE = 4096
# The answers under one settings object (replaced whole when they change: ``_state``).
_memo: Tuple[Optional[Config], Dict[Tuple[Any, ...], Decision]] = (None, {})


def _new_memo(config: Config) -> Dict[Tuple[Any, ...], Decision]:
    """An empty memo for ``config``: answers made under other settings are not asked again."""
    global _memo
    memo: Dict[Tuple[Any, ...], Decision] = {}
    _memo = (config, memo)
    return memo


def _key(call: Tuple[Any, ...], guard: bool, policy: str, kind: str, masters: bool) -> Optional[Tuple[Any, ...]]:
    """Everything the routes read of an untraced call with a boolean ``training``, as one flat tuple,
    or None where a tensor is not one (a non-tensor argument: torch's error, decided each time).

    The routes read each tensor's type and dtype, the input's device (its type and index) and number
    of dimensions; autocast's state for the input's device and, under the ``autocast`` policy, its
    dtype; and for a training call (an update) the input's channels and the stats' devices,
    shapes, strides (contiguity, elements that share memory) and ``requires_grad``; and, where
    ``masters`` (the setting makes them) is false, whether 16-bit stats have a master all the
    same. The settings key the memo itself (:func:`_new_memo`).
    """
    input, mean, var, weight, bias, training = call[:6]
    autocast = autocast_enabled(kind)
    try:
        shape = input.shape  # read once: the number of dimensions, and the channels
        mean_dtype = None if mean is None else mean.dtype  # read once: the key, and whether a master may exist
        # The stats' layout, device and requires_grad matter to an update only. A CPU tensor's
        # device is read without making a device object (``Tensor.device`` makes one, which on the
        # common call costs more than the rest of the key), and strides only where the shape does
        # not say them (a contiguous tensor's).
        layout = None if not training else (
            shape[1] if len(shape) > 1 else None,
            None if mean is None else (mean.is_cpu or mean.device, mean.requires_grad, mean.shape,
                                       mean.is_contiguous() or mean.stride()),
            None if var is None else (var.is_cpu or var.device, var.requires_grad, var.shape,
                                      var.is_contiguous() or var.stride()))
        return (
            guard, policy, training, autocast, autocast and policy == "autocast" and autocast_dtype(kind),
            # A CPU tensor's device has no index (-1): asked only of other devices' tensors.
            type(input), input.dtype, kind, -1 if kind == "cpu" else input.get_device(), len(shape),
            type(weight), None if weight is None else weight.dtype,
            type(bias), None if bias is None else bias.dtype,
            type(mean), mean_dtype,
            type(var), None if var is None else var.dtype,
            layout,
            masters or (mean_dtype in LOW_PRECISION and var is not None and _master.has(mean, var)),
        )
    except AttributeError:
        return None

