"""The state every door reads: the settings in force, the policy scopes, and this thread's flag.

Below every other module of the package (it imports none of them), so each door, the plan and the
public API share one copy. Writers of the process-wide state: ``_config`` (the settings), ``_patch``
(whether the patches are in place) and ``testing`` (the device route), each holding :data:`lock`.
The scopes belong to a context, and change only through :func:`swap_scopes` and
:func:`restore_scopes` (``_config``, ``_checkpoint``).
"""

from __future__ import annotations

import contextvars
import threading
from typing import Optional, Set, Tuple

import torch
from _amp_bn_fix_boot.settings import Config

# Held by every writer of the process-wide state below (installing and removing the patches, the
# settings, the device route): one at a time. Reentrant: a read-change-write of the settings holds
# it around the write, which takes it too.
lock = threading.RLock()
# The settings in force: replaced whole (one assignment, so a reader sees old or new), never changed.
config = Config()
# Whether the shim's patches are in place: a reference to a wrapper kept after ``disable()`` only
# forwards to torch.
active = False
# Set by ``amp_bn_fix.testing.device_route()``, process-wide: CPU calls take the route a CUDA call
# takes (no host reads, no CPU fast paths).
device_route = False


class _ThreadState(threading.local):
    # True while this thread runs a call a door has decided (computed, or passed to torch): tensor
    # subclasses and TorchFunctionModes call F.batch_norm again from inside it, and the op it
    # reaches calls the dispatcher door; the decision applies once.
    inside = False
    # The innermost scope's policy on this thread, for code dynamo traces (``get_policy()`` inside
    # a compiled function): dynamo cannot read a ContextVar.
    compiled_policy: Optional[str] = None
    # How many of this thread's TorchDispatchModes are ``amp_bn_fix.testing``'s traffic counters:
    # they see every kernel and record nothing, so a call under them is still plain eager.
    counters = 0


thread = _ThreadState()


class Scope:
    """One open ``amp_bn_fix.policy(...)`` block; ``policy`` None means the process-wide one."""

    __slots__ = ("policy",)

    def __init__(self, policy: Optional[str]) -> None:
        self.policy = policy


# The open scopes of the current context, innermost last. A ContextVar, so asyncio tasks (each runs
# in a copy of its creator's context) and threads see only their own; a tuple, so a context's stack
# is never changed under another's feet; scopes leave by identity, so blocks exited out of order
# (generators consumed alternately) leave nothing behind.
scopes: contextvars.ContextVar[Tuple[Scope, ...]] = contextvars.ContextVar("amp_bn_fix_scopes", default=())
# What ``restore_scopes`` puts back: the variable's token and this thread's mirror before the swap.
ScopesToken = Tuple["contextvars.Token[Tuple[Scope, ...]]", Optional[str]]


def swap_scopes(open_scopes: Tuple[Scope, ...]) -> ScopesToken:
    """Make ``open_scopes`` this context's open scopes (innermost last), and mirror their policy
    into ``thread.compiled_policy`` for code dynamo traces; returns what undoes both.

    The scopes' one writer, so the variable and its mirror change together.
    """
    mirrored = thread.compiled_policy
    thread.compiled_policy = open_scopes[-1].policy if open_scopes else None
    return scopes.set(open_scopes), mirrored


def restore_scopes(token: ScopesToken) -> None:
    """Put back the scopes and their mirror as they were before the ``swap_scopes`` that returned ``token``."""
    variable_token, thread.compiled_policy = token
    scopes.reset(variable_token)


# The policies torch.compile has compiled batch-norm calls under (``_config.scoped_policy`` warns
# when a scope asks for another one).
compiled_policies: Set[str] = set()
_is_dynamo_tracing = torch.compiler.is_dynamo_compiling


def policy(device_type: Optional[str] = None, traced: bool = True) -> str:
    """The policy in force here: the innermost scope's, else the process-wide one.

    For a call on ``device_type``, ``off`` where the settings leave that type out. ``traced``
    False: the caller knows dynamo is not tracing it (dynamo cannot read the scopes).
    """
    settings = config
    if device_type is not None and settings.devices is not None and device_type not in settings.devices:
        return "off"
    if traced and _is_dynamo_tracing():
        innermost = thread.compiled_policy
    else:
        open_scopes = scopes.get()
        innermost = open_scopes[-1].policy if open_scopes else None
    return innermost or settings.policy
