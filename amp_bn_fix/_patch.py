"""Install and remove the patches: the one owner of patched state, settings and policy scopes.

Two wrappers, one per entry point (``F.batch_norm`` and SyncBatchNorm's syncing path), each a
straight line: the pass-through test (a dtype check, then a thread-local read for 16-bit inputs:
no argument binding, no allocation), then ``_decide.plan``, then the computation
(``_compute``/``_sync``, whose running-stat updates ``_stats`` owns). The call BatchNorm modules
make under autocast takes a lane of the same three steps (``_decide.common``, ``_compute.common``)
when it is the common one.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import logging
import operator
import sys
import threading
import types
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn.functional
import wrapt

from . import _buffers, _compat, _compute, _decide, _master, _record, _sync
from _amp_bn_fix_boot.settings import Config

log = logging.getLogger("amp_bn_fix")

_F16 = torch.float16
_BF16 = torch.bfloat16
_F32 = torch.float32
_function_mode_enabled = _compat.function_mode_enabled
_counts = _record.counts


class _ThreadState(threading.local):
    # True while this thread is inside a handled call: tensor subclasses and TorchFunctionModes
    # call the patched name again from inside F.batch_norm, and the policy must apply once.
    inside = False
    # True while InstanceNorm's batch-norm call runs: its running stats are per-sample copies, and
    # the guard judges the module's own stats once the copies are averaged into them (``_dispatch``).
    unguarded = False
    # The innermost scope's policy on this thread, for code dynamo traces (``get_policy()`` inside
    # a compiled function): dynamo cannot read a ContextVar (see ``_scope_policy``).
    compiled_policy: Optional[str] = None


class _Scope:
    """One open ``amp_bn_fix.policy(...)`` block; ``policy`` None means the process-wide one."""

    __slots__ = ("policy",)

    def __init__(self, policy: Optional[str]) -> None:
        self.policy = policy


_thread = _ThreadState()
# The open scopes of the current context, innermost last. A ContextVar, so asyncio tasks (each runs
# in a copy of its creator's context) and threads see only their own; a tuple, so a context's stack
# is never changed under another's feet; scopes leave by identity, so blocks exited out of order
# (generators consumed alternately) leave nothing behind.
_scopes: contextvars.ContextVar[Tuple[_Scope, ...]] = contextvars.ContextVar("amp_bn_fix_scopes", default=())
_lock = threading.RLock()
_config = Config()
# The wrapper in place for each patched (owner, attribute), in the order applied.
_handles: Dict[Tuple[Any, str], wrapt.FunctionWrapper] = {}
# The policies torch.compile has compiled batch-norm calls under (see ``scoped_policy``).
_compiled_policies: Set[str] = set()
_warned_compiled_scope = False


class _ModuleByName:
    """Pickles as ``importlib.import_module(name)``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Tuple[Any, ...]:
        return importlib.import_module, (self.name,)


class ShimWrapper(wrapt.FunctionWrapper):
    """wrapt's function wrapper, copied and pickled like the plain function it replaces.

    A copy is the object itself; a pickle refers to where the function lives
    (``torch.nn.functional.batch_norm``), so it unpickles to whatever is installed there then.
    The class attribute marks amp_bn_fix's wrappers across ``importlib.reload`` of this module.
    """

    _amp_bn_fix_wrapper = True

    def __init__(self, wrapped: Any, wrapper: Any, module_attribute: bool = False) -> None:
        if not module_attribute or not inspect.isfunction(wrapped):
            super().__init__(wrapped, wrapper)
            return
        # wrapt binds a plain function as "function", and then every call looks up ``__self__`` on
        # it (an AttributeError raised and cleared: half of the wrapper's cost). A module's function
        # is never bound to an instance, so it is given the "staticmethod" binding, whose calls go
        # straight to the wrapper.
        # wrapt has no public spelling for it: its base class's keyword, pinned by a test.
        super(wrapt.FunctionWrapper, self).__init__(wrapped, None, wrapper, binding="staticmethod")

    def __copy__(self) -> "ShimWrapper":
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShimWrapper":
        return self

    def __reduce_ex__(self, protocol: int) -> Any:
        module, name = self.__module__, self.__qualname__
        if _lookup(module, name) is self:
            return name  # pickled as a global, exactly like the original function
        # A reference kept after disable(): the same reference, spelled with the standard library.
        return operator.attrgetter(name), (_ModuleByName(module),)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)


def _lookup(module: str, name: str) -> Any:
    try:
        return operator.attrgetter(name)(importlib.import_module(module))
    except (ImportError, AttributeError):
        return None


