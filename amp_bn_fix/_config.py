"""Change what the shim computes (the settings, the ``policy()`` scopes), and make compiled code follow.

Compiled code holds the policy it was traced under, and nothing in it tells dynamo's guards or the
on-disk caches (inductor's FX graphs, AOTAutograd's) that the shim was involved: the graph calls
``F.batch_norm`` as plain torch's would. So every change here, and installing or removing the
patches (``_patch``), puts the settings into the caches' key; a change of the settings also drops
the code compiled in this process.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch
from _amp_bn_fix_boot.settings import Config

from . import _compat, _dispatch, _state

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
    """Make ``scopes`` this context's open scopes (innermost last), and the compile caches' key follow."""
    _state.swap_scopes(scopes)
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
