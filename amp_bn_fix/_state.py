"""The state every door reads: the settings in force, the policy scopes, and this thread's flag.

Below every other module of the package (it imports none of them), so each door, the plan and the
public API share one copy. Writers of the process-wide state: ``_config`` (the settings), ``_patch``
(whether the patches are in place) and ``testing`` (the device route), each holding :data:`lock`;
``_record`` changes its guard records, and reads its counts, holding :data:`record_lock`.
The scopes belong to a context, and change only through :func:`swap_scopes` and
:func:`restore_scopes` (``_config``, ``_checkpoint``).
"""

from __future__ import annotations

import contextvars
import os
import threading
from typing import Optional, Set, Tuple

from _amp_bn_fix_boot.settings import Config

# Held by every writer of the process-wide state below (installing and removing the patches, the
# settings, the device route) and by the registration of the device route's CPU stand-in op
# (``_kernels``): one at a time. Reentrant: a read-change-write of the settings holds it around the
# write, which takes it too.
lock = threading.RLock()
# Held by every change of ``_record``'s guard records and by their readers, and by the readers of
# its counts (each thread counts its calls into its own, unlocked): threads guard running stats at
# once (nn.DataParallel's replicas, one per device, each with stats of its own), and a sweep's
# folds run torch ops that let other threads in half-way. Reentrant: a fold may free a tensor
# whose weak-reference callback records. Apart from ``lock``: recording never waits for a
# settings change.
record_lock = threading.RLock()


def _new_locks_in_child() -> None:
    # A fork (DataLoader workers) copies the locks as they are: held, if another thread was changing
    # the settings (they are replaced whole, so the child's are whole too) or counting then.
    global lock, record_lock
    lock, record_lock = threading.RLock(), threading.RLock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_new_locks_in_child)

# The settings in force: replaced whole (one assignment, so a reader sees old or new), never changed.
config = Config()
# Whether ``import amp_bn_fix`` has applied the environment's settings (once per process).
started = False
# Whether the shim's patches are in place: a reference to a wrapper kept after ``disable()`` only
# forwards to torch.
active = False
# Set by ``amp_bn_fix.testing.device_route()``, process-wide: CPU calls take the route a CUDA call
# takes (no host reads, no CPU fast paths).
device_route = False


class _ThreadState(threading.local):
    # True while this thread runs a call a door has decided (computed, or passed to torch): tensor
    # subclasses and TorchFunctionModes call F.batch_norm again from inside it, and the op it
    # reaches calls the dispatcher door; the decision applies once. The thread's, not a context's:
    # an asyncio task or a callback scheduled from inside the call would inherit a context's copy.
    inside = False
    # How many of this thread's TorchDispatchModes are ``amp_bn_fix.testing``'s traffic counters:
    # they see every kernel and record nothing, so a call under them is still plain eager.
    counters = 0


thread = _ThreadState()


class Scope:
    """One open ``amp_bn_fix.policy(...)`` block; ``policy`` None means the process-wide one.
    ``owner``: the object that opened it, which closes it in the context it was opened in."""

    __slots__ = ("policy", "owner")

    def __init__(self, policy: Optional[str], owner: object = None) -> None:
        self.policy = policy
        self.owner = owner


# The open scopes of the current context, innermost last. A ContextVar, so asyncio tasks (each runs
# in a copy of its creator's context) and threads see only their own; a tuple, so a context's stack
# is never changed under another's feet; scopes leave by identity, so blocks exited out of order
# (generators consumed alternately) leave nothing behind.
scopes: contextvars.ContextVar[Tuple[Scope, ...]] = contextvars.ContextVar("amp_bn_fix_scopes", default=())


def swap_scopes(open_scopes: Tuple[Scope, ...]) -> "contextvars.Token[Tuple[Scope, ...]]":
    """Make ``open_scopes`` this context's open scopes (innermost last); returns what undoes it.

    The scopes' one writer.
    """
    return scopes.set(open_scopes)


def restore_scopes(token: "contextvars.Token[Tuple[Scope, ...]]") -> None:
    """Put back the scopes as they were before the ``swap_scopes`` that returned ``token``."""
    scopes.reset(token)


# The policies torch.compile has compiled batch-norm calls under (``_config.set_scopes`` warns
# where the policy in force is none of them).
compiled_policies: Set[str] = set()


def policy(device_type: Optional[str] = None) -> str:
    """The policy in force here: the innermost scope's, else the process-wide one.

    For a call on ``device_type``, ``off`` where the settings leave that type out.
    """
    settings = config
    if device_type is not None and settings.devices is not None and device_type not in settings.devices:
        return "off"
    open_scopes = scopes.get()
    return (open_scopes[-1].policy if open_scopes else None) or settings.policy


# Dynamo cannot read a ContextVar: it calls this function itself while it traces (in the context it
# traces in, so the scopes of the task and thread that compile) and compiles the result in as a
# constant. The mark is what ``torch.compiler.assume_constant_result`` sets, which would import
# dynamo (a second's work) at the package's import.
policy._dynamo_marked_constant = True  # type: ignore[attr-defined]
