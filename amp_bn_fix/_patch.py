"""Install and remove the patches, and change the state the doors read (settings, scopes).

The patched entries are the doors (``_doors``: ``F.batch_norm``, ``SyncBatchNorm.apply``), the
dispatcher door's registration (``_dispatch``), the cast hook (``_BatchNorm._apply``, ``_master``)
and activation checkpointing's two implementations, whose recompute keeps the forward's scopes
(``_checkpoint``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import operator
import sys
import threading
import types
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional
import wrapt

from . import _checkpoint, _compat, _dispatch, _doors, _master, _state
from _amp_bn_fix_boot.settings import Config

log = logging.getLogger("amp_bn_fix")

_lock = threading.RLock()
# The wrapper in place for each patched (owner, attribute), in the order applied.
_handles: Dict[Tuple[Any, str], wrapt.FunctionWrapper] = {}
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


def configure(config: Config) -> None:
    """Make ``config`` the process-wide settings (one assignment: readers see old or new)."""
    changed = config != _state.config
    _state.config = config
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
        _state.compiled_policies.clear()


def _tag_compile_caches() -> None:
    """Add the settings in force (the innermost scope's policy included) to the compile cache key."""
    settings = None
    if _handles:
        c = _state.config
        # Code compiled with the dispatcher door differs from code without it.
        settings = (f"policy={_state.policy()},guard={c.describe('guard')},devices={c.describe('devices')},"
                    f"dispatch={_dispatch.describe()}")
    _compat.set_compile_cache_tag(settings)


def current_config() -> Config:
    return _state.config


@contextlib.contextmanager
def scoped_policy(name: Optional[str]) -> Iterator[None]:
    """Within the block, ``name`` is the policy of this context (``None``: the process-wide one)."""
    scope = _state.Scope(name)
    policy = name or _state.config.policy
    if _state.compiled_policies and policy not in _state.compiled_policies:
        _warn_compiled_scope(policy)
    set_scopes(_state.scopes.get() + (scope,))
    try:
        yield
    finally:
        set_scopes(tuple(s for s in _state.scopes.get() if s is not scope))


def set_scopes(scopes: Tuple[_state.Scope, ...]) -> None:
    """Make ``scopes`` this context's open scopes (innermost last)."""
    _state.scopes.set(scopes)
    _state.thread.compiled_policy = scopes[-1].policy if scopes else None
    _tag_compile_caches()


def _warn_compiled_scope(policy: str) -> None:
    # Dynamo cannot guard on a scope: compiled code keeps the policy it was compiled under.
    global _warned_compiled_scope
    if not _warned_compiled_scope:
        _warned_compiled_scope = True
        compiled = ", ".join(sorted(_state.compiled_policies))
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
        (torch.nn.functional, "batch_norm", _doors.batch_norm),
        (torch.nn.modules.batchnorm._BatchNorm, "_apply", _master.cast_hook),
        (torch.nn.modules._functions.SyncBatchNorm, "apply", _doors.sync_batch_norm),
        # Activation checkpointing's recompute keeps the policy() scopes of its forward.
        (torch.utils.checkpoint, _checkpoint.GENERATOR, _checkpoint.without_reentrant),
        (torch.utils.checkpoint.CheckpointFunction, "apply", _checkpoint.reentrant),
    ]


def is_installed() -> bool:
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
        _state.active = True
        # The dispatcher door: every other way to aten::batch_norm under autocast (see ``_dispatch``).
        applied = _dispatch.register() or applied
        if applied:
            log.debug("patched torch.nn.functional.batch_norm (policy %s)", _state.config.policy)
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
        _state.active = bool(_handles)
        found = _dispatch.unregister() or found
        if found:
            _master.clear()  # the buffers are torch's alone from now on
            _settings_changed()
        if found and removed_all:
            log.debug("restored torch.nn.functional.batch_norm")
        return found and removed_all
