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
import multiprocessing.util
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _state
from ._frames import stacklevel_outside


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
    """What the guard decided for one running mean.

    Each change is one assignment (an attribute, or an item appended), so a change stopped
    half-way (Ctrl-C, a signal handler's own report(), a fork from another thread) counts nothing
    twice and loses nothing.
    """

    __slots__ = ("ref", "host_skips", "device", "streams", "label")

    def __init__(self, running_mean: Optional[torch.Tensor]) -> None:
        # None: a record that adds up those of running means that died (:func:`_retire_dead`).
        self.ref = weakref.ref(running_mean) if running_mean is not None else _no_tensor
        self.host_skips = 0
        # The decisions made on a device: the 0-dim bool device tensors (True where the update was
        # kept) not summed yet, each a check; the sum of those that were (None before the first);
        # and how many checks that sum holds. Appended to (a check, in one step), and replaced
        # whole by :meth:`fold`.
        self.device: Tuple[List[torch.Tensor], Optional[torch.Tensor], int] = ([], None, 0)
        # The CUDA streams that wrote those flags or that sum (empty on CPU).
        self.streams: FrozenSet[Any] = frozenset()
        self.label: Optional[str] = None

    def skips(self) -> int:
        """Reads the device's decisions (a sync): only :func:`snapshot` calls it."""
        kept, checks = self.fold()
        return self.host_skips + checks - (int(kept.item()) if kept is not None else 0)

    def fold(self) -> Tuple[Optional[torch.Tensor], int]:
        """Sum the decisions not summed yet, on the device (no sync): the kept updates, and the checks."""
        flags, kept, checks = self.device
        if self.streams:  # CUDA: flags, or a sum, written on some stream
            self.streams = _after_streams(self.streams, flags or [kept])
        if flags:
            # Out of place: a sum made under ``torch.inference_mode()`` is an inference tensor,
            # which no later call outside it may change in place.
            total = torch.stack(flags).sum()
            kept, checks = (total if kept is None else kept + total), checks + len(flags)
            self.device = [], kept, checks
        return kept, checks


def _added_up(records: Sequence[_GuardRecord]) -> _GuardRecord:
    """A new record holding the decisions of ``records`` (made on one device), which stay as they were."""
    total = _GuardRecord(None)
    kept: Optional[torch.Tensor] = None
    checks = 0
    for record in records:
        mine, its_checks = record.fold()
        total.streams |= record.streams
        total.host_skips += record.host_skips
        checks += its_checks
        if mine is not None:
            kept = mine if kept is None else kept + mine
    total.device = [], kept, checks
    return total


class _Records(NamedTuple):
    """The guard's records. Replaced whole, in one assignment, wherever a record moves from one to
    another, so that a move stopped half-way leaves them as they were."""

    # id(running_mean) -> its record; a new running mean's is added in place (one step).
    alive: Dict[int, _GuardRecord]
    # The decisions of running means that died, one record per device they were kept on ("" for
    # decisions made on the host only): they still count, under one name.
    deleted: Dict[str, _GuardRecord]
    # Records of dead running means not added to ``deleted`` yet: adding takes device ops, which
    # wait while a CUDA graph is captured.
    dead: Tuple[_GuardRecord, ...]


_records = _Records({}, {}, ())
DELETED = "running stats no longer alive"
_sweep_at = _MIN_SWEEP
_warned = False


def _after_streams(streams: FrozenSet[Any], tensors: List[Optional[torch.Tensor]]) -> FrozenSet[Any]:
    """Order the current CUDA stream after ``streams``, which wrote ``tensors`` (flags made in a
    warm-up on a side stream, say): the sum about to run on it must see them, and the allocator
    must not hand their memory back to those streams before it has. The current stream is then the
    one that writes the sum: the streams to remember from now on."""
    current = _cuda.current_stream(tensors[0].device)  # type: ignore[union-attr]
    others = [stream for stream in streams if stream != current]
    if not others:
        return streams
    for stream in others:
        current.wait_stream(stream)
    for tensor in tensors:
        tensor.record_stream(current)  # type: ignore[union-attr]
    return frozenset((current,))


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
    alive = _records.alive
    record = alive.get(key)
    if record is not None and record.ref() is running_mean:
        return record
    new = _GuardRecord(running_mean)
    if record is None:
        if len(alive) >= _sweep_at:
            _sweep()
        _records.alive[key] = new
    else:  # a dead tensor's id, taken by a new one: the dead one's record retires in the same step
        _renew({**alive, key: new}, (record,))
    return new


def _renew(alive: Dict[int, _GuardRecord], retiring: Tuple[_GuardRecord, ...]) -> None:
    """The live records replaced by ``alive`` and ``retiring`` added to the dead ones, in one
    assignment; then the dead ones retired (a later call does, while a graph is captured)."""
    global _records
    _records = _Records(alive, _records.deleted, (*_records.dead, *retiring))
    _retire_dead()


