"""The record of what the shim did: counters kept without a host-device sync, read on demand.

Calls are counted on the host where the wrapper decides (an integer increment). The guard's
decisions are counted where they are made: skips decided on the host there; decisions made on a
device are kept as the 0-dim device tensors they are (summed on the device every few dozen calls,
no sync) next to a host count of checks, and only :func:`snapshot` reads them and derives the skips. Only plain eager calls are counted: traced and compiled code runs without the
wrapper's Python (its calls are counted while tracing, not when the compiled code runs).
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch


class _Counts:
    __slots__ = ("passed", "handled")

    def __init__(self) -> None:
        self.passed = 0
        self.handled: Dict[str, int] = {}


counts = _Counts()
# The device route's decisions are kept as they come and summed every this many: one stack and
# one sum on the device per _FOLD calls, instead of an add per call.
_FOLD = 64


class _GuardRecord:
    """What the guard decided for one running mean."""

    __slots__ = ("ref", "host_skips", "device_checks", "device_flags", "device_kept", "label")

    def __init__(self, running_mean: torch.Tensor) -> None:
        self.ref = weakref.ref(running_mean)
        self.host_skips = 0
        self.device_checks = 0
        # 0-dim bool device tensors not summed yet, and the sum of those that were.
        self.device_flags: List[torch.Tensor] = []
        self.device_kept: Optional[torch.Tensor] = None
        self.label: Optional[str] = None

    def skips(self) -> int:
        """Reads the device's decisions (a sync): only :func:`snapshot` calls it."""
        kept = sum(int(flag) for flag in self.device_flags)
        if self.device_kept is not None:
            kept += int(self.device_kept.item())
        return self.host_skips + self.device_checks - kept


# id(running_mean) -> its record
_guard: Dict[int, _GuardRecord] = {}
# Records of running means that died and whose id a new tensor took: their decisions still count.
_retired: List[_GuardRecord] = []
_warned = False


def handled(counted_as: str) -> None:
    counts.handled[counted_as] = counts.handled.get(counted_as, 0) + 1


def _record_of(running_mean: torch.Tensor) -> _GuardRecord:
    key = id(running_mean)
    record = _guard.get(key)
    if record is None or record.ref() is not running_mean:
        if record is not None:
            record.label = record.label or f"a deleted module ({key:#x})"
            _retired.append(record)
        record = _guard[key] = _GuardRecord(running_mean)
    return record


def skipped(running_mean: torch.Tensor) -> None:
    """The guard, deciding on the host, left ``running_mean`` (and its variance) as they were."""
    record = _record_of(running_mean)
    record.host_skips += 1
    _warn_first_skip(running_mean, record)


def checked_on_device(running_mean: torch.Tensor, finite: torch.Tensor) -> None:
    """The guard decided on the device (``finite``, a 0-dim bool tensor, True where it updated).

    Nothing is read here; :func:`snapshot` derives the skips from the checks and the kept updates.
    """
    record = _record_of(running_mean)
    record.device_checks += 1
    flags = record.device_flags
    flags.append(finite)
    if len(flags) == _FOLD:
        kept = torch.stack(flags).sum()
        record.device_kept = kept if record.device_kept is None else record.device_kept.add_(kept)
        flags.clear()


def _label(running_mean: torch.Tensor) -> str:
    """The module that holds ``running_mean``, found once (a search of the live objects)."""
    norm = torch.nn.modules.batchnorm._NormBase  # BatchNorm's and InstanceNorm's
    # type(), not isinstance(): some live objects are proxies whose __class__ warns or fails
    # (a dead weakref.proxy raises ReferenceError); a BatchNorm's own __dict__ is read directly.
    for obj in gc.get_objects():
        if issubclass(type(obj), norm) and obj.__dict__.get("_buffers", {}).get("running_mean") is running_mean:
            return f"{type(obj).__name__}({obj.num_features}) at {id(obj):#x}"
    return f"F.batch_norm's running stats ({running_mean.numel()} channels) at {id(running_mean):#x}"


def _warn_first_skip(running_mean: torch.Tensor, record: _GuardRecord) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    record.label = record.label or _label(running_mean)
    warnings.warn(
        f"amp_bn_fix: the guard left the running stats of {record.label} as they were: this batch's "
        "statistics were not finite (inf or NaN). Further skips are counted, not reported: see amp_bn_fix.report()",
        RuntimeWarning,
        stacklevel=2,
    )


def snapshot(model: Optional[torch.nn.Module] = None) -> Dict[str, Any]:
    """The counters now; reading device counters syncs with those devices (only here).

    ``model`` names the guard's skips by module path (``"layer1.0.bn1"``) where its BatchNorms or
    InstanceNorms hold the running means; others are named by type and address.
    """
    names = {}
    if model is not None:
        names = {id(m.running_mean): name for name, m in model.named_modules()
                 if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.running_mean is not None}
    skips: Dict[str, int] = {}
    for key, record in [*((None, r) for r in _retired), *_guard.items()]:  # retired ones are labelled
        stat = record.ref()
        total = record.skips()
        if total:
            if record.label is None:  # found once: the search walks every live object
                record.label = _label(stat) if stat is not None else f"a deleted module ({key:#x})"
            name = names.get(key) or record.label
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
    _guard.clear()
    _retired.clear()
    _warned = False
