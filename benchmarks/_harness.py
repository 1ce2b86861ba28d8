"""Timing two candidates side by side, the shim's settings for a measurement, and one run's records.

Every timed figure is a ratio of two candidates measured in interleaved pairs (A B, B A, A B, ...),
each sample timing a number of calls; the ratio reported is the median of the per-pair ratios,
with its interquartile range, so a busy machine slows both sides alike. Only the shim's public API
is used (``enable``, ``disable``, ``configure``), plus ``amp_bn_fix.testing.device_route()`` where
that module exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import statistics
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import amp_bn_fix

# --- timing -----------------------------------------------------------------------------------

# A timer runs ``fn`` ``calls`` times and returns the microseconds per call.
Timer = Callable[[Callable[[], object], int], float]


def host_timer(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def cuda_timer(fn: Callable[[], object], calls: int) -> float:
    """Device time between two CUDA events around the calls (launch-bound calls: the host's pace)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # samples must not overlap the previous one's queued work
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def timer_for(device: str) -> Timer:
    return cuda_timer if device == "cuda" else host_timer


@dataclasses.dataclass
class Timing:
    """Two candidates measured side by side; times in microseconds per call."""

    a_us: float
    b_us: float
    ratio: float  # median of the per-pair ratios a/b
    ratio_q1: float
    ratio_q3: float
    a_iqr_us: Tuple[float, float]
    b_iqr_us: Tuple[float, float]
    samples: int


def quartiles(values: Sequence[float]) -> Tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _nothing() -> None:
    pass


def compare(a: Callable[[], object], b: Callable[[], object], rounds: int, calls: int, timer: Timer = host_timer,
            setup_a: Callable[[], None] = _nothing, setup_b: Callable[[], None] = _nothing, warmup: int = 2) -> Timing:
    """Time ``a`` against ``b``: ``rounds`` pairs in alternating order, ``calls`` calls per sample.

    ``setup_a``/``setup_b`` run untimed before each of their samples (enabling the shim, say);
    ``warmup`` untimed samples of each come first (allocator, caches, lazy initialisation).
    """

    def sample(fn: Callable[[], object], setup: Callable[[], None]) -> float:
        setup()
        return timer(fn, calls)

    for fn, setup in ((a, setup_a), (b, setup_b)):
        for _ in range(warmup):
            sample(fn, setup)
    times_a: List[float] = []
    times_b: List[float] = []
    for i in range(rounds):
        if i % 2:
            times_b.append(sample(b, setup_b))
            times_a.append(sample(a, setup_a))
        else:
            times_a.append(sample(a, setup_a))
            times_b.append(sample(b, setup_b))
    return timing_of(times_a, times_b)


def timing_of(times_a: Sequence[float], times_b: Sequence[float]) -> Timing:
    ratios = [x / y for x, y in zip(times_a, times_b)]
    qa, qb, qr = quartiles(times_a), quartiles(times_b), quartiles(ratios)
    return Timing(qa[1], qb[1], qr[1], qr[0], qr[2], (qa[0], qa[2]), (qb[0], qb[2]), len(ratios))


# --- the shim's settings ----------------------------------------------------------------------


@contextlib.contextmanager
def settings(**changes: Any) -> Iterator[None]:
    """The shim's process-wide settings changed (``configure`` keywords) for the body, then restored."""
    previous = amp_bn_fix.configure(**changes)
    try:
        yield
    finally:
        amp_bn_fix.configure(**previous)


@contextlib.contextmanager
def shim(enabled: bool, **changes: Any) -> Iterator[None]:
    """The shim enabled or disabled, with ``changes`` to its settings, for the body; then as before."""
    was_enabled = amp_bn_fix.is_enabled()
    with settings(**changes):
        try:
            (amp_bn_fix.enable if enabled else amp_bn_fix.disable)()
            yield
        finally:
            (amp_bn_fix.enable if was_enabled else amp_bn_fix.disable)()


def switch(enabled: bool, **changes: Any) -> Callable[[], None]:
    """A setup for :func:`compare`: enable (with ``changes`` to the settings) or disable the shim.

    Without ``changes`` only the patch is switched, so the settings in force (a :func:`settings`
    block around the comparison) stay as they are; changing them per sample would cost a reset of
    torch.compile's caches each time.
    """

    def run() -> None:
        if changes:
            amp_bn_fix.configure(**changes)
        (amp_bn_fix.enable if enabled else amp_bn_fix.disable)()

    return run


ON, OFF = switch(True), switch(False)


def device_path_unavailable() -> Optional[str]:
    """Why the device-path variant cannot run here, or None when it can."""
    try:
        importlib.import_module("amp_bn_fix.testing").device_route
    except (ImportError, AttributeError):
        return "amp_bn_fix.testing.device_route does not exist in this version"
    return None


@contextlib.contextmanager
def device_path() -> Iterator[None]:
    """CPU calls take the path a CUDA call takes (``amp_bn_fix.testing.device_route()``) in the body."""
    reason = device_path_unavailable()
    if reason is not None:
        raise Skip(reason)
    with importlib.import_module("amp_bn_fix.testing").device_route():
        yield


# --- one run's records ------------------------------------------------------------------------


class Skip(Exception):
    """A row that cannot run here (no such device, an absent module): recorded as a note."""


@dataclasses.dataclass
class Row:
    """A timed comparison: A against B."""

    row: str  # the benchmark row (``--only`` name) that measured it
    section: str
    name: str
    a: str
    b: str
    timing: Timing
    threads: int
    note: str = ""
    target: str = ""  # printed next to the ratio, never asserted


@dataclasses.dataclass
class Figure:
    """A counted or measured quantity of A and of B (ATen ops, MiB), not a time."""

    row: str
    section: str
    name: str
    a: str
    b: str
    a_value: Optional[float]
    b_value: Optional[float]
    unit: str
    threads: int
    note: str = ""
    target: str = ""
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def extra(self) -> Optional[float]:
        return None if self.a_value is None or self.b_value is None else self.a_value - self.b_value


def fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.2f} us"


