"""The record of what the shim did: counters kept without a host-device sync, read on demand.

Calls are counted on the host where the wrapper decides: an integer increment into the deciding
thread's own counts, with no lock, added up when read. The guard's decisions are counted where
they are made: skips decided on the host there; decisions made on a device are kept as the 0-dim
device tensors they are (summed on the device every few dozen calls, no sync) next to a host count
of checks, and only :func:`snapshot` reads them and derives the skips. On CUDA the sum runs on the
stream current when it is made, ordered after every stream that made a flag it sums (a warm-up on
a side stream). Only plain eager calls are counted: traced and compiled code runs without the
wrapper's Python (its calls are counted while tracing, not when the compiled code runs).

CUDA graphs likewise: a call made while the current CUDA stream is capturing a graph is counted
once, as handled and under ``captured``, and its replays are not counted. The guard's decision in
such a call is left out altogether: at capture nothing is computed yet, and at each replay the
device makes a decision that no host code is there to count. So while a graph is captured the
record makes no device op of its own (no decision kept, no sum folded): a captured op would run
again at every replay.

What is kept stays bounded when running stats are new tensors on every call (``nn.DataParallel``'s
replicas, functional code): the records of stats that died are folded, now and then, into one
record per device.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

from . import _state


class _Counts:
    """Calls counted by one thread, or by threads that ended."""

    __slots__ = ("passed", "handled", "captured")

    def __init__(self) -> None:
        self.passed = 0
        self.handled: Dict[str, int] = {}
        # The handled calls made while a CUDA graph was captured, by what they did (also in ``handled``).
        self.captured: Dict[str, int] = {}

    def absorb(self, other: "_Counts") -> None:
        self.passed += other.passed
        for mine, theirs in ((self.handled, other.handled), (self.captured, other.captured)):
            # A copy first, made in one step: the thread that owns ``other`` may add a key meanwhile.
            for name, calls in theirs.copy().items():
                mine[name] = mine.get(name, 0) + calls

    def clear(self) -> None:
        self.passed = 0
        self.handled.clear()
        self.captured.clear()


class _ThreadEnd:
    """Lives as long as its thread's counts are the thread's: dropped with the thread's local storage."""


class _ThreadCounts(threading.local):
    """Each thread counts into counts of its own, with no lock: a lock taken and released at every
    call cost as much as the rest of a call the shim passes to torch. :func:`snapshot` adds them up
    holding ``_state.record_lock``.

    A thread's counts are registered at its first count, with a weak reference to a sentinel that
    dies with the thread's local storage; the counts of threads that ended are folded into one at
    a snapshot and as threads come (:func:`_folded`). Nothing runs when a thread ends: in a child
    of ``os.fork``, the parent's other threads end inside the fork, before any at-fork handler has
    made the child locks of its own.
    """

    def __init__(self) -> None:
        global _threads
        self.counts = counts = _Counts()
        self._end = end = _ThreadEnd()
        with _state.record_lock:
            ended, live = _folded() if len(_threads[1]) >= _threads_sweep_at else _threads
            _threads = ended, (*live, (weakref.ref(end), counts))


Registered = Tuple["weakref.ReferenceType[_ThreadEnd]", _Counts]


def _folded() -> Tuple[_Counts, Tuple[Registered, ...]]:
    """:data:`_threads` with the counts of the threads that ended folded into the first, made aside
    (with ``_state.record_lock`` held)."""
    global _threads_sweep_at
    before, registered = _threads
    ended, alive = _Counts(), []
    ended.absorb(before)
    for entry in registered:
        if entry[0]() is None:  # asked once: the thread may end meanwhile
            ended.absorb(entry[1])
        else:
            alive.append(entry)
    _threads_sweep_at = max(_MIN_SWEEP, 2 * len(alive))
    return ended, tuple(alive)


