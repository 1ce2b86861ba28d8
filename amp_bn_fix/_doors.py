"""The doors: every way a batch norm reaches the shim, each one template.

A door only maps its arguments to ``F.batch_norm``'s eight (ATen's order in :func:`_swap_pairs`);
:func:`_enter` does the rest, once for all: the one plan (``_plan.plan``), this thread's flag, torch's
own call or the one compute (``_compute.run``), and the count (``_record``).

* :func:`batch_norm`: the wrapper of ``torch.nn.functional.batch_norm``, and the core of the
  dispatcher kernel for ``aten::batch_norm`` (:func:`batch_norm_kernel`), which sees every other
  way to the op under autocast (``torch.batch_norm``, TorchScript, ``torch.jit.trace``, the
  tracers under ``torch.compile``).
* :func:`instance_norm_kernel`: ``aten::instance_norm`` under autocast, one batch norm over the
  samples' channels.
* :func:`batch_norm_impl_index_kernel`: ``aten::_batch_norm_impl_index`` under autocast, where
  TorchScript's autodiff sends a BatchNorm, and :func:`batch_norm_impl_index_backward`, the
  backward it calls.
* :func:`sync_batch_norm`: the wrapper of ``SyncBatchNorm.apply``, nn.SyncBatchNorm's syncing path.

While a door runs a call it has decided, computed or passed to torch, this thread's flag
(``_state.thread.inside``) is set: a tensor subclass or TorchFunctionMode that calls
``F.batch_norm`` again, and the op ``F.batch_norm`` reaches (the dispatcher kernel), go straight
to torch, so a call is decided and counted once.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.overrides import has_torch_function_variadic

from . import _compute, _guard, _record, _state, _tuning
from ._compat import (LOW_PRECISION, device_type, exclude_autocast, foreach_copy, is_compiling, is_exporting,
                      restore_autocast, untraced)
from ._compute import Original
from ._plan import Plan, bind, considered, plan, shim_dtypes, unseen_fp32

_thread = _state.thread
_passed = _record.passed
_past_checks = _compute.past_checks
_modules = sys.modules
_has_torch_function = has_torch_function_variadic
# Below the dispatcher kernels, ops run as ``torch.batch_norm``'s binding (a few microseconds less
# than the op looked up in ``torch.ops``) unless a tensor or an active mode overrides torch
# functions: that layer saw the call before it reached the dispatcher, and must not see it twice.
_aten_batch_norm = torch.ops.aten.batch_norm.default
_aten_instance_norm = torch.ops.aten.instance_norm.default
_torch_batch_norm = torch.batch_norm
_torch_instance_norm = torch.instance_norm
_aten_impl_index = torch.ops.aten._batch_norm_impl_index.default
_torch_impl_index = torch._batch_norm_impl_index
_aten_impl_index_backward = torch.ops.aten._batch_norm_impl_index_backward.default


def _enter(call: Optional[Tuple[Any, ...]], decided: Optional[Plan], original: Original, torch_own: Callable[..., Any],
           args: Tuple[Any, ...], kwargs: Dict[str, Any], *, native: bool) -> Any:
    """Every door's steps after its plan: this thread's flag, then ``torch_own(*args, **kwargs)``
    (``decided`` None: the call as the door received it) or the compute with ``original`` (see
    ``_compute.run``), then the count."""
    if ((decided is None or not decided.plain) and "torch._dynamo" in _modules and is_compiling()
            and not is_exporting() and call is not None and considered(call)):
        # The policy torch.compile compiles the call under (strict export traces with dynamo too,
        # but keeps no compiled code a scope could miss); a plain plan's call is not traced.
        _state.compiled_policies.add(_state.policy(device_type(call[0])))
    _thread.inside = True
    try:
        if decided is None:
            _passed()
            return torch_own(*args, **kwargs)
        out = _compute.run(original, call, decided, native=native)
    finally:
        _thread.inside = False
    _record.handled(decided.counted_as)  # once computed: a call that raises was not handled
    return out


def _swap_pairs(args: Sequence[Any]) -> Tuple[Any, ...]:
    """ATen's order (input, weight, bias, running_mean, running_var, ...) to ``F.batch_norm``'s
    (input, running_mean, running_var, weight, bias, ...), and back: the pairs trade places."""
    return (args[0], args[3], args[4], args[1], args[2], *args[5:])


def batch_norm(wrapped: Callable[..., torch.Tensor], instance: Any, args: tuple, kwargs: dict,
               native: bool = True) -> torch.Tensor:
    """The wrapper of ``F.batch_norm`` (wrapt's signature): ``wrapped`` is torch's computation.

    ``native`` False: ``wrapped`` must see the call the shim computes (see ``_compute.run``).
    """
    if _thread.inside or not _state.active:  # decided already, or a reference kept after disable()
        return wrapped(*args, **kwargs)
    if len(args) == 8 and not kwargs:  # the call BatchNorm modules make: no binding needed
        call = args
    else:
        try:
            call = bind(*args, **kwargs)
        except TypeError:  # malformed: torch's own error
            call = (None,) * 8
    if unseen_fp32(call):
        # torch's, and nothing brings it back to a door: no flag to set. The call an FP32 model
        # makes outside autocast, which every FP32 program pays where the shim is on. A function
        # other than torch's own (a library's wrapper under ours) gets the call as it came.
        _passed()
        own = _past_checks(wrapped, call)
        return own(*call) if own is not wrapped else wrapped(*args, **kwargs)
    return _enter(call, plan(call), wrapped, wrapped, args, kwargs, native=native)


def _below_autocast(device_type: str, op: Any, torch_function: Any, args: tuple) -> torch.Tensor:
    """The op with ``device_type``'s autocast key excluded: torch's computation below the dispatcher door."""
    excluded = exclude_autocast(device_type, eager=True)
    try:
        if _has_torch_function(*args[:5]):
            return op(*args)
        return torch_function(*args)
    finally:
        restore_autocast(excluded)


def _batch_norm_below_autocast(device_type: str, cudnn_enabled: bool, *call: Any) -> torch.Tensor:
    """``aten::batch_norm`` below the door, given ``F.batch_norm``'s eight arguments by position (as
    the compute calls it)."""
    return _below_autocast(device_type, _aten_batch_norm, _torch_batch_norm, (*_swap_pairs(call), cudnn_enabled))


def batch_norm_kernel(device_type: str) -> Callable[..., torch.Tensor]:
    """The dispatcher kernel of ``aten::batch_norm`` at ``device_type``'s autocast key."""

    def batch_norm_at_autocast(*args: Any) -> torch.Tensor:
        below = functools.partial(_batch_norm_below_autocast, device_type, args[8])
        return batch_norm(below, None, _swap_pairs(args[:8]), {})

    return batch_norm_at_autocast


