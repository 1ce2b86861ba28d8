"""Every torch call whose spelling depends on the torch version lives here (torch >= 2.4)."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Optional, Tuple

import torch
import torch._guards
import torch._prims_common
import torch.autograd.forward_ad
import torch.utils.checkpoint
import wrapt
from torch.overrides import _get_current_function_mode_stack, has_torch_function_variadic
from torch.utils._device import DeviceContext

from . import _state

# Both take a device type since torch 2.4; older spellings (torch.is_autocast_cpu_enabled, ...)
# are deprecated and not supported.
_is_autocast_available = torch.amp.is_autocast_available
# torch.compiler.is_exporting exists from torch 2.6; strict export is also "compiling" before that.
is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_has_torch_function = has_torch_function_variadic
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_key_included = torch._C._dispatch_tls_is_dispatch_key_included
_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_functorch = torch._C._functorch
_batched, _legacy_batched = _functorch.is_batchedtensor, _functorch.is_legacy_batchedtensor
# Whether autocast is on for any of CPU, CUDA, XPU, HPU, XLA, IPU, PrivateUse1 (every device type
# with an autocast key but MPS, MTIA and MAIA; ``is_any_autocast_enabled`` in
# ``torch/csrc/autograd/init.cpp``, torch 2.4 to 2.15): one C call.
any_autocast_enabled = torch._C._is_any_autocast_enabled
# Whether any TorchFunctionMode is active (strict export's, torch.set_default_device's...): one C call.
function_mode_enabled = _function_mode_enabled
_DispatchKey = torch._C.DispatchKey
# torch.jit.trace is recording this call.
jit_tracing = torch._C._is_tracing
# torch.compiler.config.cache_key_tag (torch 2.6+) goes into inductor's and AOTAutograd's cache keys.
# Imported by name: torch 2.6 does not import the submodule with torch.
try:
    import torch.compiler.config as _compiler_config
except ImportError:  # torch < 2.6
    _compiler_config = None
_TAG_SEPARATOR = "|amp_bn_fix:"
# What torch.compiler.is_compiling() returns outside TorchScript: the module's flag, which export
# sets while it traces (with the exporting flag, from torch 2.6) and dynamo folds to True in the
# code it traces (torch 2.4 to 2.15). Read on every handled call: an attribute, not a call.
_compiler = torch.compiler
_modules = sys.modules
_thread = _state.thread
# ``Tensor.suggest_memory_format()``, which tensors do not expose to Python (torch 2.4 to 2.15):
# the layout torch's CPU batch norm gives the output of an input dense in no format.
suggest_memory_format = torch._prims_common.suggest_memory_format
# What non-reentrant checkpointing raises to stop a recompute once it has every tensor it needs
# (``torch/utils/checkpoint.py``, torch 2.1 and later): ops that ran before the stop stand.
RECOMPUTE_STOPPED = torch.utils.checkpoint._StopRecomputationError


# The package's modules dynamo may trace: the public functions, and the policy read they make,
# which dynamo calls itself and compiles in as a constant (``_state.policy``).
_TRACEABLE = ("__init__", "_state")


def keep_out_of_dynamo() -> None:
    """Have dynamo run the shim's computation as it is, never compile nor inline it, from when it
    is imported (now, if it is already).

    Dynamo compiles each Python frame it meets while compiled code runs eagerly (after a graph
    break in ``BatchNorm.forward``: ``momentum=None`` breaks on ``float(num_batches_tracked)``),
    and inlines the functions the code it traces calls. Compiled, the shim's frames would keep the
    policy (a ContextVar, read once) of the call that compiled them, for every later call, and
    recompile on each new tensor. Skipped, they run as in eager mode, under the policy in force.
    ``trace_rules.add`` is how torch (2.4 to 2.15 alike) lets a package keep its files out; the
    patched ``F.batch_norm`` itself goes into dynamo's graphs as torch's own function all the same.
    The public functions stay traceable: compiled code that asks ``get_policy()`` gets the policy
    it is compiled under, as its BatchNorms do (frames without tensors, such as the policy read's,
    dynamo does not compile).
    """
    package = sys.modules[__package__]

    def skip_computation(_dynamo: Any) -> None:
        trace_rules = importlib.import_module("torch._dynamo.trace_rules")
        for module in pkgutil.iter_modules(package.__path__):
            if module.name not in _TRACEABLE:
                trace_rules.add(f"{__package__}.{module.name}")

    wrapt.when_imported("torch._dynamo")(skip_computation)


def is_batched(t: torch.Tensor) -> bool:
    """Whether ``vmap`` batches ``t``: ``torch.func.vmap``'s tensors, and the legacy batched tensors
    autograd hands a backward for ``is_grads_batched`` (where no transform is active)."""
    return _batched(t) or _legacy_batched(t)


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``: ``torch.is_autocast_enabled``, read as it is under
    every ``torch.func`` transform too.

    Under ``vmap`` whether autocast casts an op depends on the op's batching rule and on what is
    batched (a batched Linear's output stays FP32; under ``jacfwd`` only the tangents are batched,
    and a convolution's primal is cast as outside it): the call's input dtype says which it did.
    False for device types autocast does not know. For CPU and CUDA the thread's flag itself, with
    no argument parsing: autocast is on exactly where its dispatch key is not excluded
    (``is_autocast_enabled`` in ``aten/src/ATen/autocast_mode.cpp``, torch 2.4 and later).
    """
    key = _ALWAYS_AVAILABLE_KEYS.get(device_type)
    if key is not None:
        return not _key_excluded(key)
    return _is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def device_type(t: torch.Tensor) -> str:
    """The device type of ``t``'s device (``cpu`` read without making a device object)."""
    return "cpu" if t.is_cpu else t.device.type