def moved(old: torch.Tensor, new: torch.Tensor) -> None:
    """``new`` took the place of the running mean ``old`` (a cast): the record of ``old``, if any,
    goes on as that of ``new``."""
    with _state.record_lock:
        alive = _records.alive
        record = alive.get(id(old))
        taken = alive.get(id(new))  # a dead tensor's, at the id the new one took
        if record is None or record.ref() is not old or (taken is not None and taken.ref() is new):
            return
        kept = {key: other for key, other in alive.items() if key != id(old)}
        kept[id(new)] = record
        record.ref = weakref.ref(new)
        _renew(kept, () if taken is None else (taken,))


@contextlib.contextmanager
def holding(running_mean: torch.Tensor) -> Iterator[None]:
    """Within the block, the record of ``running_mean`` (if any) holds it without a weak reference,
    and takes one again after: torch's swap of a tensor's contents (``torch.utils.swap_tensors``)
    refuses a tensor that has one."""
    with _state.record_lock:
        record = _records.alive.get(id(running_mean))
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


def _retire_dead() -> None:
    """Add the dead running means' records to those of their devices in ``deleted``, once no graph is captured."""
    global _records
    alive, deleted, dead = _records
    if not dead or capturing():
        return
    by_device: Dict[str, List[_GuardRecord]] = {}
    for record in (*deleted.values(), *dead):
        kept, _ = record.fold()
        by_device.setdefault("" if kept is None else str(kept.device), []).append(record)
    _records = _Records(alive, {device: _added_up(records) for device, records in by_device.items()}, ())


def _sweep() -> None:
    """Retire the records of running means that died (a later call does, while a graph is captured)."""
    global _sweep_at
    if capturing():
        return
    kept: Dict[int, _GuardRecord] = {}
    died: List[_GuardRecord] = []
    for key, record in _records.alive.items():
        if record.ref() is None:  # asked once: the tensor may die meanwhile, and is retired later
            died.append(record)
        else:
            kept[key] = record
    _sweep_at = max(_MIN_SWEEP, 2 * len(kept))
    _renew(kept, tuple(died))


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
        flags = record.device[0]
        flags.append(finite)
        if finite.is_cuda:
            record.streams |= {_cuda.current_stream(finite.device)}
        if len(flags) == _FOLD:
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
        # The user's line: the call of the model (or the layer) the skip happened in.
        stacklevel=stacklevel_outside("amp_bn_fix", "torch"),
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
        for key, record in [*((None, r) for r in _records.deleted.values()), *_records.alive.items()]:
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


def summary(record: Optional[Dict[str, Any]] = None) -> str:
    """One line: what :func:`snapshot` holds (``record``: one it returned)."""
    if record is None:
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
    """Write :func:`summary` to stderr at exit (``AMP_BN_FIX_REPORT=1``), once however often asked.

    At the interpreter's exit (atexit), and where a ``multiprocessing`` child ends: one started by
    fork or forkserver ends with ``os._exit`` after its finalizers, which skips atexit.
    """
    global _summary_registered
    with _state.record_lock:
        if not _summary_registered:
            atexit.register(print_summary)
            _finalize_with_the_child(None)  # this process may be such a child already
            multiprocessing.util.register_after_fork(_summary_registered_at, _finalize_with_the_child)
            _summary_registered = True


def _finalize_with_the_child(_: object) -> None:
    # The lowest priority: after the child's other finalizers. A process that also runs atexit
    # writes the line once (print_summary).
    multiprocessing.util.Finalize(None, print_summary, exitpriority=-(2 ** 31))


class _Token:
    """What ``multiprocessing.util.register_after_fork`` keeps the summary's registration under."""


_summary_registered = False
_summary_registered_at = _Token()
# The process that wrote the summary (a forked child inherits the parent's value, and writes its own).
_summary_written_by: Optional[int] = None


def print_summary() -> None:
    """Write :func:`summary` to stderr, once per process (registered by ``AMP_BN_FIX_REPORT=1``).

    A ``multiprocessing`` child where the shim saw no call (a DataLoader worker) writes nothing.
    """
    global _summary_written_by
    if _summary_written_by == os.getpid():
        return
    _summary_written_by = os.getpid()
    try:
        record = snapshot()
        if multiprocessing.parent_process() is None or record["handled"] or record["passed_through"]:
            sys.stderr.write(summary(record) + "\n")
    except Exception:  # a process in its last breath: the summary is not worth a traceback
        pass


def reset() -> None:
    """Forget every count and guard record: the record of this process starts again."""
    global _records, _warned
    with _state.record_lock:
        ended, registered = _threads
        for counts in (ended, *(counts for _, counts in registered)):
            counts.clear()
        _records = _Records({}, {}, ())
        _warned = False


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    # A forked child (a DataLoader worker, a multiprocessing child) counts what it does itself: what
    # the parent did is the parent's to report. Registered after ``_state``'s, which gives the
    # child locks of its own first; the parent's devices' tensors are not the child's to read.
    os.register_at_fork(after_in_child=reset)