def _is_shim_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is an amp_bn_fix wrapper, from this incarnation of the module or an earlier one."""
    return getattr(type(obj), "_amp_bn_fix_wrapper", False) is True


def _passes(input: Any) -> bool:
    """Whether a call on ``input`` goes straight to torch: the test every call pays, so first and cheap.

    Most calls are FP32 and leave here, unless a TorchFunctionMode is active: strict export's
    records autocast regions without entering them (see ``_compute.recorded_region_batch_norm``).
    """
    dtype = getattr(input, "dtype", None)
    return dtype is not _F16 and dtype is not _BF16 and (dtype is not _F32 or not _function_mode_enabled())


def _bound(bind: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The 16-bit call's arguments by name, or None when the wrapper passes it to torch as it is.

    None when re-entered from inside a handled call, for a reference kept after ``disable()``, and
    for a malformed call, which then gets torch's own error.
    """
    if _thread.inside or not _handles:
        return None
    try:
        return bind(*args, **kwargs)
    except TypeError:
        _counts.passed += 1
        return None


def _policy_for(device_type: str, config: Config) -> str:
    """The policy for one call on ``device_type``: ``off`` for a type the settings leave out."""
    if config.devices is not None and device_type not in config.devices:
        return "off"
    return _policy_noting_compiled(config)


