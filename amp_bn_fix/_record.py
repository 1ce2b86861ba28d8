"""The record of what the shim did: counters kept without a host-device sync, read on demand.

Calls are counted on the host where the wrapper decides (an integer increment). The guard's
decisions are counted where they are made: on the host for CPU tensors, and for tensors on a
device in a 0-dim device tensor per running mean, added to without a sync and read only by
:func:`snapshot`. Only plain eager calls are counted: traced and compiled code runs without the
wrapper's Python (its calls are counted while tracing, not when the compiled code runs).
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from typing import Any, Dict, List, Optional, Union

import torch


class _Counts:
    __slots__ = ("passed", "handled")

    def __init__(self) -> None:
        self.passed = 0
        self.handled: Dict[str, int] = {}


counts = _Counts()
# id(running_mean) -> [weak reference to it, host count, device count or None, label or None]
_skips: Dict[int, List[Any]] = {}
_warned = False


def handled(policy: str) -> None:
    counts.handled[policy] = counts.handled.get(policy, 0) + 1


def guard_checked(running_mean: torch.Tensor, finite: Union[bool, torch.Tensor]) -> None:
    """The guard's decision for one call (``_policy.GuardCheck``): a skip when ``finite`` is False."""
    if finite is True:
        return
    key = id(running_mean)
    entry = _skips.get(key)
    if entry is None or entry[0]() is not running_mean:
        entry = _skips[key] = [weakref.ref(running_mean), 0, None, None]
    if finite is False:
        entry[1] += 1
        _warn_first_skip(running_mean, entry)
    else:
        skipped = torch.logical_not(finite).to(torch.int64)
        entry[2] = skipped if entry[2] is None else entry[2].add_(skipped)


def _label(running_mean: torch.Tensor) -> str:
    """The module that holds ``running_mean``, found once (a search of the live objects)."""
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    # type(), not isinstance(): some live objects are proxies whose __class__ warns or fails
    # (a dead weakref.proxy raises ReferenceError); a BatchNorm's own __dict__ is read directly.
    for obj in gc.get_objects():
        if issubclass(type(obj), batch_norm) and obj.__dict__.get("_buffers", {}).get("running_mean") is running_mean:
            return f"{type(obj).__name__}({obj.num_features}) at {id(obj):#x}"
    return f"F.batch_norm's running stats ({running_mean.numel()} channels) at {id(running_mean):#x}"


def _warn_first_skip(running_mean: torch.Tensor, entry: List[Any]) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    entry[3] = entry[3] or _label(running_mean)
    warnings.warn(
        f"amp_bn_fix: the guard left the running stats of {entry[3]} as they were: this batch's "
        "statistics were not finite (inf or NaN). Further skips are counted, not reported: see amp_bn_fix.report()",
        RuntimeWarning,
        stacklevel=2,
    )


def snapshot(model: Optional[torch.nn.Module] = None) -> Dict[str, Any]:
    """The counters now; reading device counters syncs with those devices (only here).

    ``model`` names the guard's skips by module path (``"layer1.0.bn1"``) where its BatchNorms hold
    the running means; others are named by type and address.
    """
    names = {}
    if model is not None:
        names = {id(m.running_mean): name for name, m in model.named_modules()
                 if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None}
    skips: Dict[str, int] = {}
    for key, entry in list(_skips.items()):
        ref, host, device, label = entry
        stat = ref()
        if stat is None and not host and device is None:
            continue
        total = host + (int(device.item()) if device is not None else 0)
        if total:
            if label is None:  # found once: the search walks every live object
                label = entry[3] = _label(stat) if stat is not None else f"a deleted module ({key:#x})"
            name = names.get(key) or label
            skips[name] = skips.get(name, 0) + total
    return {"handled": dict(counts.handled), "passed_through": counts.passed, "guard_skips": skips}


def summary() -> str:
    """One line: what :func:`snapshot` holds."""
    record = snapshot()
    per_policy = ", ".join(f"{n} {p}" for p, n in sorted(record["handled"].items())) or "none"
    skips = sum(record["guard_skips"].values())
    where = f" ({', '.join(f'{n} in {m}' for m, n in record['guard_skips'].items())})" if skips else ""
    return (f"amp_bn_fix: calls handled: {per_policy}; passed through: {record['passed_through']}; "
            f"guard skips: {skips}{where}")


def print_summary() -> None:
    """Write :func:`summary` to stderr (registered with atexit by ``AMP_BN_FIX_REPORT=1``)."""
    try:
        sys.stderr.write(summary() + "\n")
    except Exception:  # a process in its last breath: the summary is not worth a traceback
        pass


def reset() -> None:
    global _warned
    counts.passed = 0
    counts.handled.clear()
    _skips.clear()
    _warned = False