def autocast_dtype(device_type: str) -> torch.dtype:
    """The lower-precision dtype autocast currently uses on ``device_type``."""
    return torch.get_autocast_dtype(device_type)


def autocast_disabled(device_type: str) -> ContextManager[object]:
    """A context manager that turns autocast off for ``device_type``.

    A no-op for device types autocast does not support (``meta``): ``torch.autocast`` rejects them.
    """
    if _is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# The 16-bit floating dtypes autocast computes in, which the shim brings to FP32: the one tuple of them.
LOW_PRECISION = (torch.float16, torch.bfloat16)

# The autocast dispatch key of each device type that has one: the one table of them.
AUTOCAST_KEYS = {
    device_type: getattr(_DispatchKey, key)
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA"), ("xpu", "AutocastXPU"),
                             ("mps", "AutocastMPS"), ("hpu", "AutocastHPU"), ("privateuseone", "AutocastPrivateUse1"))
    if hasattr(_DispatchKey, key)
}
_key_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_key_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
# The device types autocast supports in every build, and their keys.
_ALWAYS_AVAILABLE_KEYS = {device_type: AUTOCAST_KEYS[device_type] for device_type in ("cpu", "cuda")}


def exclude_autocast(device_type: str, eager: bool) -> Any:
    """Turn autocast off for ``device_type`` until :func:`restore_autocast` is given what this returns.

    In plain ``eager`` mode ops skip autocast's dispatch key (two thread-local flag writes: a
    quarter of what a ``_ExcludeDispatchKeyGuard`` costs, a small part of
    ``torch.autocast(enabled=False)``'s Python set-up); the kernels registered there (the
    dispatcher door) are not entered either. Tracers and torch.compile get
    ``torch.autocast(enabled=False)``, which they record; the two differ only in what
    ``torch.is_autocast_enabled()`` reports inside.
    """
    if eager:
        key = AUTOCAST_KEYS.get(device_type)
        if key is not None:
            if _key_excluded(key):
                return None
            _set_key_excluded(key, True)
            return key
    context = autocast_disabled(device_type)
    context.__enter__()
    return context


def restore_autocast(excluded: Any) -> None:
    """Undo :func:`exclude_autocast`."""
    if excluded is None:
        return
    if type(excluded) is _DispatchKey:
        _set_key_excluded(excluded, False)
    else:
        excluded.__exit__(None, None, None)