# The counts of the threads that ended and were folded, and those of the threads registered since
# (each with its sentinel's reference, dead once the thread ended). Replaced whole, in one
# assignment: a fold stopped half-way (Ctrl-C, a signal handler's own report(), a fork from another
# thread) leaves them as they were.
_threads: Tuple[_Counts, Tuple[Registered, ...]] = (_Counts(), ())
# What died (threads here, running means' guard records below) is looked for once what is kept has
# doubled since the last look, and not below this many.
_MIN_SWEEP = 64
_threads_sweep_at = _MIN_SWEEP
_mine = _ThreadCounts()
# The device route's decisions are kept as they come and summed every this many: one stack and
# one sum on the device per _FOLD calls, instead of an add per call.
_FOLD = 64

_cuda = torch.cuda


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph: the ops issued now are recorded to
    run at each replay, and no Python runs then. False, with no query, until CUDA is initialised
    (a graph needs CUDA tensors; without CUDA in the build, ``is_current_stream_capturing`` raises).
    """
    return _cuda._initialized and _cuda.is_current_stream_capturing()


def _no_tensor() -> None:
    return None


class _GuardRecord:
    """What the guard decided for one running mean."""

    __slots__ = ("ref", "host_skips", "device_checks", "device_flags", "device_kept", "streams", "label")

    def __init__(self, running_mean: Optional[torch.Tensor]) -> None:
        # None: the record of running means that died (``_deleted``).
        self.ref = weakref.ref(running_mean) if running_mean is not None else _no_tensor
        self.host_skips = 0
        self.device_checks = 0
        # 0-dim bool device tensors not summed yet, and the sum of those that were.
        self.device_flags: List[torch.Tensor] = []
        self.device_kept: Optional[torch.Tensor] = None
        # The CUDA streams that wrote those flags or ``device_kept`` (empty on CPU).
        self.streams: Set[Any] = set()
        self.label: Optional[str] = None

    def skips(self) -> int:
        """Reads the device's decisions (a sync): only :func:`snapshot` calls it."""
        self.fold()
        kept = int(self.device_kept.item()) if self.device_kept is not None else 0
        return self.host_skips + self.device_checks - kept

    def fold(self) -> None:
        """Sum the decisions not summed yet into ``device_kept``, on the device (no sync)."""
        flags = self.device_flags
        if self.streams:  # CUDA: flags, or a sum, written on some stream
            _after_streams(self.streams, flags or [self.device_kept])
        if flags:
            kept = torch.stack(flags).sum()
            # Out of place: a sum made under ``torch.inference_mode()`` is an inference tensor,
            # which no later call outside it may change in place.
            self.device_kept = kept if self.device_kept is None else self.device_kept + kept
            flags.clear()

    def absorb(self, other: "_GuardRecord") -> None:
        """Add ``other``'s decisions (made on this record's device) to this record's."""
        self.fold()
        other.fold()
        self.streams |= other.streams
        self.host_skips += other.host_skips
        self.device_checks += other.device_checks
        if other.device_kept is not None:
            self.device_kept = other.device_kept if self.device_kept is None else self.device_kept + other.device_kept


# id(running_mean) -> its record
_guard: Dict[int, _GuardRecord] = {}
# The decisions for running means that died, one record per device their decisions were kept on
# ("" for decisions made on the host only): they still count, under one name.
_deleted: Dict[str, _GuardRecord] = {}
DELETED = "running stats no longer alive"
_sweep_at = _MIN_SWEEP
_warned = False
# Records of dead running means not yet added to ``_deleted``: that takes device ops, which wait
# while a CUDA graph is captured.
_dead: List[_GuardRecord] = []


def _after_streams(streams: Set[Any], tensors: List[torch.Tensor]) -> None:
    """Order the current CUDA stream after ``streams``, which wrote ``tensors`` (flags made in a
    warm-up on a side stream, say): the sum about to run on it must see them, and the allocator
    must not hand their memory back to those streams before it has. The current stream is then the
    one that writes the sum."""
    current = _cuda.current_stream(tensors[0].device)
    others = [stream for stream in streams if stream != current]
    if others:
        for stream in others:
            current.wait_stream(stream)
        for tensor in tensors:
            tensor.record_stream(current)
        streams.clear()
        streams.add(current)


