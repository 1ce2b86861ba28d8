"""CUDA graphs, on the route a CUDA call takes: what a capture does once is not done again at replay.

A capture runs the shim's Python once and records the device ops it issues, without running them; a
replay runs those ops again, on the same memory, and no Python at all. Here that is emulated on CPU
(``tests/test_cuda.py`` has the same on a real graph): under ``device_route()`` the call is made
while ``torch.cuda.is_current_stream_capturing()`` says True, a TorchDispatchMode records the ops
it issues and then undoes what they wrote into tensors made before the capture (a capture runs
nothing), and a replay runs the recorded ops again into the very tensors they wrote. A host read of
a tensor's value through an op (``.item()``, ``bool(t)``), which a capture forbids, fails the
recording.

What the shim promises there: a replay adds no count of its own (``report()`` says what it cannot
count: the calls made while capturing are under ``captured``, their guard decisions nowhere), and a
half model's FP32 master is neither seeded again from the rounded buffers at each replay nor
blind to a ``load_state_dict`` between replays.
"""

import contextlib
import copy
import math
from typing import Any, Dict, Iterator, List, Set, Tuple

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import amp_bn_fix
from _shared import shim_disabled
from amp_bn_fix import _compat, _master, _record
from amp_bn_fix.testing import device_route

pytestmark = pytest.mark.usefixtures("fresh_record")
aten = torch.ops.aten
# Allocations are not kernels: a replay does not run them, and what they hand out holds garbage
# (NaN here) until a recorded op writes it.
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}
_HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The tensors ``func`` writes into (its schema's ``Tensor(a!)`` arguments)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


class Graph(TorchDispatchMode):
    """The device ops of a capture, to replay."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[Any, Tuple[Any, ...], Dict[str, Any], Any]] = []
        self.seen: Set[int] = set()  # storages of the tensors the ops were given
        self.made: Set[int] = set()  # storages allocated while capturing (the graph's own memory)
        self.undo: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        assert func not in _HOST_READS, f"{func} reads a tensor on the host: a capture forbids that"
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in _written(func, args, kwargs):
            if _storage(t) not in self.made:
                self.undo.append((t, t.clone()))
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS and out.is_floating_point():
            out.fill_(math.nan)
        self.seen.update(_storage(t) for t in inputs)
        self.made.update(_storage(t) for t in tree_leaves(out)
                         if isinstance(t, torch.Tensor) and _storage(t) not in self.seen)
        self.ops.append((func, args, kwargs, out))
        return out

    def _undo_capture(self) -> None:
        with torch.no_grad():
            for tensor, was in reversed(self.undo):
                tensor.data.copy_(was)

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                if func in _ALLOCATIONS:
                    continue
                if func._schema.is_mutable:  # in place or out=: the same tensors again
                    func(*args, **kwargs)
                    continue
                inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                fresh = func(*args, **kwargs)
                for was, now in zip(tree_leaves(out), tree_leaves(fresh)):
                    if isinstance(was, torch.Tensor) and _storage(was) not in inputs:  # a view needs nothing
                        was.copy_(now)


@contextlib.contextmanager
def captured() -> Iterator[Graph]:
    """The block's device ops, captured as a CUDA graph captures them (run them with ``replay()``)."""
    graph = Graph()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "_initialized", True)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        patch.setattr(_compat, "_dispatch_stack_len", lambda: 0)  # the recorder is not a tracer to the shim
        with graph:
            yield graph
    graph._undo_capture()


@pytest.fixture(autouse=True)
def on_the_device_route():
    with device_route():
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def _batch(seed: int, bad: bool = False) -> torch.Tensor:
    x = 2 + 3 * torch.randn(32, 8, generator=torch.Generator().manual_seed(seed))
    if bad:
        x[5, 3] = float("inf")
    return x.bfloat16()


def _bn() -> nn.BatchNorm1d:
    bn = nn.BatchNorm1d(8)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(0))
        bn.running_var.uniform_(0.5, 2, generator=torch.Generator().manual_seed(1))
    return bn


# ------------------------------------------------------------------------------------ the record