def batch_norm_impl_index_kernel(device_type: str) -> Callable[..., Tuple[Any, ...]]:
    """The dispatcher kernel of ``aten::_batch_norm_impl_index`` at ``device_type``'s autocast key.

    TorchScript's autodiff calls this op instead of ``aten::batch_norm`` where it differentiates a
    scripted block itself, and hands its five results to its backward,
    ``aten::_batch_norm_impl_index_backward``: the output (here the policy's), and the saved
    statistics, workspace and kernel index of the call the shim computes, which
    :func:`batch_norm_impl_index_backward` differentiates.
    """

    def impl_index_at_autocast(*args: Any) -> Tuple[Any, ...]:
        saved: List[Any] = []

        def below(*call: Any) -> torch.Tensor:
            out, *saved[:] = _below_autocast(device_type, _aten_impl_index, _torch_impl_index,
                                             (*_swap_pairs(call), args[8]))
            return out

        out = batch_norm(below, None, _swap_pairs(args[:8]), {}, native=False)  # one call of ``below``
        return (out, *saved)

    return impl_index_at_autocast


def batch_norm_impl_index_backward(impl_index: int, input: torch.Tensor, grad_output: torch.Tensor,
                                   weight: Optional[torch.Tensor], running_mean: Optional[torch.Tensor],
                                   running_var: Optional[torch.Tensor], save_mean: Optional[torch.Tensor],
                                   save_var_transform: Optional[torch.Tensor], train: bool, eps: float,
                                   output_mask: List[bool], reserved: torch.Tensor) -> Tuple[Any, ...]:
    """The kernel of ``aten::_batch_norm_impl_index_backward`` at the autograd keys (TorchScript's backward).

    The calls whose forward the shim computed in FP32 (:func:`batch_norm_impl_index_kernel`) that
    torch's kernels reject: a 16-bit input whose gradient comes in another dtype (the policy's
    output dtype), or on CPU FP32 saved statistics next to 16-bit weight or stats (a half model
    under the ``input`` policy). Their backward is that FP32 computation's, and autograd rounds
    each gradient to its tensor's dtype. Every other call is torch's own composite kernel, as it was.
    """
    if input.dtype in LOW_PRECISION and (
            grad_output.dtype is not input.dtype
            or (input.is_cpu and save_mean is not None and save_mean.dtype is torch.float32
                and any(t is not None and t.dtype in LOW_PRECISION for t in (weight, running_mean, running_var)))):
        input, grad_output, weight, running_mean, running_var = (
            _compute.to_fp32(t) for t in (input, grad_output, weight, running_mean, running_var))
    return _aten_impl_index_backward.decompose(impl_index, input, grad_output, weight, running_mean, running_var,
                                               save_mean, save_var_transform, train, eps, output_mask, reserved)


def _repeat(t: Optional[torch.Tensor], times: int) -> Optional[torch.Tensor]:
    return None if t is None else t.repeat(times)