def _batch_norm_wrapper(wrapped: Callable[..., torch.Tensor], instance: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The wrapper of ``torch.nn.functional.batch_norm``: decide, then compute or pass through."""
    input = args[0] if args else kwargs.get("input")
    dtype = getattr(input, "dtype", None)
    if dtype is not _F16 and dtype is not _BF16 and (dtype is not _F32 or not _function_mode_enabled()):
        _counts.passed += 1  # see _passes: the test every call pays, inlined
        return wrapped(*args, **kwargs)
    if dtype is not _F32 and len(args) == 8 and not kwargs and not _thread.inside and _handles:
        # The call BatchNorm modules make (eight arguments by position) on a 16-bit input: when it
        # is the common one (``_decide.common``), decided in a few reads and computed by
        # ``_compute.common``.
        device_type = "cpu" if input.is_cpu else "cuda" if input.is_cuda else None
        if device_type is not None:
            # _policy_for in plain eager mode (no tracer can be compiling the call), written out.
            config = _config
            if config.devices is not None and device_type not in config.devices:
                policy = "off"
            else:
                scopes = _scopes.get()
                policy = (scopes[-1].policy if scopes else None) or config.policy
            guard = config.guard and not _thread.unguarded
            plan = _decide.common(args, device_type, policy, guard) if policy != "off" else None
            if plan is not None:
                _thread.inside = True
                try:
                    out = _compute.common(wrapped, args, plan, device_type)
                finally:
                    _thread.inside = False
                # Counted once computed: a call that raises (torch's argument errors) was not handled.
                handled = _counts.handled  # _record.handled, inlined as the pass-through count is
                handled[policy] = handled.get(policy, 0) + 1
                return out
    call = _bound(_decide.bind, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    config = _config
    device_type = input.device.type
    policy = _policy_for(device_type, config)
    region_dtype = _compat.recorded_autocast_dtype(device_type) if policy != "off" else None
    guard = config.guard and not _thread.unguarded
    if region_dtype is not None:
        return _inside(_compute.recorded_region_batch_norm, wrapped, call, policy, region_dtype, guard)
    plan = _decide.plan(call, policy, guard, config.keep_fp32, _master.is_kept)
    if plan is None:
        _counts.passed += 1
        if call.training and call.running_mean is not None:
            _master.forget(call.running_mean)  # torch updates the stats: their master no longer holds
        return wrapped(*args, **kwargs)
    out = _inside(_compute.batch_norm, wrapped, call, plan)
    _record.handled(plan.counted_as)
    return out


def _sync_batch_norm_wrapper(wrapped: Callable[..., torch.Tensor], instance: Any, args: tuple, kwargs: dict
                             ) -> torch.Tensor:
    """The wrapper of ``SyncBatchNorm.apply``, nn.SyncBatchNorm's syncing path (more than one rank)."""
    input = args[0] if args else kwargs.get("input")
    if _passes(input):
        _counts.passed += 1
        return wrapped(*args, **kwargs)
    call = _bound(_sync.bind, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    config = _config
    policy = _policy_for(input.device.type, config)
    if policy != "off" and _compat.recorded_autocast_dtype(input.device.type) is not None:
        raise RuntimeError(
            "amp_bn_fix: strict torch.export records the torch.autocast block inside forward() without "
            f"running it, and SyncBatchNorm's syncing path cannot carry the BatchNorm policy {policy!r} "
            "into the recorded block. Export with strict=False, enter torch.autocast around the export "
            "call instead, or export with amp_bn_fix.policy('off')."
        )
    # SyncBatchNorm's 16-bit stats are updated through FP32 copies, without a master.
    plan = _decide.plan(_sync.as_batch_norm_call(call), policy, config.guard, "none")
    if plan is None:
        _counts.passed += 1
        return wrapped(*args, **kwargs)
    _record.handled(plan.counted_as)
    return _inside(_sync.fp32_sync_batch_norm, wrapped, call, plan.out_dtype, plan.guard)


def _inside(compute: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``compute(*args)`` marked as inside a handled call on this thread (see ``_ThreadState``)."""
    _thread.inside = True
    try:
        return compute(*args)
    finally:
        _thread.inside = False


def _module_apply_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_BatchNorm._apply``: model casts keep BatchNorm FP32 as ``keep_fp32`` says (settings read per call)."""
    keep = "none" if active_policy() == "off" else _config.keep_fp32
    if keep == "master":
        return _buffers.apply_carrying_masters(wrapped, instance, args, kwargs, _config.devices)
    return _buffers.apply_keeping_fp32(wrapped, instance, args, kwargs, keep, _config.devices)


def configure(config: Config) -> None:
    """Make ``config`` the process-wide settings (one assignment: readers see old or new)."""
    global _config
    changed = config != _config
    _config = config
    if changed:
        _settings_changed()


def _settings_changed() -> None:
    """Make torch.compile follow a change of what the shim computes.

    Compiled code holds the policy it was traced under, and nothing in it tells dynamo's guards or
    the on-disk caches (inductor's FX graphs, AOTAutograd's) that the shim was involved: the graph
    calls ``F.batch_norm`` as plain torch's would. So the settings go into the caches' key, and
    code compiled in this process is dropped (``torch.compiler.reset()``) to recompile on its next
    call. Dynamo is reset only once imported: importing it costs a second.
    """
    _tag_compile_caches()
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
        _compiled_policies.clear()


def _tag_compile_caches() -> None:
    """Add the settings in force (the innermost scope's policy included) to the compile cache key."""
    settings = None
    if _handles:
        c = _config
        policy = _scope_policy() or c.policy
        settings = f"policy={policy},guard={c.describe('guard')},devices={c.describe('devices')}"
        from . import _dispatch  # code compiled with the dispatcher door differs from code without it

        settings += f",dispatch={_dispatch.describe()}"
    _compat.set_compile_cache_tag(settings)


def current_config() -> Config:
    return _config


def _scope_policy() -> Optional[str]:
    """The innermost scope's policy, None outside every scope (or in a scope of ``None``)."""
    if _compat.is_dynamo_tracing():
        return _thread.compiled_policy
    scopes = _scopes.get()
    return scopes[-1].policy if scopes else None


def _policy_noting_compiled(config: Config) -> str:
    """The policy for one handled call; recorded when torch.compile traces the call."""
    policy = _scope_policy() or config.policy
    # Strict torch.export traces with dynamo too, but keeps no compiled code a scope could miss.
    if _compat.is_compiling() and not _compat.is_exporting():
        _compiled_policies.add(policy)
    return policy


def active_policy() -> str:
    return _scope_policy() or _config.policy


@contextlib.contextmanager
def scoped_policy(name: Optional[str]) -> Iterator[None]:
    """Within the block, ``name`` is the policy of this context (``None``: the process-wide one)."""
    scope = _Scope(name)
    if _compiled_policies and (name or _config.policy) not in _compiled_policies:
        _warn_compiled_scope(name or _config.policy)
    _set_scopes(_scopes.get() + (scope,))
    try:
        yield
    finally:
        _set_scopes(tuple(s for s in _scopes.get() if s is not scope))


def _set_scopes(scopes: Tuple[_Scope, ...]) -> None:
    _scopes.set(scopes)
    _thread.compiled_policy = scopes[-1].policy if scopes else None
    _tag_compile_caches()


def _warn_compiled_scope(policy: str) -> None:
    # Dynamo cannot guard on a scope: compiled code keeps the policy it was compiled under.
    global _warned_compiled_scope
    if not _warned_compiled_scope:
        _warned_compiled_scope = True
        compiled = ", ".join(sorted(_compiled_policies))
        warnings.warn(
            f"amp_bn_fix: policy({policy!r}) does not reach code torch.compile has already compiled "
            f"(compiled under {compiled}): compiled functions keep the policy they were compiled "
            "under. Compile inside the block, or call torch.compiler.reset() to recompile.",
            RuntimeWarning,
            stacklevel=6,  # the user's ``with amp_bn_fix.policy(...)`` line
        )


def _targets() -> List[Tuple[Any, str, Callable[..., Any]]]:
    """Every (owner, attribute, wrapper) the shim patches; installed and removed together."""
    return [
        (torch.nn.functional, "batch_norm", _batch_norm_wrapper),
        (torch.nn.modules.batchnorm._BatchNorm, "_apply", _module_apply_wrapper),
        (torch.nn.modules._functions.SyncBatchNorm, "apply", _sync_batch_norm_wrapper),
    ]


def is_installed() -> bool:
    from . import _dispatch  # the dispatcher door, installed and removed with the wrappers

    return bool(_handles) or _dispatch.is_registered()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Within the block the patch is in place; afterwards as it was, even if the block raises."""
    with _patched(True):
        yield


@contextlib.contextmanager
def uninstalled() -> Iterator[None]:
    """Within the block torch is plain (the patch removed); afterwards as it was, even if the block raises."""
    with _patched(False):
        yield


@contextlib.contextmanager
def _patched(on: bool) -> Iterator[None]:
    was = is_installed()
    install() if on else uninstall()
    try:
        yield
    finally:
        if was != on:
            install() if was else uninstall()


def _shim_wrappers_at(owner: Any, name: str) -> List[wrapt.FunctionWrapper]:
    """Every amp_bn_fix wrapper in the chain at ``owner.name``, outermost first."""
    return [w for w in wrapt.wrapper_chain(wrapt.resolve_path(owner, name)[2]) if _is_shim_wrapper(w)]


def _qualname(owner: Any, name: str) -> str:
    """``torch.nn.functional.batch_norm`` for a module's function, ``module.Class.name`` for a class's."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def install() -> bool:
    """Apply every patch not in place yet; returns False when there was none to apply.

    Each wrapper is recorded as soon as it is applied, so a failure part-way leaves nothing
    untracked: ``uninstall()`` removes what was applied and a later ``install()`` completes it.
    A wrapper of ours that this module did not record (left by an earlier incarnation of it, after
    ``importlib.reload``) is replaced, never stacked on.
    """
    with _lock:
        applied = False
        for owner, name, wrapper in _targets():
            if (owner, name) not in _handles:
                for stale in _shim_wrappers_at(owner, name):
                    wrapt.unwrap_object(owner, name, stale)
                _handles[owner, name] = wrapt.wrap_object(owner, name, ShimWrapper, (wrapper, isinstance(owner, types.ModuleType)))
                applied = True
        # The dispatcher door: every other way to aten::batch_norm under autocast (see ``_dispatch``).
        from . import _dispatch

        applied = _dispatch.register() or applied
        if applied:
            log.debug("patched torch.nn.functional.batch_norm (policy %s)", _config.policy)
            _settings_changed()
        return applied


def uninstall() -> bool:
    """Remove our wrappers, restoring the very original objects; False when none or not all were.

    Only our own wrappers are removed, by identity (those of an earlier incarnation of this module
    too); wrapt wrappers others put on top stay. One that cannot be removed (another library
    wrapped it without wrapt) stays in place and active, with a warning; the others are removed,
    and ``install()`` restores them.
    """
    with _lock:
        found, removed_all = False, True
        for owner, name, _ in reversed(_targets()):
            chain = _shim_wrappers_at(owner, name)
            recorded = _handles.get((owner, name))
            if recorded is not None and not any(handle is recorded for handle in chain):
                # Replaced by something that keeps no ``__wrapped__``: the shim is out of reach.
                found, removed_all = True, False
                warnings.warn(
                    f"amp_bn_fix: disable() cannot remove the shim from {_qualname(owner, name)}: another "
                    f"library replaced it with {getattr(owner, name)!r}, which calls the shim but does not "
                    "say what it wraps (no __wrapped__), so the shim stays active under it. Undo that "
                    "library's patch first, then call amp_bn_fix.disable().",
                    RuntimeWarning,
                    stacklevel=3,
                )
            for handle in chain:
                found = True
                try:
                    wrapt.unwrap_object(owner, name, handle)
                except wrapt.WrapperNotOutermostError as exc:
                    warnings.warn(f"amp_bn_fix: could not remove the patch: {exc}", RuntimeWarning, stacklevel=3)
                    removed_all = False
                    continue
                if _handles.get((owner, name)) is handle:
                    del _handles[owner, name]
        from . import _dispatch

        found = _dispatch.unregister() or found
        if found:
            _master.clear()  # the buffers are torch's alone from now on
            _settings_changed()
        if found and removed_all:
            log.debug("restored torch.nn.functional.batch_norm")
        return found and removed_all