@pytest.mark.parametrize("policy", ["fp32", "input"])
def test_replays_of_non_finite_batches_keep_the_stats_and_add_no_count(policy):
    graphed, eager = _bn(), _bn()
    warm_up, replays = [_batch(0), _batch(1, bad=True)], [_batch(2, bad=True), _batch(3), _batch(4, bad=True)]
    with amp_bn_fix.policy(policy), torch.autocast("cpu", dtype=torch.bfloat16):
        for x in warm_up:
            graphed(x)
            eager(x)
        static = _batch(5)
        with captured() as graph:
            graphed(static)
        for x in replays:
            static.copy_(x)
            before = _bits(graphed.running_mean), _bits(graphed.running_var)
            graph.replay()
            eager(x)
            if x.float().isinf().any():  # the guard held the stats, bit for bit
                assert torch.equal(_bits(graphed.running_mean), before[0])
                assert torch.equal(_bits(graphed.running_var), before[1])
    assert torch.equal(_bits(graphed.running_mean), _bits(eager.running_mean))
    assert torch.equal(_bits(graphed.running_var), _bits(eager.running_var))
    report = amp_bn_fix.report(nn.ModuleDict({"graphed": graphed, "eager": eager}))
    # Replays are counted nowhere; the capture once, as handled and as captured; the guard's
    # decisions by what ran eagerly only (the warm-up's one skip for the graphed module).
    assert report["guard_skips"] == {"graphed": 1, "eager": 3}
    assert report["handled"] == {policy: 2 * len(warm_up) + 1 + len(replays)}
    assert report["captured"] == {policy: 1}


def test_a_fold_of_the_decisions_is_not_captured(monkeypatch):
    # The capture call would be the one whose decision completes a fold: a sum added on the
    # device into the kept count, which every replay would add again.
    monkeypatch.setattr(_record, "_FOLD", 2)
    bn = _bn()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x in (_batch(0), _batch(1), _batch(2, bad=True)):
            bn(x)
        static = _batch(3)
        with captured() as graph:
            bn(static)
        for _ in range(5):
            graph.replay()
    assert amp_bn_fix.report(nn.Sequential(bn))["guard_skips"] == {"0": 1}
    assert not [op for op, *_ in graph.ops if op in (aten.stack.default, aten.sum.default)]  # no fold


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
def test_dead_records_are_not_folded_while_capturing(monkeypatch):
    # A host-route skip during a capture may retire a dead running mean's record: adding its device
    # counts to the deleted ones is a device op, and waits until no graph is captured.
    monkeypatch.setattr(_record, "_FOLD", 1)
    first, second, newcomer = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    _record.checked_on_device(first, torch.tensor(True))  # kept: one check, one kept, no skip
    _record.checked_on_device(second, torch.tensor(True))
    del first
    _record._sweep()  # outside a capture: the dead one's record is retired
    # Python hands the dead tensor's id to a new one (as in test_record).
    alive = _record._records.alive
    alive[id(newcomer)] = alive.pop(id(second))
    with captured() as graph:
        _record.skipped(newcomer)  # decided on the host: counted now, as always
    for _ in range(3):
        graph.replay()
    assert graph.ops == []
    skips = amp_bn_fix.report()["guard_skips"]
    assert list(skips.values()) == [1] and _record.DELETED not in skips