def instance_norm_kernel(device_type: str) -> Callable[..., torch.Tensor]:
    """The dispatcher kernel of ``aten::instance_norm`` at ``device_type``'s autocast key.

    Like ATen: sample ``i``'s channels become channels of one batch norm over ``(1, N*C, ...)``,
    with ``N`` copies of weight, bias and running stats, and in training the module's stats become
    the mean of their updated copies. Unlike ATen (torch 2.13, without affine weights), which
    casts the copies to the input's dtype, so that FP32 stats are updated in 16 bits, the copies
    are FP32: the compute updates them in FP32, their average is taken in FP32 (rounded once into
    16-bit stats), and the guard judges it on the module's stats (one record per module, named by
    ``report(model)``). A call left to torch is torch's own.
    """

    def instance_norm_at_autocast(*args: Any) -> torch.Tensor:
        input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled = args
        if _thread.inside:
            return _below_autocast(device_type, _aten_instance_norm, _torch_instance_norm, args)
        decided = call = None
        # The calls a batch norm's would be the shim's (a 16-bit input, or an FP32 one next to 16-bit
        # tensors: a half model's InstanceNorm after its BatchNorm's FP32 output) with a batch
        # dimension, and both stats or neither (both in eval): a malformed call gets torch's own error.
        if (shim_dtypes((input, running_mean, running_var, weight, bias)) and input.dim() >= 2
                and (running_mean is None) is (running_var is None)
                and (use_input_stats or running_mean is not None)):
            n, c = input.shape[0], input.shape[1]
            mean_copies, var_copies = (_repeat(_compute.to_fp32(stat), n) for stat in (running_mean, running_var))
            x = input.contiguous().view((1, n * c) + tuple(input.shape[2:]))
            call = (x, mean_copies, var_copies, _repeat(weight, n), _repeat(bias, n), use_input_stats, momentum, eps)
            decided = plan(call, guard=False)  # the copies are not the module's stats: their average is guarded
        below = functools.partial(_batch_norm_below_autocast, device_type, cudnn_enabled)
        out = _enter(call, decided, below, _below_autocast,  # type: ignore[arg-type]
                     (device_type, _aten_instance_norm, _torch_instance_norm, args), {}, native=True)
        if decided is None:
            return out
        if use_input_stats:
            _average_copies(running_mean, running_var, mean_copies, var_copies, n, c)
        return out.view(input.shape)

    return instance_norm_at_autocast


def _average_copies(running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    mean_copies: Optional[torch.Tensor], var_copies: Optional[torch.Tensor], n: int, c: int) -> None:
    """ATen's update of InstanceNorm's stats, each the mean of its ``n`` updated copies, guarded."""
    if running_mean is None or running_var is None:  # no stats (the door takes both or neither)
        return
    eager = untraced(running_mean, running_var)
    # Traced too (torch.compile, jit.trace): the guard's copies path is what tracers record.
    guard = _state.config.guard and running_mean.shape == running_var.shape
    host = _tuning.host_route(running_mean)
    mean, var, token = _guard.begin(running_mean, running_var, guard=guard, eager=eager, host=host)
    foreach_copy((mean, var), (mean_copies.view(n, c).mean(0), var_copies.view(n, c).mean(0)))  # type: ignore[union-attr]
    _guard.finish(running_mean, running_var, mean, var, token, eager, running_mean)


def _bind_sync(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], eps: float, momentum: float,
               process_group: Any, world_size: int) -> Tuple[Tuple[Any, ...], Any, int]:
    """``SyncBatchNorm.apply``'s arguments: the call in ``F.batch_norm``'s order (the syncing path
    always trains), and the group it syncs over."""
    return (input, running_mean, running_var, weight, bias, True, momentum, eps), process_group, world_size


def sync_batch_norm(wrapped: Callable[..., torch.Tensor], instance: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The wrapper of ``SyncBatchNorm.apply`` (more than one rank), under the same plan as ``F.batch_norm``.

    The statistics gathered across ranks and the normalization are FP32 (input, weight, bias and
    running stats, or their master, handed over as FP32); the output dtype follows the policy.
    """
    if _thread.inside or not _state.active:
        return wrapped(*args, **kwargs)
    try:
        as_batch_norm, group, world_size = _bind_sync(*args, **kwargs)
    except TypeError:  # malformed: torch's own error
        as_batch_norm, group, world_size = (None,) * 8, None, 0
    decided = plan(as_batch_norm)
    if decided is not None and decided.torch_output:
        # Outside autocast a half model's syncing call is torch's own: its output is torch's, and a
        # second pass for the master's FP32 update would gather across the ranks again. Its 16-bit
        # update reaches the master by value at the next call the shim computes.
        decided = None
    if decided is not None and decided.recorded:
        raise RuntimeError(
            "amp_bn_fix: strict torch.export records the torch.autocast block inside forward() without "
            f"running it, and SyncBatchNorm's syncing path cannot carry the BatchNorm policy {decided.counted_as!r} "
            "into the recorded block. Export with strict=False, enter torch.autocast around the export "
            "call instead, or export with amp_bn_fix.policy('off')."
        )

    def syncing(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], training: bool, momentum: float,
                eps: float) -> torch.Tensor:
        return wrapped(input, weight, bias, running_mean, running_var, eps, momentum, group, world_size)

    return _enter(as_batch_norm, decided, syncing, wrapped, args, kwargs, native=False)
