"""Activation checkpointing recomputes a forward under the ``policy()`` scopes that forward ran in.

``torch.utils.checkpoint`` restores autocast's state and the RNG for its recompute, but not a
ContextVar: the recompute runs where backward runs (after the block, or in one of autograd's
device threads on CUDA), under that context's scopes, and a BatchNorm there would return another
dtype than in the forward it recomputes (non-reentrant checkpointing then raises a
``CheckpointError``; reentrant checkpointing computes gradients of another computation).

Each of torch's two implementations hands the function to the piece that runs it again in
backward: ``CheckpointFunction.apply`` (reentrant) and the generator of non-reentrant
checkpointing, selective checkpointing included (:data:`GENERATOR`:
``_checkpoint_without_reentrant_generator`` up to torch 2.14; from 2.15 that name is a shim that
calls ``_checkpoint_without_reentrant_generator_impl``). ``checkpoint``, its decorator form and
``checkpoint_sequential`` look both up in their module each time they run. While a scope is
open, the wrappers here give torch a function that runs the caller's under the scopes open at the
call: the same scopes in the forward and in every recompute, whichever thread or context backward
runs in. With no scope open, and while torch.compile traces (its graphs hold their recompute and
the policy they were traced under), torch gets the caller's very function.

``checkpoint`` itself is left alone: dynamo recognises it by identity (``obj is
torch.utils.checkpoint.checkpoint``) and compiles it as a higher-order op, so a wrapper in its
place would turn the calls through a name bound to torch's function before the patch into graph
breaks; and newer torch's decorator form (``checkpoint(use_reentrant=False)(fn)``) reaches the
implementations without calling it again.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch.utils.checkpoint

from . import _compat, _state

# The generator of non-reentrant checkpointing, the one torch's own callers use.
GENERATOR = next(name for name in ("_checkpoint_without_reentrant_generator_impl",
                                    "_checkpoint_without_reentrant_generator")
                 if hasattr(torch.utils.checkpoint, name))


class _RunInScopes:
    """``function``, run with ``scopes`` as the open scopes.

    The scopes replace those of wherever it runs, and are put back afterwards, even when the call
    raises (non-reentrant checkpointing stops a recompute by raising out of it).
    """

    __slots__ = ("function", "scopes")

    def __init__(self, function: Callable[..., Any], scopes: Tuple[_state.Scope, ...]) -> None:
        self.function = function
        self.scopes = scopes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = _state.swap_scopes(self.scopes)
        try:
            return self.function(*args, **kwargs)
        finally:
            _state.restore_scopes(token)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.scopes[-1].policy or 'process-wide'!r} of {self.function!r}>"


def _in_open_scopes(function: Any) -> Any:
    """``function`` run under the scopes open here, or ``function`` itself when none is."""
    if not _state.active or _compat.is_compiling():
        return function
    scopes = _state.scopes.get()
    if not scopes:
        return function
    return _RunInScopes(function, scopes)


def _with_function_scoped(wrapped: Callable[..., Any], args: tuple, kwargs: dict, keyword: str) -> Any:
    """``wrapped`` called with its first argument (by position, else ``keyword``) run in the open scopes."""
    if args:
        function = _in_open_scopes(args[0])
        if function is not args[0]:
            args = (function,) + args[1:]
    elif keyword in kwargs:
        kwargs = {**kwargs, keyword: _in_open_scopes(kwargs[keyword])}
    return wrapped(*args, **kwargs)


def without_reentrant(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper of the non-reentrant generator, :data:`GENERATOR` (wrapt's signature).

    Its first argument is the function its recompute runs (the forward itself is run by its caller).
    """
    return _with_function_scoped(wrapped, args, kwargs, "fn")


def reentrant(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper of ``torch.utils.checkpoint.CheckpointFunction.apply``: ``(run_function, preserve, *args)``.

    ``run_function`` runs in its forward (under ``no_grad``) and again in its backward.
    """
    return _with_function_scoped(wrapped, args, kwargs, "run_function")

