"""The dispatcher door: kernels for ``aten::batch_norm`` and ``aten::instance_norm`` at autocast's keys.

The ``F.batch_norm`` wrapper (``_patch``) sees Python calls of that one function. Every other way
to a batch norm reaches ATen's ``batch_norm`` op: ``torch.batch_norm``, ``torch.ops.aten.batch_norm``,
``instance_norm`` (a batch norm over a reshaped input), TorchScript at run time, ``torch.jit.trace``
and the tracers under ``torch.compile``. Under autocast the dispatcher calls the kernel at the device
type's autocast key before autograd and the device's kernel, and torch has only a fallthrough there,
so Python kernels registered at AutocastCPU/CUDA/XPU see all of those calls. They decide and compute
nothing themselves: each 16-bit call goes to the wrapper's function (``_patch._batch_norm_wrapper``),
given a ``wrapped`` that runs the op with the autocast key excluded. One core, two front doors; a
call is decided once.

Outside autocast the key is excluded, so the kernels are not called at all: calls outside autocast
reach the shim only through ``F.batch_norm`` (a half model's mixed calls included).
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import warnings
from typing import Any, Callable, List, Optional, Set, Tuple

import torch
import torch.nn.functional
from torch.overrides import has_torch_function_variadic

from . import _compat, _patch, _record, _stats, _tuning

_F16 = torch.float16
_BF16 = torch.bfloat16
# Below the kernel, ops run as ``torch.batch_norm``'s binding (a few microseconds less than the op
# looked up in ``torch.ops``) unless a tensor or an active mode overrides torch functions: that
# layer saw the call before it reached the dispatcher, and must not see it twice.
_aten_batch_norm = torch.ops.aten.batch_norm.default
_aten_instance_norm = torch.ops.aten.instance_norm.default
_torch_batch_norm = torch.batch_norm
_torch_instance_norm = torch.instance_norm
_has_torch_function = has_torch_function_variadic
_exclude = _compat.exclude_dispatch_keys
_getframe = sys._getframe
_counts = _record.counts
# ``torch.nn.functional.batch_norm``'s own code (a wrapt wrapper forwards ``__code__`` to it).
_F_BATCH_NORM_CODE = torch.nn.functional.batch_norm.__code__

# Where torch has only autocast's fallthrough for ``batch_norm``. Not AutocastMPS: torch's own
# kernel there already computes batch_norm in FP32, and a key with any kernel is left alone.
KEYS = ("AutocastCPU", "AutocastCUDA", "AutocastXPU")
_OPS = ("batch_norm", "instance_norm")
# Marks our Library, so that a later incarnation of this module (imported afresh) can remove it.
_MARK = "_amp_bn_fix_dispatch"

_lock = threading.Lock()
# The registration, kept across ``importlib.reload`` of this module (the module's namespace is
# reused): a Library that is garbage-collected removes its kernels without a word.
_library: Optional[torch.library.Library] = globals().get("_library")
_keys: Tuple[str, ...] = globals().get("_keys", ())
_warned_keys: Set[Tuple[str, str]] = globals().get("_warned_keys", set())


def is_registered() -> bool:
    return _library is not None


def registered_keys() -> Tuple[str, ...]:
    """The dispatch keys our kernels are registered at (empty when unregistered)."""
    return _keys


def describe() -> str:
    """The registration, for the compile cache key: the device types it covers (``cpu+cuda+xpu``) or ``none``."""
    return "+".join(key[len("Autocast"):].lower() for key in _keys) or "none"


def register() -> bool:
    """Register the kernels at every key of ``KEYS`` that torch leaves to autocast's fallthrough.

    Returns False when they were registered already (or no key was free). A registration left by an
    earlier import of this module is removed first, so there is never more than one.
    """
    global _library, _keys
    with _lock:
        if _library is not None:
            return False
        _remove_stale()
        plan: List[Tuple[str, str, Any]] = []
        for key in KEYS:
            keyset = _compat.dispatch_key_set(key)
            if keyset is None or not _free("batch_norm", key):
                continue
            plan.append(("batch_norm", key, _batch_norm_kernel(keyset)))
            if _free("instance_norm", key):
                plan.append(("instance_norm", key, _instance_norm_kernel(keyset)))
        if not plan:
            return False
        library = torch.library.Library("aten", "IMPL")
        setattr(library, _MARK, True)
        try:
            for op, key, kernel in plan:
                library.impl(op, kernel, key)
        except BaseException:
            library._destroy()
            raise
        _library = library
        _keys = tuple(dict.fromkeys(key for _, key, _ in plan))
        return True


def unregister() -> bool:
    """Remove the kernels; False when none were registered."""
    global _library, _keys
    with _lock:
        library, _library, _keys = _library, None, ()
        if library is None:
            return False
        library._destroy()
        return True


def _free(op: str, key: str) -> bool:
    """Whether ``op`` has no kernel at ``key`` (a fallthrough), warning once about another library's."""
    if not _compat.has_dispatch_kernel(f"aten::{op}", key):
        return True
    if (op, key) not in _warned_keys:
        _warned_keys.add((op, key))
        warnings.warn(
            f"amp_bn_fix: another library has a kernel for aten::{op} at the {key} dispatch key; "
            f"amp_bn_fix leaves it in place, so only torch.nn.functional.batch_norm calls get its policy "
            "there.",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


def _remove_stale() -> None:
    """Destroy the registration an earlier import of this module left (searched only if a kernel is in place)."""
    if not any(_compat.has_dispatch_kernel(f"aten::{op}", key) for op in _OPS for key in KEYS
               if _compat.dispatch_key_set(key) is not None):
        return
    for obj in gc.get_objects():
        if (type(obj) is torch.library.Library and getattr(obj, _MARK, False) and obj is not _library
                and obj.m is not None):
            obj._destroy()


def _plain_batch_norm(keyset: Any, cudnn_enabled: bool, input: torch.Tensor, running_mean: Optional[torch.Tensor],
                      running_var: Optional[torch.Tensor], weight: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None, training: bool = False, momentum: float = 0.1,
                      eps: float = 1e-5) -> torch.Tensor:
    """``aten::batch_norm`` below autocast's key, with ``F.batch_norm``'s signature (the wrapper's ``wrapped``)."""
    args = (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    with _exclude(keyset):
        if _has_torch_function(input, weight, bias, running_mean, running_var):
            return _aten_batch_norm(*args)
        return _torch_batch_norm(*args)


def _passed_by_wrapper(frame: Any) -> bool:
    """Whether the op was called by ``F.batch_norm`` run by the wrapper: a call it has decided.

    The wrapper runs ``F.batch_norm`` itself for a call it leaves to torch, and that body calls the
    op: two frame reads instead of a second decision (and a second count in ``report()``). A name
    bound to the original function before the patch is not the wrapper's frame, so such a call is
    decided here.
    """
    if frame.f_code is not _F_BATCH_NORM_CODE:
        return False
    caller = frame.f_back
    return caller is not None and caller.f_code is getattr(_patch._batch_norm_wrapper, "__code__", None)


def _batch_norm_kernel(keyset: Any) -> Callable[..., torch.Tensor]:
    def batch_norm(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], training: bool,
                   momentum: float, eps: float, cudnn_enabled: bool) -> torch.Tensor:
        # Calls from inside a handled call, or passed through by the wrapper, were decided already.
        if not _patch._thread.inside and not _passed_by_wrapper(_getframe(1)):
            dtype = input.dtype
            if dtype is _F16 or dtype is _BF16:
                wrapped = functools.partial(_plain_batch_norm, keyset, cudnn_enabled)
                args = (input, running_mean, running_var, weight, bias, training, momentum, eps)
                return _patch._batch_norm_wrapper(wrapped, None, args, {})
            _counts.passed += 1  # as the wrapper counts the calls it leaves to torch
        with _exclude(keyset):
            if _has_torch_function(input, weight, bias, running_mean, running_var):
                return _aten_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                        cudnn_enabled)
            return _torch_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                     cudnn_enabled)

    return batch_norm