# ``torch.backends.cudnn.enabled`` without the module property's Python (what ``F.batch_norm`` passes).
cudnn_enabled = torch._C._get_cudnn_enabled


def plain_eager(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call on ``tensors`` runs in plain eager mode, seen by nothing but autograd.

    True only for real tensors (``torch.Tensor`` or ``nn.Parameter``, no subclass, no FakeTensor,
    functional or proxy tensor) with no tracer or transform at all: not compiling or exporting, not
    ``torch.jit.trace``, no TorchDispatchMode (FakeTensorMode, make_fx's proxy mode included) or
    TorchFunctionMode active, no ``torch.func`` transform, no forward-mode AD level. Only then may
    amp_bn_fix compute a call in a form the tracers would not record faithfully (its fast paths, a
    running-stat write-back through ``.data``); everywhere else the reference computation runs.
    """
    for t in tensors:
        if t is not None and type(t) is not _Tensor and type(t) is not _Parameter:
            return False
    return untraced(*tensors)


def untraced(*tensors: Optional[torch.Tensor]) -> bool:
    """:func:`plain_eager` for tensors whose types are known to be exact: no tracer, mode or transform."""
    # Each check is one C call on a module-level name: this runs on every handled call. The
    # tensors' types are exact, so a torch function override can only come from a mode.
    return not (
        (_has_torch_function(*tensors) and not _only_default_device_modes())
        # Counts the infra modes (fake, proxy, functional); ``amp_bn_fix.testing``'s counters record nothing.
        or ((modes := _dispatch_stack_len()) and modes > _thread.counters)
        # Pre-dispatch tracing (torch.export) keeps its modes apart and includes this key.
        or _key_included(_PRE_DISPATCH)
        or _functorch_active()
        or _forward_ad._current_level >= 0
        or jit_tracing()
        # torch.compiler.is_compiling(), read as it reads it (strict export sets it too).
        or _compiler._is_compiling_flag
    )


def dynamo_imported() -> bool:
    """Whether torch.compile or strict export can be tracing at all (neither runs before dynamo is imported).

    Their checks are Python functions: skipping them spares plain eager code a microsecond a call.
    """
    return "torch._dynamo" in _modules


def _only_default_device_modes() -> bool:
    """Whether every active TorchFunctionMode only fills in a default device.

    ``torch.set_default_device`` and ``with torch.device(...):`` push such a mode: it changes where
    factory functions allocate, and records nothing, so code under it is still plain eager.
    """
    return all(type(mode) is DeviceContext for mode in _get_current_function_mode_stack())


def is_compiling() -> bool:
    """Whether torch.compile is tracing this call, in dynamo or in the backend that compiles its graph.

    False at once while dynamo is not imported (:func:`dynamo_imported`).

    Up to torch 2.6 at least, dynamo puts the patched ``F.batch_norm`` into its graph as torch's own
    function (the wrapper compares equal to it): the wrapper first runs when AOTAutograd traces that
    graph, where ``torch.compiler.is_compiling()`` (its flag, read as :func:`untraced` reads it) is
    False but a tracing context is set. It traces
    under its dispatch modes (fake, functional, proxy), so the context, a microsecond or two to read,
    is asked only under a mode: once an optimizer has imported dynamo, every call the shim passes
    to torch asks this.
    """
    if not dynamo_imported():
        return False
    return _compiler._is_compiling_flag or (
        _dispatch_stack_len() > 0 and torch._guards.TracingContext.try_get() is not None)


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether several elements of ``t`` share memory (an expanded, stride-0 tensor).

    Read from the strides, as ``torch._debug_has_internal_overlap(t) == 1`` decides it: that op has
    no ``vmap`` batching rule (``torch.func`` ensembles would fail) and tracers record it as a node.
    """
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def recorded_autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype of the autocast region a tracer records for ``device_type`` without entering it, if any.

    Strict ``torch.export`` records ``torch.autocast`` blocks inside ``forward`` as graph nodes
    (its pre-dispatch TorchFunctionMode keeps the open ones in ``enter_autocast_nodes``): while it
    traces them autocast is off and inputs are not cast, and the recorded region casts them when
    the program runs. Only the innermost open block for the device type counts: an
    ``autocast(enabled=False)`` island inside an autocast region is an FP32 region. (Non-strict
    export enters the blocks as well as recording them: autocast is then on where they are.)
    """
    if not _function_mode_enabled() or autocast_enabled(device_type):
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        # _enter_autocast(device_type, dtype, enabled, cache_enabled), innermost last
        nodes = [n for n in getattr(mode, "enter_autocast_nodes", ()) if n.args[:1] == (device_type,)]
        if nodes:
            args = nodes[-1].args
            if len(args) >= 3 and not args[2]:
                return None
            dtype = args[1] if len(args) >= 2 else None
            return dtype if isinstance(dtype, torch.dtype) else autocast_dtype(device_type)
    return None


def set_compile_cache_tag(settings: Optional[str]) -> None:
    """Make ``settings`` part of torch.compile's cache keys (``None`` removes them).

    Appended to the tag the user set (``TORCH_COMPILE_CACHE_KEY_TAG``, or in code), which stays
    as it was. A no-op on torch versions without the tag (before 2.6).
    """
    if not hasattr(_compiler_config, "cache_key_tag"):
        return
    current = _compiler_config.cache_key_tag
    tag = current.split(_TAG_SEPARATOR, 1)[0]
    if settings is not None:
        tag += _TAG_SEPARATOR + settings
    if tag != current:
        _compiler_config.cache_key_tag = tag


_aten = torch.ops.aten
_to_copy = _aten._to_copy.default


def to_copy(t: torch.Tensor, dtype: torch.dtype, eager: bool = False) -> torch.Tensor:
    """``t`` as a new tensor of ``dtype``, differentiable and recorded by every tracer.

    Traced, a copy op, unlike ``t.float()``: torch.export pins the input dtype of ``.to`` calls,
    which would stop an exported program from running without autocast; under torch.jit.trace it
    is ``.to``, the cast TorchScript's ONNX exporter knows. In plain ``eager`` mode the method
    named for the dtype (``t.float()``), whose argument parsing costs a fraction of ``t.to(dtype)``'s
    (a microsecond and more), and which copies as ``_to_copy`` does when the dtype changes.
    """
    if eager:
        convert = _CONVERSIONS.get(dtype) if t.dtype is not dtype else None
        return convert(t) if convert is not None else t.to(dtype, copy=True)
    if jit_tracing():
        return t.to(dtype, copy=True)
    return _to_copy(t, dtype=dtype)


_CONVERSIONS = {torch.float32: _Tensor.float, torch.float16: _Tensor.half, torch.bfloat16: _Tensor.bfloat16}


def add_gradient_hook(tensor: torch.Tensor, hook: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
    """``tensor.register_hook(hook)`` for a non-leaf ``tensor`` with no hook yet, without the
    removable handle, whose making is two thirds of its cost: the two steps of
    ``Tensor.register_hook`` (``torch/_tensor.py``, torch 2.4 to 2.15), the hook dict set and
    registered with the tensor's backward node. Hooks registered later join that dict, as there."""
    tensor._backward_hooks = OrderedDict(((_HOOK_KEY, hook),))
    tensor.grad_fn._register_hook_dict(tensor)


# The hook's key in the dict: no handle takes it (theirs are integers).
_HOOK_KEY = "amp_bn_fix"


def foreach_copy(targets: Tuple[torch.Tensor, ...], sources: Tuple[torch.Tensor, ...]) -> None:
    """``target.copy_(source)`` for each pair: one op where torch has the fused form."""
    if _foreach_copy is not None:
        _foreach_copy(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


# The dispatcher door (``_dispatch``): registering Python kernels at autocast's keys.
def has_dispatch_kernel(op: str, key: str) -> bool:
    """Whether ``op`` (``"aten::batch_norm"``) has a kernel of its own at dispatch key ``key``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