def passed() -> None:
    _mine.counts.passed += 1


def handled(counted_as: str) -> None:
    counts = _mine.counts
    counts.handled[counted_as] = counts.handled.get(counted_as, 0) + 1
    # capturing(), written out: a Python frame less on every handled call.
    if _cuda._initialized and _cuda.is_current_stream_capturing():
        counts.captured[counted_as] = counts.captured.get(counted_as, 0) + 1


def _counted() -> _Counts:
    """Every thread's counts, added up (with ``_state.record_lock`` held)."""
    global _threads
    _threads = ended, registered = _folded()
    total = _Counts()
    total.absorb(ended)
    for _, counts in registered:
        total.absorb(counts)
    return total


# The records' helpers below run with ``_state.record_lock`` held by their callers.


def _record_of(running_mean: torch.Tensor) -> _GuardRecord:
    key = id(running_mean)
    record = _guard.get(key)
    if record is None or record.ref() is not running_mean:
        if record is not None:  # a dead tensor's id, taken by a new one
            _retire(record)
        elif len(_guard) >= _sweep_at:
            _sweep()
        record = _guard[key] = _GuardRecord(running_mean)
    return record


@contextlib.contextmanager
def holding(running_mean: torch.Tensor) -> Iterator[None]:
    """Within the block, the record of ``running_mean`` (if any) holds it without a weak reference,
    and takes one again after: torch's swap of a tensor's contents (``torch.utils.swap_tensors``)
    refuses a tensor that has one."""
    with _state.record_lock:
        record = _guard.get(id(running_mean))
        if record is None or record.ref() is not running_mean:
            record = None
        else:
            record.ref = lambda: running_mean
    if record is None:
        yield
        return
    try:
        yield
    finally:
        with _state.record_lock:
            record.ref = weakref.ref(running_mean)


def _retire(record: _GuardRecord) -> None:
    """Add a dead running mean's record to the one of its device in ``_deleted`` (once no graph is captured)."""
    _dead.append(record)
    if not capturing():
        _retire_dead()


def _retire_dead() -> None:
    while _dead:
        record = _dead.pop()
        record.fold()
        device = "" if record.device_kept is None else str(record.device_kept.device)
        aggregate = _deleted.get(device)
        if aggregate is None:
            aggregate = _deleted[device] = _GuardRecord(None)
        aggregate.absorb(record)


def _sweep() -> None:
    """Fold the records of running means that died into ``_deleted``."""
    global _sweep_at
    if capturing():  # a later call sweeps
        return
    for key, record in list(_guard.items()):
        if record.ref() is None:
            del _guard[key]
            _retire(record)
    _sweep_at = max(_MIN_SWEEP, 2 * len(_guard))


def skipped(running_mean: torch.Tensor) -> None:
    """The guard, deciding on the host, left ``running_mean`` (and its variance) as they were."""
    with _state.record_lock:
        record = _record_of(running_mean)
        record.host_skips += 1
    _warn_first_skip(running_mean, record)


def checked_on_device(running_mean: torch.Tensor, finite: torch.Tensor) -> None:
    """The guard decided on the device (``finite``, a 0-dim bool tensor, True where it updated).

    Nothing is read here; :func:`snapshot` derives the skips from the checks and the kept updates.
    A decision captured into a CUDA graph is not kept: ``finite`` holds nothing yet, and each
    replay rewrites it without counting a check (the call is counted under ``captured``).
    """
    if capturing():
        return
    with _state.record_lock:
        record = _record_of(running_mean)
        record.device_checks += 1
        record.device_flags.append(finite)
        if finite.is_cuda:
            record.streams.add(_cuda.current_stream(finite.device))
        if len(record.device_flags) == _FOLD:
            record.fold()


def _label(running_mean: torch.Tensor) -> str:
    """What names ``running_mean`` where no model is given (``report(model)`` names it by path)."""
    return f"the running stats of {running_mean.numel()} channels at {id(running_mean):#x}"


