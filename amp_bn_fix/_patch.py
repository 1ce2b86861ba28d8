"""Install and remove the patches: the one owner of patched state.

The ``F.batch_norm`` wrapper's pass-through path is a dtype check (and, for a 16-bit input, a
thread-local read) before calling the original: no argument binding, no allocation.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional
import wrapt

from . import _buffers, _policy, _sync
from ._config import Config

log = logging.getLogger("amp_bn_fix")

_F16 = torch.float16
_BF16 = torch.bfloat16


class _ThreadState(threading.local):
    # True while this thread is inside a handled call: tensor subclasses and TorchFunctionModes
    # call the patched name again from inside F.batch_norm, and the policy must apply once.
    inside = False
    # The innermost ``amp_bn_fix.policy(...)`` override of this thread, if any.
    policy: Optional[str] = None


_thread = _ThreadState()
_lock = threading.RLock()
_config = Config()
# The wrapper in place for each patched (owner, attribute), in the order applied.
_handles: Dict[Tuple[Any, str], wrapt.FunctionWrapper] = {}
_script_warned = False


_Wrapper = Callable[[Callable[..., torch.Tensor], Any, tuple, dict], torch.Tensor]


def _policy_wrapper(
    bind: Callable[..., Any],
    as_batch_norm_call: Callable[[Any], _policy.BatchNormCall],
    compute: Callable[[Callable[..., torch.Tensor], Any, torch.dtype, bool], torch.Tensor],
) -> _Wrapper:
    """A wrapt wrapper that applies the policy to one batch-norm entry point.

    ``bind`` names the entry point's arguments (``TypeError`` for a malformed call),
    ``as_batch_norm_call`` presents them as ``F.batch_norm``'s for the policy, and
    ``compute(original, call, out_dtype, guard)`` computes a handled call.
    """

    def wrapper(wrapped: Callable[..., torch.Tensor], instance: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        # The dtype test comes first: most calls are FP32 and leave after it.
        input = args[0] if args else kwargs.get("input")
        dtype = getattr(input, "dtype", None)
        if dtype is not _F16 and dtype is not _BF16:
            return wrapped(*args, **kwargs)
        thread, config = _thread, _config
        # Re-entered from inside a handled call, or a reference kept after disable().
        if thread.inside or not _handles:
            return wrapped(*args, **kwargs)
        try:
            call = bind(*args, **kwargs)
        except TypeError:
            return wrapped(*args, **kwargs)  # raises torch's own error for a malformed call
        if config.devices is not None and input.device.type not in config.devices:
            return wrapped(*args, **kwargs)
        out_dtype = _policy.output_dtype(thread.policy or config.policy, as_batch_norm_call(call))
        if out_dtype is None:
            return wrapped(*args, **kwargs)
        thread.inside = True
        try:
            return compute(wrapped, call, out_dtype, config.guard)
        finally:
            thread.inside = False

    return wrapper


_batch_norm_wrapper = _policy_wrapper(_policy.bind, lambda call: call, _policy.fp32_batch_norm)
# nn.SyncBatchNorm's syncing path (more than one rank) bypasses F.batch_norm.
_sync_batch_norm_wrapper = _policy_wrapper(_sync.bind, _sync.as_batch_norm_call, _sync.fp32_sync_batch_norm)


def _module_apply_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_BatchNorm._apply``: model casts keep the running stats FP32 (settings read per call)."""
    keep = "none" if active_policy() == "off" else _config.keep_fp32
    return _buffers.apply_keeping_fp32(wrapped, instance, args, kwargs, keep)


def _script_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Warn once when a module with BatchNorm is scripted: TorchScript compiles the original."""
    global _script_warned
    obj = args[0] if args else kwargs.get("obj")
    if not _script_warned and isinstance(obj, torch.nn.Module):
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in obj.modules()):
            _script_warned = True
            warnings.warn(
                "amp_bn_fix: TorchScript compiles the original F.batch_norm; scripted "
                "BatchNorm modules run without the amp_bn_fix policy",
                RuntimeWarning,
                stacklevel=2,
            )
    return wrapped(*args, **kwargs)


def configure(config: Config) -> None:
    """Make ``config`` the process-wide settings (one assignment: readers see old or new)."""
    global _config
    _config = config


def current_config() -> Config:
    return _config


def active_policy() -> str:
    return _thread.policy or _config.policy


def set_thread_policy(name: Optional[str]) -> Optional[str]:
    """Set this thread's override; returns the previous one so a scope can restore it."""
    previous = _thread.policy
    _thread.policy = name
    return previous


def _targets() -> List[Tuple[Any, str, Callable[..., Any]]]:
    """Every (owner, attribute, wrapper) the shim patches; installed and removed together."""
    return [
        (torch.nn.functional, "batch_norm", _batch_norm_wrapper),
        (torch.jit, "script", _script_wrapper),
        (torch.nn.modules.batchnorm._BatchNorm, "_apply", _module_apply_wrapper),
        (torch.nn.modules._functions.SyncBatchNorm, "apply", _sync_batch_norm_wrapper),
    ]


def is_installed() -> bool:
    return bool(_handles)


def install() -> bool:
    """Apply every patch not in place yet; returns False when there was none to apply.

    Each wrapper is recorded as soon as it is applied, so a failure part-way leaves nothing
    untracked: ``uninstall()`` removes what was applied and a later ``install()`` completes it.
    """
    with _lock:
        applied = False
        for owner, name, wrapper in _targets():
            if (owner, name) not in _handles:
                _handles[owner, name] = wrapt.wrap_function_wrapper(owner, name, wrapper)
                applied = True
        if applied:
            log.debug("patched torch.nn.functional.batch_norm (policy %s)", _config.policy)
        return applied


def uninstall() -> bool:
    """Remove our wrappers, restoring the very original objects; False when not all were removed.

    Only our own wrappers are removed, by identity; wrapt wrappers others put on top stay. One
    that cannot be removed (another library wrapped it without wrapt) stays in place and active,
    with a warning; the others are removed, and ``install()`` restores them.
    """
    with _lock:
        if not _handles:
            return False
        for (owner, name), handle in reversed(list(_handles.items())):
            try:
                wrapt.unwrap_object(owner, name, handle, missing_ok=True)
            except wrapt.WrapperNotOutermostError as exc:
                warnings.warn(f"amp_bn_fix: could not remove the patch: {exc}", RuntimeWarning, stacklevel=3)
                continue
            del _handles[owner, name]
        log.debug("restored torch.nn.functional.batch_norm")
        return not _handles
