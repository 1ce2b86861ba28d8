"""Every torch call whose spelling depends on the torch version lives here (torch >= 2.4)."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
import torch._guards
import torch.autograd.forward_ad
from torch.overrides import _get_current_function_mode_stack, has_torch_function_variadic
from torch.utils._device import DeviceContext

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
# torch.jit.trace is recording this call.
jit_tracing = torch._C._is_tracing
# True only in code dynamo is tracing (not while it runs a traced call on fake tensors).
is_dynamo_tracing = torch.compiler.is_dynamo_compiling
# torch.compiler.config.cache_key_tag (torch 2.6+) goes into inductor's and AOTAutograd's cache keys.
# Imported by name: torch 2.6 does not import the submodule with torch.
try:
    import torch.compiler.config as _compiler_config
except ImportError:  # torch < 2.6
    _compiler_config = None
_TAG_SEPARATOR = "|amp_bn_fix:"


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for types autocast does not know)."""
    return _is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


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
    # Each check is one C call on a module-level name: this runs on every handled call. The
    # tensors' types are exact, so a torch function override can only come from a mode.
    return not (
        (_has_torch_function(*tensors) and not _only_default_device_modes())
        or _dispatch_stack_len()  # counts the infra modes (fake, proxy, functional)
        # Pre-dispatch tracing (torch.export) keeps its modes apart and includes this key.
        or _key_included(_PRE_DISPATCH)
        or _functorch_active()
        or _forward_ad._current_level >= 0
        or jit_tracing()
        or torch.compiler.is_compiling()
        or is_exporting()
    )


def _only_default_device_modes() -> bool:
    """Whether every active TorchFunctionMode only fills in a default device.

    ``torch.set_default_device`` and ``with torch.device(...):`` push such a mode: it changes where
    factory functions allocate, and records nothing, so code under it is still plain eager.
    """
    return all(type(mode) is DeviceContext for mode in _get_current_function_mode_stack())


def is_compiling() -> bool:
    """Whether torch.compile is tracing this call, in dynamo or in the backend that compiles its graph.

    Up to torch 2.6 at least, dynamo puts the patched ``F.batch_norm`` into its graph as torch's own
    function (the wrapper compares equal to it): the wrapper first runs when AOTAutograd traces that
    graph, where ``torch.compiler.is_compiling()`` is False but a tracing context is set.
    """
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


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