def _warn_first_skip(running_mean: torch.Tensor, record: _GuardRecord) -> None:
    global _warned
    with _state.record_lock:
        if _warned:
            return
        _warned = True
        record.label = record.label or _label(running_mean)
    warnings.warn(
        f"amp_bn_fix: the guard left {record.label} as they were: this batch's statistics were not finite "
        "(inf or NaN). Further skips are counted, not reported: see amp_bn_fix.report(model), which names "
        "the module",
        RuntimeWarning,
        stacklevel=2,
    )


def snapshot(model: Optional[torch.nn.Module] = None) -> Dict[str, Any]:
    """The counters now; reading device counters syncs with those devices (only here).

    ``model`` names the guard's skips by module path (``"layer1.0.bn1"``) where its BatchNorms or
    InstanceNorms hold the running means; others are named by type and address. ``"captured"`` is
    there once a handled call was made while a CUDA graph was captured: what such calls did, per
    policy (they are in ``"handled"`` too, once; their replays are counted nowhere, and neither are
    their guard decisions).

    Raises:
        RuntimeError: a CUDA graph is being captured, which forbids reading the device.
    """
    if capturing():
        raise RuntimeError(
            "amp_bn_fix.report() reads the guard's counters from the device, which is not allowed while a "
            "CUDA graph is captured: call it outside the captured region")
    names = {}
    if model is not None:
        names = {id(m.running_mean): name or type(m).__name__ for name, m in model.named_modules()
                 if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.running_mean is not None}
    skips: Dict[str, int] = {}
    with _state.record_lock:
        _retire_dead()
        for key, record in [*((None, r) for r in _deleted.values()), *_guard.items()]:
            stat = record.ref()
            total = record.skips()
            if total:
                if stat is None:
                    name = DELETED
                else:
                    record.label = record.label or _label(stat)
                    name = names.get(key) or record.label
                skips[name] = skips.get(name, 0) + total
        counts = _counted()
        found = {"handled": counts.handled, "passed_through": counts.passed, "guard_skips": skips}
        if counts.captured:
            found["captured"] = counts.captured
    return found


def summary() -> str:
    """One line: what :func:`snapshot` holds."""
    record = snapshot()
    per_policy = ", ".join(f"{n} {p}" for p, n in sorted(record["handled"].items())) or "none"
    skips = sum(record["guard_skips"].values())
    where = f" ({', '.join(f'{n} in {m}' for m, n in record['guard_skips'].items())})" if skips else ""
    captured = sum(record.get("captured", {}).values())
    graphs = f"; captured in CUDA graphs: {captured} (their replays are not counted)" if captured else ""
    rank = _rank()
    who = f" (rank {rank})" if rank is not None else ""
    return (f"amp_bn_fix{who}: calls handled: {per_policy}; passed through: {record['passed_through']}; "
            f"guard skips: {skips}{where}{graphs}")


def _rank() -> Optional[str]:
    """This process's rank in a distributed run (its process group's, or torchrun's ``RANK``), if any:
    each rank writes its own summary."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK")


def summary_at_exit() -> None:
    """Write :func:`summary` to stderr at exit (``AMP_BN_FIX_REPORT=1``), once however often asked."""
    global _summary_registered
    with _state.record_lock:
        if not _summary_registered:
            atexit.register(print_summary)
            _summary_registered = True


_summary_registered = False


def print_summary() -> None:
    """Write :func:`summary` to stderr (registered with atexit by ``AMP_BN_FIX_REPORT=1``)."""
    try:
        sys.stderr.write(summary() + "\n")
    except Exception:  # a process in its last breath: the summary is not worth a traceback
        pass


def reset() -> None:
    global _warned
    with _state.record_lock:
        ended, registered = _threads
        for counts in (ended, *(counts for _, counts in registered)):
            counts.clear()
        _guard.clear()
        _deleted.clear()
        _dead.clear()
        _warned = False
