"""Change what the shim computes (the settings, the ``policy()`` scopes), and make compiled code follow.

Compiled code holds the policy it was traced under, and nothing in it tells dynamo's guards or the
on-disk caches (inductor's FX graphs, AOTAutograd's) that the shim was involved: the graph calls
``F.batch_norm`` as plain torch's would. So every change here, and installing or removing the
patches (``_patch``), puts the settings into the caches' key; a change of the settings also drops
the code compiled in this process.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from typing import Any, Callable, Generator, Optional, Set, Tuple, TypeVar, cast

import torch
from _amp_bn_fix_boot.settings import Config

from . import _compat, _dispatch, _state
from ._frames import stacklevel_outside

F = TypeVar("F", bound=Callable[..., Any])

_warned_compiled_scope = False


def configure(config: Config) -> None:
    """Make ``config`` the process-wide settings (one assignment: readers see old or new)."""
    with _state.lock:
        changed = config != _state.config
        _state.config = config
        if changed:
            settings_changed()


def change(**changes: Any) -> Config:
    """Apply ``changes`` (parsed values, their source ``"API"``) to the settings in force; returns those before."""
    with _state.lock:  # read, change and write: one caller at a time
        previous = _state.config
        if changes:
            configure(previous.replace("API", **changes))
    return previous


def settings_changed() -> None:
    """Make torch.compile follow a change of what the shim computes.

    The settings go into the compile caches' key, and code compiled in this process is dropped
    (``torch.compiler.reset()``) to recompile on its next call. Dynamo is reset only once imported:
    importing it costs a second.
    """
    _tag_compile_caches()
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
        _state.compiled_policies.clear()


def _tag_compile_caches() -> None:
    """Add the settings in force (the innermost scope's policy included) to the compile cache key."""
    settings = None
    if _state.active:
        c = _state.config
        # Code compiled with the dispatcher door differs from code without it.
        settings = (f"policy={_state.policy()},guard={c.describe('guard')},devices={c.describe('devices')},"
                    f"dispatch={_dispatch.describe()}")
    _compat.set_compile_cache_tag(settings)


def _close(scope: _state.Scope) -> None:
    # By identity: blocks closed out of order (generators consumed alternately) leave nothing behind.
    set_scopes(tuple(s for s in _state.scopes.get() if s is not scope))


class PolicyScope:
    """A ``policy()`` scope: a context manager, and a decorator that opens a scope of its own
    whenever the decorated code runs.

    As a context manager one object may be entered in several threads or asyncio tasks at once:
    each ``with`` closes the scope it opened in its own context. A plain function gets the scope
    around each call, a coroutine function around its run in its task. A generator function's
    body runs one step at a time, later than its call: its steps see scopes of their own (the
    caller's at the first step with this one on top, and the blocks the body opens, kept from one
    step to the next), and the caller's scopes are back in force between steps.
    """

    __slots__ = ("name",)

    def __init__(self, name: Optional[str]) -> None:
        self.name = name

    def __enter__(self) -> None:
        scope = _state.Scope(self.name, owner=self)
        try:
            set_scopes(_state.scopes.get() + (scope,))
        except BaseException:  # a warning raised as an error: the block does not open
            _close(scope)
            raise

    def __exit__(self, *exc: Any) -> None:
        mine = [scope for scope in _state.scopes.get() if scope.owner is self]
        if mine:
            _close(mine[-1])

    def __call__(self, function: F) -> F:
        name = self.name
        if inspect.isasyncgenfunction(function):
            raise TypeError(
                f"amp_bn_fix.policy({name!r}) cannot decorate the async generator function "
                f"{getattr(function, '__qualname__', function)!r}: open the scope inside it "
                "(with amp_bn_fix.policy(...): ...)")
        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def run_coroutine(*args: Any, **kwargs: Any) -> Any:
                # The scope lives in the task's context: other tasks run in their own.
                with self:
                    return await function(*args, **kwargs)

            return cast(F, run_coroutine)
        if inspect.isgeneratorfunction(function):
            @functools.wraps(function)
            def run_generator(*args: Any, **kwargs: Any) -> Any:
                return (yield from _with_own_scopes(function(*args, **kwargs), name))

            return cast(F, run_generator)

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return cast(F, run)


_Scopes = Tuple[_state.Scope, ...]


def _with_own_scopes(generator: Generator[Any, Any, Any], name: Optional[str]) -> Generator[Any, Any, Any]:
    """Drive ``generator`` for ``yield from``, each step under its own scopes (:class:`PolicyScope`)."""
    own: Optional[_Scopes] = None
    step: Callable[[], Any] = functools.partial(generator.send, None)
    while True:
        try:
            value, own = _step(step, own, name)
        except StopIteration as done:
            return done.value
        try:
            sent = yield value
        except GeneratorExit:
            _step(generator.close, own, name)
            raise
        except BaseException as error:  # thrown in: the generator sees it at its yield
            step = functools.partial(generator.throw, error)
        else:
            step = functools.partial(generator.send, sent)


def _step(step: Callable[[], Any], own: Optional[_Scopes], name: Optional[str]) -> Tuple[Any, _Scopes]:
    """``step()`` under a generator's own scopes (before its first step: the caller's, with ``name``'s
    on top); what it gave, and its scopes after it. The caller's are back in force afterwards."""
    outside = _state.scopes.get()
    try:
        set_scopes(outside + (_state.Scope(name),) if own is None else own)
        return step(), _state.scopes.get()
    finally:
        set_scopes(outside)


def set_scopes(scopes: Tuple[_state.Scope, ...]) -> None:
    """Make ``scopes`` this context's open scopes (innermost last), and the compile caches' key follow.

    Dynamo cannot guard on a scope: compiled code keeps the policy it was compiled under, inside
    the block it was compiled in and outside it alike. Where the policy in force now is none that
    code was compiled under, that code would not follow it: a warning says so, once.
    """
    _state.swap_scopes(scopes)
    _tag_compile_caches()
    compiled = _state.compiled_policies
    if compiled and not _warned_compiled_scope:
        policy = _state.policy()
        if policy not in compiled:
            _warn_compiled_scope(policy, compiled)


def _warn_compiled_scope(policy: str, compiled: Set[str]) -> None:
    global _warned_compiled_scope
    _warned_compiled_scope = True
    warnings.warn(
        f"amp_bn_fix: the policy in force here, {policy!r}, does not reach code torch.compile has "
        f"already compiled (under {', '.join(sorted(compiled))}): compiled functions keep the policy "
        "they were compiled under, inside and outside the policy() block they were compiled in. Call "
        "compiled code under that policy, or call torch.compiler.reset() to recompile.",
        RuntimeWarning,
        # The first frame outside the scopes' machinery (this module, contextlib, an event loop):
        # the user's ``with`` line, the call of a decorated function or generator, the line that
        # runs a decorated coroutine.
        stacklevel=stacklevel_outside(__name__, "contextlib", "asyncio"),
    )