def test_report_refuses_to_read_the_device_while_capturing():
    bn, static = _bn(), _batch(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bn(_batch(0, bad=True))
        with captured() as graph:
            bn(static)
            with pytest.raises(RuntimeError, match="CUDA graph is captured"):
                amp_bn_fix.report()
    graph.replay()
    assert amp_bn_fix.report(nn.Sequential(bn)) == {"handled": {"fp32": 2}, "passed_through": 0,
                                                    "guard_skips": {"0": 1}, "captured": {"fp32": 1}}
    assert _record.summary() == ("amp_bn_fix: calls handled: 2 fp32; passed through: 0; guard skips: 1 (1 in "
                                 f"{_record._label(bn.running_mean)}); captured in CUDA graphs: 1 (their "
                                 "replays are not counted)")


# ------------------------------------------------------------------------------ half models


def _small_shift(step: int) -> torch.Tensor:
    # Updates of a few thousandths a step: below half a bfloat16 step near 2, lost by 16-bit stats.
    return (torch.randn(16, 8, generator=torch.Generator().manual_seed(step)) * 0.05 + 2).bfloat16()


def _half_twins() -> Tuple[nn.Module, nn.Module]:
    """Two BatchNorms cast to bfloat16 from the same FP32 stats: each has its FP32 master."""
    fp32 = _bn()
    with torch.no_grad():
        fp32.running_mean.fill_(2.0)
    return copy.deepcopy(fp32).bfloat16(), copy.deepcopy(fp32).bfloat16()


def _assert_same_stats(graphed: nn.Module, eager: nn.Module, what: str) -> None:
    for name in ("running_mean", "running_var"):
        assert torch.equal(_bits(getattr(graphed, name)), _bits(getattr(eager, name))), f"{what}: {name}"
    got = _master.peek(graphed.running_mean, graphed.running_var)
    want = _master.peek(eager.running_mean, eager.running_var)
    assert got is not None and torch.equal(got, want), f"{what}: the master"


def _reloaded(module: nn.Module, shift: float) -> None:
    state = {k: v.clone() for k, v in module.state_dict().items()}
    state["running_mean"] += shift
    module.load_state_dict(state)


@pytest.mark.parametrize("start", ["reloaded", "fresh copy"])
def test_a_master_captured_is_not_seeded_again_at_each_replay(start):
    # The warm-up leaves a master; the capture finds none that holds (the documented order, where
    # it finds one, is the next test's first part).
    graphed, eager = _half_twins()
    step = iter(range(1000))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):  # the warm-up torch asks for before a capture
            x = _small_shift(next(step))
            graphed(x)
            eager(x)
        if start == "reloaded":  # a checkpoint restored after the warm-up: the master no longer holds
            for module in (graphed, eager):
                _reloaded(module, 0.25)
        elif start == "fresh copy":  # no master at all
            graphed, eager = copy.deepcopy(graphed), copy.deepcopy(eager)
            assert _master.peek(graphed.running_mean, graphed.running_var) is None
        static = _small_shift(0)
        with captured() as graph:
            graphed(static)
        for _ in range(30):
            x = _small_shift(next(step))
            static.copy_(x)
            graph.replay()
            eager(x)
    _assert_same_stats(graphed, eager, start)


def test_a_captured_master_follows_the_buffers_between_replays():
    """The documented order (warm-up, capture, replay), then what changes the buffers between replays:
    ``load_state_dict``, an eager call after it, torch's own update (the policy off), an eval call."""
    graphed, eager = _half_twins()
    step = iter(range(1000))

    def train() -> None:
        x = _small_shift(next(step))
        static.copy_(x)
        graph.replay()
        eager(x)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            x = _small_shift(next(step))
            graphed(x)
            eager(x)
        static = _small_shift(0)
        with captured() as graph:
            graphed(static)
        for _ in range(10):
            train()
        _assert_same_stats(graphed, eager, "replays")
        for module in (graphed, eager):
            _reloaded(module, 0.25)
        for _ in range(10):
            train()
        _assert_same_stats(graphed, eager, "load_state_dict, then replays")
        for module in (graphed, eager):
            _reloaded(module, -0.5)
        x = _small_shift(next(step))
        graphed(x)  # eager, between replays
        eager(x)
        for _ in range(10):
            train()
        _assert_same_stats(graphed, eager, "load_state_dict, an eager call, then replays")
        with amp_bn_fix.policy("off"):  # a batch far from the stats: every update shows in 16 bits
            x = _batch(next(step))[:16]
            graphed(x)
            eager(x)
        for _ in range(10):
            train()
        _assert_same_stats(graphed, eager, "torch's own update, then replays")
        graphed.eval()
        eager.eval()
        x = _small_shift(next(step))
        assert torch.equal(graphed(x), eager(x))
    assert sum(amp_bn_fix.report()["captured"].values()) == 1


def test_a_captured_master_outlives_disable():
    # The graph writes the master at every replay, with the shim or without it: dropped, its memory
    # would go to other tensors while the graph still writes there.
    graphed, _ = _half_twins()
    static = _small_shift(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graphed(_small_shift(1))
        with captured() as graph:
            graphed(static)
    def held() -> torch.Tensor:  # the tensor the graph holds, whatever the buffers hold now
        return _master._of(graphed.running_mean, graphed.running_var).values

    master = held()
    with shim_disabled():
        assert held() is master
        graph.replay()
    assert held() is master
    assert torch.equal(graphed.running_var, master[1].bfloat16())