def fmt_value(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


class Bench:
    """The settings of one run and everything it has recorded so far."""

    def __init__(self, device: str, quick: bool):
        self.device = device
        self.quick = quick
        self.timer: Timer = timer_for(device)
        self.rows: List[Row] = []
        self.figures: List[Figure] = []
        self.notes: List[str] = []
        self.errors: List[Dict[str, str]] = []
        self.extra: Dict[str, Any] = {}
        self.current = ""  # the row being run

    def rounds(self, full: int) -> int:
        """Pairs per comparison: ``full``, or a handful in quick mode."""
        return max(3, full // 5) if self.quick else full

    def compare(self, a: Callable[[], object], b: Callable[[], object], full_rounds: int, calls: int,
                setup_a: Callable[[], None] = _nothing, setup_b: Callable[[], None] = _nothing,
                timer: Optional[Timer] = None) -> Timing:
        """:func:`compare` with this run's rounds, warm-up and timer (the device's, unless given)."""
        return compare(a, b, self.rounds(full_rounds), calls, timer or self.timer, setup_a, setup_b,
                       warmup=1 if self.quick else 2)

    def add(self, section: str, name: str, a: str, b: str, timing: Timing, note: str = "", target: str = "") -> Row:
        row = Row(self.current, section, name, a, b, timing, torch.get_num_threads(), note, target)
        self.rows.append(row)
        t = timing
        print(f"  {row.threads:>2}t {section:<8} {name:<52} {fmt_us(t.a_us):>10} {fmt_us(t.b_us):>10}  "
              f"{a} / {b} {t.ratio:.3f} [{t.ratio_q1:.3f}, {t.ratio_q3:.3f}]"
              + (f"  target {target}" if target else "") + (f"  ({note})" if note else ""), flush=True)
        return row

    def add_figure(self, section: str, name: str, a: str, b: str, a_value: Optional[float], b_value: Optional[float],
                   unit: str, note: str = "", target: str = "", **detail: Any) -> Figure:
        figure = Figure(self.current, section, name, a, b, a_value, b_value, unit, torch.get_num_threads(), note,
                        target, detail)
        self.figures.append(figure)
        extra = figure.extra
        print(f"  {figure.threads:>2}t {section:<8} {name:<52} {a} {fmt_value(a_value)} {unit}, {b} {fmt_value(b_value)}"
              + (f" ({extra:+.0f})" if extra is not None and unit == "ops" else "")
              + (f"  target {target}" if target else "") + (f"  ({note})" if note else ""), flush=True)
        return figure

    def note(self, text: str) -> None:
        self.notes.append(f"{self.current}: {text}" if self.current else text)
        print(f"[{self.current}] note: {text}" if self.current else f"note: {text}", flush=True)

    def run_row(self, name: str, run: Callable[["Bench"], None]) -> None:
        """Run one benchmark row; a failure is recorded and the run goes on.

        The shim's state and settings are put back afterwards, so no row sees what another left.
        """
        self.current = name
        start = time.perf_counter()
        try:
            with shim(amp_bn_fix.is_enabled()):
                run(self)
        except Skip as why:
            self.note(f"skipped: {why}")
        except Exception as error:  # noqa: BLE001  one broken row must not lose the others' figures
            traceback.print_exc()
            self.errors.append({"row": name, "threads": str(torch.get_num_threads()),
                                "error": f"{type(error).__name__}: {error}"})
            print(f"  ERROR in {name}: {type(error).__name__}: {error}", flush=True)
        finally:
            print(f"[{name}] done in {time.perf_counter() - start:.1f} s", flush=True)
            self.current = ""


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_sweep(requested: Optional[Sequence[int]]) -> List[int]:
    """The torch thread counts to run: ``requested``, or 1, 2 and every CPU available (no duplicates)."""
    counts = requested or [n for n in (1, 2, available_cpus()) if n <= available_cpus()]
    return sorted(set(counts))