def _instance_norm_kernel(keyset: Any) -> Callable[..., torch.Tensor]:
    def instance_norm(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                      running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                      use_input_stats: bool, momentum: float, eps: float, cudnn_enabled: bool) -> torch.Tensor:
        args = (input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled)
        if not _patch._thread.inside:
            dtype = input.dtype
            # A malformed call (no batch dimension, eval without stats) gets torch's own error.
            if ((dtype is _F16 or dtype is _BF16) and input.dim() >= 2
                    and (use_input_stats or (running_mean is not None and running_var is not None))):
                return _instance_norm(keyset, args)
            _counts.passed += 1
        return _plain_instance_norm(keyset, args)

    return instance_norm


def _plain_instance_norm(keyset: Any, args: Tuple[Any, ...]) -> torch.Tensor:
    """``aten::instance_norm`` below autocast's key: torch's own computation."""
    with _exclude(keyset):
        if _has_torch_function(*args[:5]):
            return _aten_instance_norm(*args)
        return _torch_instance_norm(*args)


def _repeat(t: Optional[torch.Tensor], times: Any) -> Optional[torch.Tensor]:
    return None if t is None else t.repeat(times)


def _instance_norm(keyset: Any, args: Tuple[Any, ...]) -> torch.Tensor:
    """ATen's ``instance_norm`` as one batch-norm call through the wrapper, its running stats kept in their dtype.

    Like ATen: sample ``i``'s channels become channels of a batch norm over ``(1, N*C, ...)``, with
    ``N`` copies of weight, bias and running stats, and in training the stats become the mean of
    their updated copies. Unlike ATen (torch 2.13), which casts the copies to the input's dtype, so
    that FP32 stats are updated in 16 bits, the copies keep the stats' dtype: the wrapper updates
    them in FP32 and guards them. A call the wrapper leaves to torch runs torch's own ``instance_norm``.
    """
    input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled = args
    n, c = input.shape[0], input.shape[1]
    mean_copies, var_copies = _repeat(running_mean, n), _repeat(running_var, n)
    passed: List[bool] = []

    def wrapped(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, training: bool = False,
                momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
        if not _patch._thread.inside:  # left to torch: exactly what torch computes without the shim
            passed.append(True)
            return _plain_instance_norm(keyset, args)
        return _plain_batch_norm(keyset, cudnn_enabled, input, running_mean, running_var, weight, bias, training,
                                 momentum, eps)

    x = input.contiguous().view((1, n * c) + tuple(input.shape[2:]))
    call = (x, mean_copies, var_copies, _repeat(weight, n), _repeat(bias, n), use_input_stats, momentum, eps)
    thread = _patch._thread
    was_unguarded, thread.unguarded = thread.unguarded, True  # the copies are not the module's stats
    try:
        out = _patch._batch_norm_wrapper(wrapped, None, call, {})
    finally:
        thread.unguarded = was_unguarded
    if not passed and use_input_stats:
        with torch.no_grad():
            _average_copies(running_mean, running_var, mean_copies, var_copies, n, c)
    return out.view(input.shape)


def _average_copies(running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    mean_copies: Optional[torch.Tensor], var_copies: Optional[torch.Tensor], n: int, c: int) -> None:
    """ATen's update of InstanceNorm's stats: each becomes the mean of its ``n`` updated copies.

    With the guard, judged on the module's stats themselves (one record per module, as for
    BatchNorm): an average that is not finite leaves them bit for bit.
    """
    if not (_patch._config.guard and running_mean is not None and running_var is not None
            and running_mean.dtype is running_var.dtype and running_mean.shape == running_var.shape
            and running_mean.numel() > 0 and _compat.untraced(running_mean, running_var)):
        for stat, copies in ((running_mean, mean_copies), (running_var, var_copies)):
            if stat is not None and copies is not None:
                stat.copy_(copies.view(n, c).mean(0))
        return
    new_mean, new_var = mean_copies.view(n, c).mean(0), var_copies.view(n, c).mean(0)  # type: ignore[union-attr]
    if running_mean.is_cpu and not _tuning.emulate_device and _stats.stackable(running_mean, running_var):
        before = _stats.snapshot_on_host(running_mean, running_var)
        _compat.foreach_copy((running_mean, running_var), (new_mean, new_var))
        _stats.settle_on_host(running_mean, running_var, before)
    else:  # decided on the device, as for BatchNorm there (and for 16-bit stats anywhere)
        work = torch.stack((new_mean, new_var))
        _stats.settle_on_device(running_mean, running_var, work)
