"""Install and remove the patches: one list of them, walked under the state's lock.

The patched entries are the doors (``_doors``: ``F.batch_norm``, ``SyncBatchNorm.apply``), the
dispatcher door's registration (``_dispatch``), the norms' cast and load hooks (``_master``)
and activation checkpointing's two implementations, whose recompute keeps the forward's scopes
(``_checkpoint``). Each is a :class:`Patch`; :func:`install` and :func:`uninstall` decide which to
apply or remove, and what follows from it (the state's ``active`` flag, the compile caches' key,
the masters).
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from typing import Any, Callable, Iterator, List, Literal, Optional, Protocol, Tuple

import torch
import torch.nn.functional
import wrapt

from . import _checkpoint, _config, _dispatch, _doors, _master, _state
from ._wrapper import ShimWrapper, is_shim_wrapper

log = logging.getLogger("amp_bn_fix")

# What ``remove()`` found: nothing of ours, all of it removed, or some of it left in place (warned).
Removed = Literal["nothing", "all", "not all"]


class Patch(Protocol):
    """What ``install`` and ``uninstall`` ask of each patch; they own the lock and idempotency."""

    @property
    def applied(self) -> bool:
        """Whether this patch put something in place that it has not removed."""

    def apply(self) -> bool:
        """Put the patch in place (it is not: ``install`` asks only then); False when there was nothing to apply."""

    def remove(self) -> Removed:
        """Take out whatever of ours is in place (applied or not: an earlier incarnation's too)."""


class WraptPatch:
    """A wrapt wrapper of ours (:class:`ShimWrapper`) around ``owner.attribute``, calling ``wrapper``.

    ``handle`` is the wrapper this patch applied, recorded as soon as it is in place, so a failure
    part-way through ``install`` leaves nothing untracked.
    """

    def __init__(self, owner: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
        self.owner = owner
        self.attribute = attribute
        self.wrapper = wrapper
        self.handle: Optional[ShimWrapper] = None

    @property
    def applied(self) -> bool:
        return self.handle is not None

    def apply(self) -> bool:
        # A wrapper of ours this patch did not apply (left by an earlier incarnation of this
        # module, after ``importlib.reload``) is replaced, never stacked on.
        for stale in self._ours_in_chain():
            wrapt.unwrap_object(self.owner, self.attribute, stale)
        self.handle = wrapt.wrap_object(self.owner, self.attribute, ShimWrapper,
                                        (self.wrapper, isinstance(self.owner, types.ModuleType)))
        return True

    def remove(self) -> Removed:
        """Remove our wrappers by identity, those of an earlier incarnation of this module too.

        wrapt wrappers others put on top stay. One that cannot be removed (another library wrapped
        it without wrapt) stays in place and active, with a warning.
        """
        chain = self._ours_in_chain()
        removed: Removed = "all" if chain else "nothing"
        if self.handle is not None and not any(handle is self.handle for handle in chain):
            # Replaced by something that keeps no ``__wrapped__``: the shim is out of reach.
            removed = "not all"
            warnings.warn(
                f"amp_bn_fix: disable() cannot remove the shim from {self._qualname()}: another "
                f"library replaced it with {getattr(self.owner, self.attribute)!r}, which calls the shim but "
                "does not say what it wraps (no __wrapped__), so the shim stays active under it. Undo "
                "that library's patch first, then call amp_bn_fix.disable().",
                RuntimeWarning,
                stacklevel=4,  # the user's ``amp_bn_fix.disable()`` line
            )
        for handle in chain:
            try:
                wrapt.unwrap_object(self.owner, self.attribute, handle)
            except wrapt.WrapperNotOutermostError as exc:
                warnings.warn(f"amp_bn_fix: could not remove the patch: {exc}", RuntimeWarning, stacklevel=4)
                removed = "not all"
                continue
            if handle is self.handle:
                self.handle = None
        return removed

    def _ours_in_chain(self) -> List[wrapt.FunctionWrapper]:
        """Every amp_bn_fix wrapper in the chain at ``owner.attribute``, outermost first."""
        chain = wrapt.wrapper_chain(wrapt.resolve_path(self.owner, self.attribute)[2])
        return [w for w in chain if is_shim_wrapper(w)]

    def _qualname(self) -> str:
        """``torch.nn.functional.batch_norm`` for a module's function, ``module.Class.name`` for a class's."""
        if isinstance(self.owner, types.ModuleType):
            return f"{self.owner.__name__}.{self.attribute}"
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attribute}"


# Every patch the shim applies, installed in this order and removed in the reverse one.
PATCHES: Tuple[Patch, ...] = (
    WraptPatch(torch.nn.functional, "batch_norm", _doors.batch_norm),
    # BatchNorm's and InstanceNorm's casts and loads, each on its own class: a library's wrapper
    # of either sits around the shim's or under it, never beside it.
    *(WraptPatch(norm, attribute, hook)
      for norm in (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)
      for attribute, hook in (("_apply", _master.cast_hook), ("_load_from_state_dict", _master.load_hook))),
    WraptPatch(torch.nn.modules._functions.SyncBatchNorm, "apply", _doors.sync_batch_norm),
    # Activation checkpointing's recompute keeps the policy() scopes of its forward.
    WraptPatch(torch.utils.checkpoint, _checkpoint.GENERATOR, _checkpoint.without_reentrant),
    WraptPatch(torch.utils.checkpoint.CheckpointFunction, "apply", _checkpoint.reentrant),
    # The dispatcher door: every other way to aten::batch_norm under autocast (see ``_dispatch``).
    _dispatch.PATCH,
)


def is_installed() -> bool:
    return any(patch.applied for patch in PATCHES)


def install() -> bool:
    """Apply every patch not in place yet; returns False when there was none to apply.

    A failure part-way leaves nothing untracked: ``uninstall()`` removes what was applied and a
    later ``install()`` completes it.
    """
    with _state.lock:
        applied = False
        for patch in PATCHES:
            if not patch.applied:
                applied = patch.apply() or applied
        _state.active = True
        if applied:
            log.debug("patched torch.nn.functional.batch_norm (policy %s)", _state.config.policy)
            _config.settings_changed()
        return applied


def uninstall() -> bool:
    """Remove our patches, restoring the very original objects; False when none or not all were.

    A patch that cannot be removed stays in place and active, with a warning; the others are
    removed, and ``install()`` restores them.
    """
    with _state.lock:
        removed: List[Removed] = []
        for patch in reversed(PATCHES):  # a loop, not a comprehension: the warnings' stacklevel counts frames
            removed.append(patch.remove())
        _state.active = is_installed()
        found = any(r != "nothing" for r in removed)
        if found:
            _master.clear()  # the buffers are torch's alone from now on
            _config.settings_changed()
        if found and "not all" not in removed:
            log.debug("restored torch.nn.functional.batch_norm")
        return found and "not all" not in removed


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
