"""Scaffolding the test modules share, defined once.

``ORIGINAL`` is torch's own ``F.batch_norm``, the function the shim wraps (found with wrapt's
``unwrapped``, so it is the same whether or not the shim is installed when this is imported).
``child_env`` is the environment for a child process: this process's, from which conftest removed
every ``AMP_BN_FIX*`` setting at import, plus the settings a test gives it.
``compare_outcomes`` checks that the shim treats a call as the original does: the same error, or
both return and the results agree. ``record_inputs`` and ``assert_stats_replayed`` check running
stats against a float64 replay of the calls a BatchNorm module received. ``computed_stats`` is what
the shim computes a module's call with (a half model's FP32 master, else its buffers).
``shim_disabled`` runs a block in plain torch, the shim disabled as a user disables it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
import wrapt

from _bounds import assert_near, assert_same_non_finite

ORIGINAL = wrapt.unwrapped(F.batch_norm)

# Cold imports of torch on a busy two-core machine take minutes, not seconds.
SUBPROCESS_TIMEOUT = 300


def child_env(**settings: str) -> Dict[str, str]:
    """This process's environment (free of AMP_BN_FIX* settings: see conftest) plus ``settings``."""
    return {**os.environ, **settings}


def outcome(fn: Callable[..., torch.Tensor], args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None,
            dtype: Optional[torch.dtype] = None, input_dtype: Optional[torch.dtype] = None) -> Any:
    """``fn(*args, **kwargs)`` on copies of the tensor arguments: ``(output, running_mean, running_var)``
    (the stats as the call left them, None where not given), or the exception it raised.

    ``dtype`` casts every floating tensor (a float64 reference); ``input_dtype`` the input alone.
    """
    def copy(index: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        target = input_dtype if index == 0 and input_dtype else dtype if value.is_floating_point() else None
        return value.to(target or value.dtype, copy=True)

    args = [copy(i, a) for i, a in enumerate(args)]
    kwargs = {k: copy(0 if k == "input" else 1, v) for k, v in (kwargs or {}).items()}
    try:
        out = fn(*args, **kwargs)
    except Exception as error:  # the error is what is compared
        return error
    stats = [args[i] if len(args) > i else kwargs.get(name) for i, name in ((1, "running_mean"), (2, "running_var"))]
    return (out, *stats)


def compare_outcomes(ours: Any, theirs: Any, reference: Callable[[], Any], n: int) -> None:
    """The shim's :func:`outcome` of a call against the original's on the same values in FP32.

    An error must be the original's, type and message. Where the original accepts the call (older
    torch accepts some malformed ones, such as eps <= 0), the shim must accept it too; its output
    and running stats must be non-finite where the original's are (eps <= 0 can give inf or NaN)
    and elsewhere the float64 ``reference()`` computed in FP32 over ``n``-term sums.
    """
    if isinstance(theirs, Exception):
        assert isinstance(ours, Exception), f"the original raised {theirs!r}; the shim returned"
        assert type(ours) is type(theirs) and str(ours) == str(theirs), (ours, theirs)
        return
    assert not isinstance(ours, Exception), f"the original accepted the call; the shim raised {ours!r}"
    expected = reference()
    assert not isinstance(expected, Exception), f"the float64 reference raised {expected!r}"
    for what, a, b, exact in zip(("output", "running mean", "running var"), ours, theirs, expected):
        if not isinstance(b, torch.Tensor) or not b.is_floating_point():
            continue
        assert a.shape == b.shape == exact.shape, what
        finite = assert_same_non_finite(a, b, what)
        assert_near(a[finite], exact[finite], n, what=what)


def record_inputs(module: torch.nn.Module) -> List[torch.Tensor]:
    """The input of every call of ``module`` from now on (recomputes too), as detached copies."""
    inputs: List[torch.Tensor] = []
    module.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach().clone()))
    return inputs


def assert_stats_replayed(stats: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], momentum: float = 0.1,
                          eps: float = 1e-5) -> None:
    """``stats`` (running mean and var, from zeros and ones) are a training call's update on each of
    ``inputs``, and only those, computed in float64 (FP32 accuracy)."""
    channels = stats[0].shape[0]
    mean, var = torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64)
    for x in inputs:
        ORIGINAL(x.double(), mean, var, None, None, True, momentum, eps)
    n = inputs[0].numel() // channels if inputs else 1
    assert_near(stats[0], mean, n, what="running mean")
    assert_near(stats[1], var, n, what="running var")


def guarded_update(mean: torch.Tensor, var: torch.Tensor, host: bool, kernel: Any) -> Any:
    """``kernel(mean, var)`` updating the stats as a handled training call's kernel does, guarded
    (plain eager mode, on the host or the device route)."""
    from amp_bn_fix import _guard

    work_mean, work_var, token = _guard.begin(mean, var, guard=True, eager=True, host=host)
    try:
        return kernel(work_mean, work_var)
    finally:
        _guard.finish(mean, var, work_mean, work_var, token, True, mean)


def computed_stats(module: torch.nn.Module):
    """Copies of the running stats the shim computes with: a half model's FP32 master
    (``keep_fp32="master"``) where it keeps one, else the module's buffers."""
    from amp_bn_fix import _master

    master = _master.peek(module.running_mean, module.running_var)
    stats = (module.running_mean, module.running_var) if master is None else master.unbind()
    return tuple(s.detach().clone() for s in stats)


@contextlib.contextmanager
def shim_disabled() -> Iterator[None]:
    """Within the block, torch as ``amp_bn_fix.disable()`` leaves it (the reference the shim is
    compared with); afterwards enabled again if it was, even if the block raises."""
    import amp_bn_fix

    was_enabled = amp_bn_fix.is_enabled()
    amp_bn_fix.disable()
    try:
        yield
    finally:
        if was_enabled:
            amp_bn_fix.enable()
