"""Every BatchNorm entry point gets the policy: the ``F.batch_norm`` wrapper and the dispatcher kernels.

A generated matrix runs each entry point (``F.batch_norm``, ``torch.batch_norm``,
``torch.ops.aten.batch_norm``, the BatchNorm and InstanceNorm modules, ``F.instance_norm``,
SyncBatchNorm outside distributed, a scripted and a traced module) under each policy, input dtype,
mode and autocast state, plain and along each bypass. Either the fix applies (output dtype per
policy, FP32 running stats that match a float64 computation within ``_bounds``), or the result is
plain torch's, bit for bit (the same call with the shim disabled).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import multiprocessing
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_bn_fix
from _bounds import assert_near, batch_norm_scales
from _builders import fp64_batch_norm, seeded_input
from _shared import ORIGINAL, SUBPROCESS_TIMEOUT, outcome, shim_disabled
from amp_bn_fix import _compat, _dispatch, _doors, _patch, _record

AUTOCAST = torch.bfloat16  # autocast's dtype: a float16 input shows ``input`` and ``autocast`` apart
MOMENTUM, EPS = 0.1, 1e-5
C = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny calls: one torch thread spares each op a fork and join (and waits on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the entry points --------------------------------------------------------------------------


class Functional(nn.Module):
    """The tensors a functional call is given, held like a module's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("running_mean", torch.zeros(C))
        self.register_buffer("running_var", torch.ones(C))


@torch.no_grad()
def seeded(module: Any) -> Any:
    """``module`` with the same affine parameters and running stats every time (FP32)."""
    g = torch.Generator().manual_seed(1)
    values = {
        "weight": 1 + 0.2 * torch.randn(C, generator=g),
        "bias": 0.2 * torch.randn(C, generator=g),
        "running_mean": 0.5 * torch.randn(C, generator=g),
        "running_var": 0.5 + torch.rand(C, generator=g),
    }
    for name, value in values.items():
        tensor = getattr(module, name, None)
        if tensor is not None:
            tensor.copy_(value)
    counter = getattr(module, "num_batches_tracked", None)
    if counter is not None:
        counter.zero_()
    return module


@functools.lru_cache(maxsize=None)
def scripted(cls: type, **kwargs: Any) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated
        return torch.jit.script(cls(C, **kwargs))


class Traced(nn.Module):
    """A BatchNorm2d traced by ``torch.jit.trace`` under the conditions it then runs in (one call)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = seeded(nn.BatchNorm2d(C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings about Python values recorded as constants
            traced = torch.jit.trace(self.bn, x, check_trace=False)
        seeded(self.bn)  # tracing ran one step: start the traced one from the same stats
        return traced(x)

    # The traced module's tensors are the BatchNorm's own.
    weight = property(lambda self: self.bn.weight)
    bias = property(lambda self: self.bn.bias)

    @property
    def running_mean(self) -> torch.Tensor:
        return self.bn.running_mean

    @property
    def running_var(self) -> torch.Tensor:
        return self.bn.running_var


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    shape: Tuple[int, ...]
    make: Callable[[], nn.Module]
    run: Callable[[Any, torch.Tensor], torch.Tensor]
    # "bn": statistics per channel over the batch; "in": per sample and channel.
    kind: str = "bn"
    # The call reaches F.batch_norm, whose wrapper also decides calls outside autocast (mixed ones).
    f_door: bool = False
    tracks: bool = True

    def __repr__(self) -> str:
        return self.name


def module_entry(name: str, cls: type, shape: Tuple[int, ...], kind: str = "bn", **kwargs: Any) -> Entry:
    tracks = kwargs.get("track_running_stats", kind == "bn")
    return Entry(name, shape, lambda: seeded(cls(C, **kwargs)), lambda m, x: m(x), kind,
                 f_door=kind == "bn", tracks=tracks)


def script_entry(name: str, cls: type, shape: Tuple[int, ...], kind: str = "bn", **kwargs: Any) -> Entry:
    return Entry(name, shape, lambda: seeded(scripted(cls, **kwargs)), lambda m, x: m(x), kind)


ENTRIES = [
    Entry("F.batch_norm", (4, C, 5), lambda: seeded(Functional()),
          lambda s, x: F.batch_norm(x, s.running_mean, s.running_var, s.weight, s.bias, s.training, MOMENTUM, EPS),
          f_door=True),
    Entry("torch.batch_norm", (4, C, 5), lambda: seeded(Functional()),
          lambda s, x: torch.batch_norm(x, s.weight, s.bias, s.running_mean, s.running_var, s.training, MOMENTUM,
                                        EPS, False)),
    Entry("aten.batch_norm", (4, C, 5), lambda: seeded(Functional()),
          lambda s, x: torch.ops.aten.batch_norm(x, s.weight, s.bias, s.running_mean, s.running_var, s.training,
                                                 MOMENTUM, EPS, False)),
    module_entry("BatchNorm1d", nn.BatchNorm1d, (6, C)),
    module_entry("BatchNorm2d", nn.BatchNorm2d, (4, C, 3, 3)),
    module_entry("BatchNorm3d", nn.BatchNorm3d, (2, C, 2, 3, 2)),
    module_entry("SyncBatchNorm", nn.SyncBatchNorm, (4, C, 3, 3)),
    module_entry("InstanceNorm1d", nn.InstanceNorm1d, (4, C, 6), "in", affine=True),
    module_entry("InstanceNorm1d-tracked", nn.InstanceNorm1d, (4, C, 6), "in", affine=True, track_running_stats=True),
    module_entry("InstanceNorm2d", nn.InstanceNorm2d, (3, C, 3, 3), "in", affine=True),
    module_entry("InstanceNorm2d-tracked", nn.InstanceNorm2d, (3, C, 3, 3), "in", affine=True, track_running_stats=True),
    module_entry("InstanceNorm3d", nn.InstanceNorm3d, (2, C, 2, 2, 3), "in"),
    module_entry("InstanceNorm3d-tracked", nn.InstanceNorm3d, (2, C, 2, 2, 3), "in", track_running_stats=True),
    Entry("F.instance_norm", (4, C, 6), lambda: seeded(Functional()),
          lambda s, x: F.instance_norm(x, s.running_mean, s.running_var, s.weight, s.bias, s.training, MOMENTUM, EPS),
          "in"),
    script_entry("jit.script-BatchNorm2d", nn.BatchNorm2d, (4, C, 3, 3)),
    script_entry("jit.script-InstanceNorm2d", nn.InstanceNorm2d, (3, C, 3, 3), "in", affine=True,
                 track_running_stats=True),
    Entry("jit.trace-BatchNorm2d", (4, C, 3, 3), Traced, lambda m, x: m(x), f_door=True),
]
ENTRY = {entry.name: entry for entry in ENTRIES}


def uses_batch_stats(entry: Entry, training: bool) -> bool:
    return training or not entry.tracks


def make_input(entry: Entry, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return (1.5 * torch.randn(entry.shape, generator=g) + 0.5).to(dtype)


def run(entry: Entry, x: torch.Tensor, training: bool, autocast: bool
        ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]], nn.Module]:
    state = entry.make()
    state.train(training)
    with torch.autocast("cpu", dtype=AUTOCAST, enabled=autocast):
        out = entry.run(state, x)
    stats = (state.running_mean.clone(), state.running_var.clone()) if entry.tracks else None
    return out, stats, state


_plain_results: Dict[Tuple[str, torch.dtype, bool, bool], Any] = {}


def plain(entry: Entry, dtype: torch.dtype, training: bool, autocast: bool) -> Any:
    """The entry point's result without the shim (computed once per case)."""
    key = (entry.name, dtype, training, autocast)
    if key not in _plain_results:
        with shim_disabled():
            out, stats, _ = run(entry, make_input(entry, dtype), training, autocast)
        _plain_results[key] = (out, stats)
    return _plain_results[key]


def exact(entry: Entry, x: torch.Tensor, training: bool) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, ...]]]:
    """The call in float64 from the same state (output, updated running stats)."""
    state = entry.make()
    tensors = [getattr(state, name, None) for name in ("weight", "bias", "running_mean", "running_var")]
    w, b, mean, var = [None if t is None else t.detach().double() for t in tensors]
    if not entry.tracks:
        mean = var = None
    if entry.kind == "bn":
        ref = fp64_batch_norm(x, mean, var, w, b, training, MOMENTUM, EPS)
        out, mean, var = ref.out, ref.running_mean, ref.running_var
    else:
        out = torch.instance_norm(x.double(), w, b, mean, var, uses_batch_stats(entry, training), MOMENTUM, EPS,
                                  False)
    return out, (mean, var) if entry.tracks else None


def expectation(entry: Entry, policy: str, autocast: bool, bypass: str) -> str:
    """What the shim does: "fix" (the policy), "mixed" (FP32 arithmetic, the input's dtype) or "plain"."""
    if bypass == "disable()":
        return "plain"
    if bypass in ('policy("off")', "device left out"):
        policy = "off"
    if policy == "off":
        return "plain"
    if autocast:
        return "fix"
    # Outside autocast only F.batch_norm's wrapper sees calls: a 16-bit input with FP32 parameters
    # and stats is computed in FP32 and returned in its dtype (docs: mixed calls outside autocast).
    return "mixed" if entry.f_door else "plain"


@contextlib.contextmanager
def shim(policy: str, bypass: str) -> Iterator[None]:
    amp_bn_fix.configure(policy=policy, devices="cuda" if bypass == "device left out" else None)
    if bypass == "disable()":
        with shim_disabled():
            yield
    elif bypass == 'policy("off")':
        with amp_bn_fix.policy("off"):
            yield
    else:
        yield


def handled() -> int:
    return sum(amp_bn_fix.report()["handled"].values())


# --- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bypass", ["none", 'policy("off")', "disable()", "device left out"])
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no-autocast"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast", "off"])
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_entry_point(entry: Entry, policy: str, dtype: torch.dtype, training: bool, autocast: bool, bypass: str):
    x = make_input(entry, dtype)
    expected = expectation(entry, policy, autocast, bypass)
    before = handled()
    with shim(policy, bypass):
        out, stats, state = run(entry, x, training, autocast)
    if expected == "plain":
        out0, stats0 = plain(entry, dtype, training, autocast)
        assert out.dtype is out0.dtype and torch.equal(out, out0)
        if stats is not None:
            assert all(a.dtype is b.dtype and torch.equal(a, b) for a, b in zip(stats, stats0))
        assert handled() == before
        return
    # The policy applies, computed once (a traced module: while it was traced).
    assert handled() == before + 1
    out_dtype = {"fp32": torch.float32, "autocast": AUTOCAST}.get(policy, dtype) if expected == "fix" else dtype
    assert out.dtype is out_dtype and out.shape == x.shape
    out64, stats64 = exact(entry, x, training)
    n = x.numel() // C if entry.kind == "bn" else x[0, 0].numel()
    assert_near(out, out64, n, what="output")
    if stats is not None:
        # FP32, in the module's own buffers, updated as in float64 (or untouched in eval)
        assert state.running_mean.dtype is torch.float32 and state.running_var.dtype is torch.float32
        for stat, stat64 in zip(stats, stats64):
            assert_near(stat, stat64, n, what="running stat")


# --- the two doors: each call decided once -----------------------------------------------------


def call_counts() -> Tuple[int, int]:
    record = amp_bn_fix.report()
    return sum(record["handled"].values()), record["passed_through"]


def bn_args(dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(4, C, 5).to(dtype), torch.zeros(C), torch.ones(C)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("policy", ["fp32", "off"])
def test_a_call_through_the_wrapper_is_decided_and_counted_once(fresh_record, dtype, policy):
    x, mean, var = bn_args(dtype)
    calls = {"wrapper": 0}
    wrapper = _doors.batch_norm

    def counting(*args: Any) -> torch.Tensor:
        calls["wrapper"] += 1
        return wrapper(*args)

    with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy(policy):
        F.batch_norm(x, mean, var, training=True)  # through the wrapper, then the kernel
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_doors, "batch_norm", counting)
            torch.batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS, False)  # the kernel only
    is_handled = dtype is torch.bfloat16 and policy != "off"
    assert call_counts() == ((2, 0) if is_handled else (0, 2))
    # The kernel is a door like the wrapper: each call it sees takes the one door function, once.
    assert calls["wrapper"] == 1


def test_a_name_bound_before_the_patch_gets_the_policy_under_autocast(fresh_record):
    x, mean, var = bn_args(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ORIGINAL(x, mean, var, training=True)  # ``from torch.nn.functional import batch_norm`` before
    assert out.dtype is torch.float32 and call_counts() == (1, 0)


def test_outside_autocast_the_kernel_is_not_called(fresh_record, monkeypatch):
    monkeypatch.setattr(_doors, "batch_norm", None)  # would fail if called
    x, mean, var = bn_args(torch.bfloat16)
    out = torch.batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS, False)
    assert out.dtype is torch.bfloat16 and call_counts() == (0, 0)


def test_gradients_flow_through_the_dispatcher_door():
    torch.manual_seed(0)
    x = torch.randn(4, C, 3, 3, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(C, requires_grad=True)
    norm = nn.InstanceNorm2d(C, affine=True, track_running_stats=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.batch_norm(x, w, None, None, None, True, MOMENTUM, EPS, False) + norm(x)
    assert out.dtype is torch.float32
    out.square().sum().backward()
    assert x.grad.dtype is torch.bfloat16 and w.grad.dtype is torch.float32
    assert norm.weight.grad.dtype is torch.float32 and torch.isfinite(norm.weight.grad).all()
    # float64: the same gradients within FP32 rounding (and the bfloat16 rounding of the input's)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    norm64 = nn.InstanceNorm2d(C, affine=True, track_running_stats=True).double()
    (torch.batch_norm(x64, w64, None, None, None, True, MOMENTUM, EPS, False) + norm64(x64)).square().sum().backward()
    # Errors relative to the magnitudes the backward sums (the loss's gradient, 2 * out, cancels in
    # part); the instance norm is a batch norm of each sample's channels.
    g = 2 * out.detach()
    _, bn_input, bn_params = batch_norm_scales(x, w, g, EPS)

    def per_sample(t):
        return t.reshape(1, -1, *t.shape[2:])

    _, in_input, _ = batch_norm_scales(per_sample(x), norm.weight.repeat(x.shape[0]), per_sample(g), EPS)
    n = x.numel() // C
    assert_near(w.grad, w64.grad, n, scale=bn_params, what="weight gradient")
    assert_near(x.grad, x64.grad, n, scale=bn_input + in_input, what="input gradient")


# --- InstanceNorm: updates land in the module's buffers, in FP32, guarded ------------------------


def test_instance_norm_updates_the_module_buffers_in_fp32_where_torch_rounds_them_to_16_bits():
    """torch's instance_norm casts the stats' copies to the input's dtype: updated in bfloat16."""
    x = make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16)
    results = {}
    for shimmed in (True, False):
        norm = seeded(nn.InstanceNorm2d(C, track_running_stats=True))
        mean, var = norm.running_mean, norm.running_var
        with contextlib.nullcontext() if shimmed else shim_disabled():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                norm(x)
        assert norm.running_mean is mean and norm.running_var is var and mean.dtype is torch.float32
        results[shimmed] = (mean, var)
    reference = seeded(nn.InstanceNorm2d(C, track_running_stats=True)).double()
    mean64, var64 = reference.running_mean, reference.running_var
    torch.instance_norm(x.double(), None, None, mean64, var64, True, MOMENTUM, EPS, False)
    n = x[0, 0].numel()
    assert_near(results[True][0], mean64, n, what="running mean")
    assert_near(results[True][1], var64, n, what="running var")
    # Plain torch misses the same bound by far where it rounds each copy's update to bfloat16
    # (torch 2.13 does; torch 2.4 updates the copies in the stats' own dtype).
    try:
        assert_near(results[False][1], var64, n, what="torch's running var")
    except AssertionError:
        return
    pytest.skip("this torch updates instance_norm's stat copies in FP32: no rounding to compare with")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_half_model_s_instance_norm_takes_its_batch_norm_s_fp32_output(every_route, training):
    """After a half model's BatchNorm under ``fp32``, an InstanceNorm with 16-bit weights and stats
    gets an FP32 input, which torch's kernels reject next to 16-bit tensors: computed as a batch
    norm's would be, FP32 in and out, the stats updated in FP32 and rounded into the buffers."""
    norm = seeded(nn.InstanceNorm2d(C, affine=True, track_running_stats=True)).bfloat16().train(training)
    x = make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16).float()
    reference = copy.deepcopy(norm).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    expected = reference(x.double())
    assert out.dtype is torch.float32 and norm.running_mean.dtype is torch.bfloat16
    n = x[0, 0].numel()
    assert_near(out, expected, n, scale=expected.abs().max().item(), what="output")
    if training:  # each stat within one bfloat16 rounding of the float64 update
        for stat, stat64 in ((norm.running_mean, reference.running_mean), (norm.running_var, reference.running_var)):
            assert torch.allclose(stat.double(), stat64, rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_model_s_instance_norm_stats_are_rounded_once_per_update(every_route, dtype):
    """The per-sample copies are updated and averaged in FP32, and the average rounded once into
    the 16-bit stats: within half a 16-bit step of the float64 update (each copy rounded first
    would add up to a step)."""
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(16, track_running_stats=True, momentum=0.3)
    with torch.no_grad():
        norm.running_mean.uniform_(-2, 2)
        norm.running_var.uniform_(0.5, 3)
    norm.to(dtype)
    reference = copy.deepcopy(norm).double()
    x = (torch.randn(8, 16, 5, 5) * 2 + 1).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        norm(x)
    reference(x.double())
    half_step = 2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -11  # relative, at most
    for stat, stat64 in ((norm.running_mean, reference.running_mean), (norm.running_var, reference.running_var)):
        assert stat.dtype is dtype
        assert torch.allclose(stat.double(), stat64, rtol=half_step * (1 + 2.0 ** -10), atol=0)


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_the_guard_keeps_instance_norm_stats_exactly(bad):
    norm = seeded(nn.InstanceNorm2d(C, affine=True, track_running_stats=True))
    before = norm.running_mean.clone(), norm.running_var.clone()
    x = make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16)
    x[1, 2, 0, 0] = bad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert not torch.isfinite(out).all()  # GradScaler still sees it
    assert torch.equal(norm.running_mean, before[0]) and torch.equal(norm.running_var, before[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16))
    assert not torch.equal(norm.running_mean, before[0]) and torch.isfinite(norm.running_var).all()


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("how", ["torch.compile", "jit.trace"])
def test_the_guard_keeps_instance_norm_stats_under_tracers(how):
    # The write-back tracers record (ordinary in-place ops behind a select) carries the guard too.
    norm = seeded(nn.InstanceNorm2d(C, affine=True, track_running_stats=True))
    before = norm.running_mean.clone(), norm.running_var.clone()
    x = make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16).detach()
    x[1, 2, 0, 0] = float("nan")

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.norm(t)

    step = Step()
    if how == "torch.compile":
        torch._dynamo.reset()
        try:
            torch.compile(step, backend="aot_eager", fullgraph=True)(x)
        finally:
            torch._dynamo.reset()
    else:
        torch.jit.trace(step, (x,), check_trace=False)
    assert torch.equal(norm.running_mean, before[0]) and torch.equal(norm.running_var, before[1])


_BITS = {"-0.0": -0.0, "inf": float("inf"), "snan": None}


def _stats_bits(norm):
    return norm.running_mean.view(torch.int32).clone(), norm.running_var.view(torch.int32).clone()


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("held", list(_BITS))
def test_an_instance_norm_skip_leaves_every_bit_and_counts_once_for_the_module(held, every_route):
    """A skip keeps -0.0, inf and a signalling NaN as they were, and report(model) names the module."""
    model = nn.Sequential(nn.Conv2d(3, C, 1), nn.InstanceNorm2d(C, affine=True, track_running_stats=True))
    norm = model[1]
    with torch.no_grad():
        if _BITS[held] is None:
            norm.running_mean.view(torch.int32).fill_(0x7FA00001)  # a signalling NaN's bits
        else:
            norm.running_mean.fill_(_BITS[held])
    before = _stats_bits(norm)
    x = make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16).detach()[:, :3]
    x[1, 0, 0, 0] = float("nan")
    _record.reset()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    after = _stats_bits(norm)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert amp_bn_fix.report(model)["guard_skips"] == {"1": 3}


def test_instance_norm_without_the_guard_updates_an_infinite_variance_as_torch_does(every_route):
    """ATen averages the updated copies: an infinite variance stays infinite (not inf - inf = NaN)."""
    results = []
    with amp_bn_fix.configure(guard=False):
        for shimmed in (True, False):
            norm = seeded(nn.InstanceNorm2d(C, track_running_stats=True))
            with torch.no_grad():
                norm.running_var.fill_(float("inf"))
            with contextlib.nullcontext() if shimmed else shim_disabled():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    norm(make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16))
            results.append(norm.running_var)
    assert torch.isinf(results[1]).all()  # torch's own update, for reference
    assert torch.equal(results[0], results[1])


def test_instance_norm_keeps_one_guard_record_per_module(every_route):
    """The guard judges the module's stats, not the per-sample copies made anew on each call."""
    norm = nn.InstanceNorm2d(C, track_running_stats=True)
    x = make_input(ENTRY["InstanceNorm2d-tracked"], torch.bfloat16).detach()
    _record.reset()
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            norm(x)
    kept = [*_record._records.alive.values(), *_record._records.deleted.values()]
    assert len(kept) <= 1 and all(record.ref() is norm.running_mean for record in kept)
    assert sum(record.fold()[1] for record in kept) == (5 if every_route == "device" else 0)


def test_instance_norm_without_a_batch_dimension_and_torch_errors():
    norm = nn.InstanceNorm1d(C, affine=True, track_running_stats=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(C, 6, dtype=torch.bfloat16)).shape == (C, 6)
        x = torch.randn(2, C, 6, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="Expected running_mean and running_var to be defined"):
            torch.instance_norm(x, None, None, None, None, False, MOMENTUM, EPS, False)
        with pytest.raises(RuntimeError):
            torch.batch_norm(x, torch.ones(C + 1), None, None, None, True, MOMENTUM, EPS, False)


@pytest.mark.parametrize("use_input_stats", [True, False])
@pytest.mark.parametrize("given", ["running_mean", "running_var"])
def test_instance_norm_with_one_running_stat_is_torchs_own(given, use_input_stats):
    """One running stat without the other is torch's call: its own error (torch 2.13 raises in
    training too), or its own result."""
    x = torch.randn(2, C, 6, dtype=torch.bfloat16)
    results = []
    for shimmed in (True, False):
        with (contextlib.nullcontext() if shimmed else shim_disabled()), torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(outcome(F.instance_norm, (x,), {"use_input_stats": use_input_stats, given: torch.ones(C)}))
    ours, theirs = results
    if isinstance(theirs, Exception):
        assert type(ours) is type(theirs) and str(ours) == str(theirs), (ours, theirs)
        return
    assert not isinstance(ours, Exception), ours
    for a, b in zip(ours, theirs):  # the output, and the stat given (None for the other)
        assert (a is None and b is None) or (a.dtype is b.dtype and torch.equal(a, b))


# --- what the doors do not cover ----------------------------------------------------------------


def native_calls(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> Dict[str, Any]:
    aten = torch.ops.aten
    return {
        "native_batch_norm": lambda: torch.native_batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS),
        "_native_batch_norm_legit": lambda: aten._native_batch_norm_legit(x, None, None, mean, var, True, MOMENTUM, EPS),
        "_native_batch_norm_legit_no_training": lambda: aten._native_batch_norm_legit_no_training(
            x, None, None, mean, var, MOMENTUM, EPS),
    }


@pytest.mark.parametrize("op", list(native_calls(*bn_args(torch.float32))))
def test_direct_native_batch_norm_calls_run_as_in_torch(fresh_record, op):
    """The ops under aten::batch_norm, which our own computation and torch's decompositions call."""
    results = []
    for shimmed in (True, False):
        torch.manual_seed(0)
        x, mean, var = bn_args(torch.bfloat16)
        with contextlib.nullcontext() if shimmed else shim_disabled():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                results.append((native_calls(x, mean, var)[op](), mean, var))
    (ours, *stats), (theirs, *stats0) = results
    assert ours[0].dtype is torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(a, b) for a, b in zip(stats, stats0))
    assert call_counts() == (0, 0)


def test_torch_batch_norm_under_vmap_runs_as_in_torch():
    """torch's batching rule for batch_norm calls the native op, below the autocast kernel."""
    x = torch.randn(2, 4, C, 5).bfloat16()

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.batch_norm(t, None, None, None, None, True, MOMENTUM, EPS, False)

    results = []
    for shimmed in (True, False):
        with contextlib.nullcontext() if shimmed else shim_disabled():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                results.append(torch.func.vmap(fn)(x))
    assert results[0].dtype is torch.bfloat16 and torch.equal(*results)
    # F.batch_norm under vmap is the wrapper's (test_patch): a 16-bit input there gets the policy.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.func.vmap(lambda t: F.batch_norm(t, None, None, training=True))(x).dtype is torch.float32


# --- registration: MPS, removal, re-registration, reload ----------------------------------------


def kernel_at(key: str, op: str = "batch_norm") -> bool:
    return _compat.has_dispatch_kernel(f"aten::{op}", key)


def python_kernel_at(key: str, op: str = "batch_norm") -> bool:
    line = [entry for entry in torch._C._dispatch_dump(f"aten::{op}").splitlines() if entry.startswith(key + ":")]
    return bool(line) and ".cpp" not in line[0]


def test_the_kernels_sit_at_the_cpu_cuda_xpu_autocast_keys_never_at_mps():
    assert _dispatch.PATCH.applied and amp_bn_fix.is_enabled()
    assert _dispatch.registered_keys() == ("AutocastCPU", "AutocastCUDA", "AutocastXPU")
    for key in _dispatch.registered_keys():
        assert python_kernel_at(key) and python_kernel_at(key, "instance_norm")
    # torch's own FP32 batch_norm kernel at AutocastMPS stays; instance_norm reaches it there
    assert "AutocastMPS" not in _dispatch.KEYS
    try:
        kernel_at("AutocastMPS")
    except RuntimeError:  # torch 2.4's dispatcher does not know the key by name
        pytest.skip("this torch has no AutocastMPS dispatch key")
    assert kernel_at("AutocastMPS") and not python_kernel_at("AutocastMPS")
    assert not kernel_at("AutocastMPS", "instance_norm")


def test_a_key_that_has_a_kernel_is_left_alone(monkeypatch):
    """The rule that keeps AutocastMPS torch's: registration skips any key with a kernel of its own."""
    taken = {("aten::batch_norm", "AutocastCPU"), ("aten::instance_norm", "AutocastCUDA")}
    monkeypatch.setattr(_dispatch, "_warned_keys", set())
    try:
        amp_bn_fix.disable()
        real = _compat.has_dispatch_kernel
        monkeypatch.setattr(_compat, "has_dispatch_kernel", lambda op, key: (op, key) in taken or real(op, key))
        with pytest.warns(RuntimeWarning) as caught:
            amp_bn_fix.enable()
        assert sorted(str(w.message) for w in caught) == [
            "amp_bn_fix: another library has a kernel for aten::batch_norm at the AutocastCPU dispatch key; "
            "amp_bn_fix leaves it in place, so only torch.nn.functional.batch_norm calls get its policy there.",
            "amp_bn_fix: another library has a kernel for aten::instance_norm at the AutocastCUDA dispatch key; "
            "amp_bn_fix leaves it in place, so InstanceNorm under autocast stays as that library makes it there.",
        ]
        assert {w.filename for w in caught} == {__file__}  # the enable() line above
        assert _dispatch.registered_keys() == ("AutocastCUDA", "AutocastXPU")
        assert not python_kernel_at("AutocastCPU") and python_kernel_at("AutocastCUDA")
        assert not python_kernel_at("AutocastCUDA", "instance_norm")
        x, mean, var = bn_args(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS, False).dtype is torch.bfloat16
    finally:
        monkeypatch.undo()
        amp_bn_fix.disable()
        amp_bn_fix.enable()
    assert _dispatch.registered_keys() == ("AutocastCPU", "AutocastCUDA", "AutocastXPU")


def direct_dtype(op: str = "batch_norm") -> torch.dtype:
    x, mean, var = bn_args(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if op == "instance_norm":
            return F.instance_norm(x).dtype
        return torch.batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS, False).dtype


def no_kernel_left() -> bool:
    return not any(kernel_at(key, op) for key in _dispatch.KEYS for op in ("batch_norm", "instance_norm"))


def test_disable_removes_the_kernels_and_enable_registers_them_again():
    amp_bn_fix.disable()
    assert not amp_bn_fix.is_enabled() and not _dispatch.PATCH.applied and no_kernel_left()
    assert direct_dtype() is torch.bfloat16 and direct_dtype("instance_norm") is torch.bfloat16
    amp_bn_fix.enable()
    assert _dispatch.PATCH.applied and direct_dtype() is torch.float32
    with shim_disabled():
        assert no_kernel_left() and direct_dtype() is torch.bfloat16
    assert direct_dtype("instance_norm") is torch.float32
    # A door removed on its own: install() completes the shim again.
    _dispatch.PATCH.remove()
    assert amp_bn_fix.is_enabled() and direct_dtype() is torch.bfloat16
    assert _patch.install() and direct_dtype() is torch.float32


def test_the_registration_survives_garbage_collection():
    gc.collect()
    assert kernel_at("AutocastCPU") and direct_dtype() is torch.float32


def test_the_compile_cache_tag_names_the_registration():
    config = pytest.importorskip("torch.compiler.config")
    if not hasattr(config, "cache_key_tag"):
        pytest.skip("this torch has no compile cache key tag (torch < 2.6)")
    tag = torch.compiler.config.cache_key_tag
    assert tag.endswith(",dispatch=cpu+cuda+xpu")
    amp_bn_fix.disable()
    assert "amp_bn_fix" not in torch.compiler.config.cache_key_tag
    amp_bn_fix.enable()
    assert torch.compiler.config.cache_key_tag == tag


def test_reload_leaves_one_registration():
    library = _dispatch._library
    try:
        importlib.reload(_dispatch)  # its namespace is kept: the registration too
        importlib.reload(_patch)
        importlib.reload(amp_bn_fix)
        amp_bn_fix.enable()
        assert _dispatch._library is library and direct_dtype() is torch.float32
        amp_bn_fix.disable()
        assert no_kernel_left() and direct_dtype() is torch.bfloat16
    finally:
        amp_bn_fix.enable()
    assert direct_dtype() is torch.float32


# --- torch.jit.trace and torch.compile keep what they traced ------------------------------------


def test_a_traced_module_keeps_the_fp32_computation_it_recorded():
    bn = seeded(nn.BatchNorm2d(C))
    x = make_input(ENTRY["BatchNorm2d"], torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(bn, x, check_trace=False)
    with shim_disabled(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert traced(x).dtype is torch.float32
    # traced without the shim, the graph holds plain aten::batch_norm: the kernel decides at run time
    with shim_disabled(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_trace = torch.jit.trace(bn, x, check_trace=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain_trace(x).dtype is torch.float32


def direct_fn(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    return torch.batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS, False).relu()


COMPILED = {
    "torch.batch_norm": lambda: direct_fn,
    "BatchNorm2d": lambda: seeded(nn.BatchNorm2d(C)),
    "InstanceNorm2d-tracked": lambda: seeded(nn.InstanceNorm2d(C, affine=True, track_running_stats=True)),
}


@pytest.mark.parametrize("policy", ["fp32", "input"])
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled(name, policy):
    torch.compiler.reset()
    target = COMPILED[name]()
    entry = ENTRY[name]
    x = make_input(entry, torch.bfloat16)
    stats = seeded(Functional()) if target is direct_fn else target
    args = (x, stats.running_mean, stats.running_var) if target is direct_fn else (x,)
    compiled = torch.compile(target, backend="aot_eager")
    amp_bn_fix.set_policy(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(*args)
    assert out.dtype is (torch.float32 if policy == "fp32" else torch.bfloat16)
    assert stats.running_mean.dtype is torch.float32
    n = x.numel() // C if entry.kind == "bn" else x[0, 0].numel()
    _, (mean64, var64) = exact(entry, x, True)
    assert_near(stats.running_mean, mean64, n, what="running mean")
    assert_near(stats.running_var, var64, n, what="running var")
    if name == "torch.batch_norm" and policy == "fp32":
        # Compiled code keeps the kernel's computation until torch.compiler.reset(): disable() resets.
        _dispatch.PATCH.remove()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert compiled(*args).dtype is torch.float32
        _patch.install()
        amp_bn_fix.disable()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert compiled(*args).dtype is torch.bfloat16


# --- batch norms compiled code runs eagerly ----------------------------------------------------
#
# Dynamo compiles the frames that compiled code runs eagerly (after a graph break) and inlines the
# functions the code it traces calls; the shim's own frames are neither: they run as in eager mode,
# under the policy in force at each call. A BatchNorm with momentum=None breaks the graph in its
# forward (on float(num_batches_tracked)), and dynamo cannot trace a policy() block.

N = 16  # rows of the BatchNorm1d input


def autocast_module(bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return bn(x)


def rows(seed: int = 0) -> torch.Tensor:
    return seeded_input((N, C), torch.bfloat16, seed)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_batch_norm_compiled_code_runs_eagerly_gets_the_policy_in_force_at_each_call(backend):
    torch.compiler.reset()
    under_input = torch.compile(autocast_module, backend=backend)
    elsewhere = torch.compile(lambda bn, x: autocast_module(bn, x) * 1, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the block's warning about compiled code
        with amp_bn_fix.policy("input"):
            assert under_input(seeded(nn.BatchNorm1d(C, momentum=None)), rows()).dtype is torch.bfloat16
    bn, x = seeded(nn.BatchNorm1d(C, momentum=None)), rows()
    # The first update of a cumulative average takes the batch's statistics whole.
    expected = fp64_batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 1.0, bn.eps)
    out = elsewhere(bn, x)
    assert out.dtype is torch.float32  # not the input policy the shim's frames were compiled under
    assert_near(out, expected.out, N, what="output")
    assert_near(bn.running_mean, expected.running_mean, N, what="running mean")
    assert_near(bn.running_var, expected.running_var, N, what="running var")


def test_compiled_code_that_runs_a_batch_norm_eagerly_compiles_no_frame_per_call():
    torch.compiler.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled, bn = torch.compile(autocast_module, backend="eager"), nn.BatchNorm1d(C, momentum=None)
    frames = []
    for calls in (2, 6):
        for seed in range(calls):
            assert compiled(bn, rows(seed)).dtype is torch.float32
        frames.append(counters["frames"]["total"])
    assert frames[0] == frames[1]  # compiled shim frames recompiled at each call, up to dynamo's limit


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_policy_block_inside_compiled_code_ends_where_it_ends(backend):
    torch.compiler.reset()
    inside, after = seeded(nn.BatchNorm1d(C)), seeded(nn.BatchNorm1d(C))
    x = rows()
    expected = fp64_batch_norm(x, after.running_mean, after.running_var, after.weight, after.bias, True, 0.1, after.eps)

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with amp_bn_fix.policy("input"):
                a = inside(x)
            return a, after(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a, b = torch.compile(forward, backend=backend)(x)
    assert (a.dtype, b.dtype) == (torch.bfloat16, torch.float32)  # as in eager mode
    assert_near(b, expected.out, N, what="output after the block")


# --- worker processes ---------------------------------------------------------------------------


def worker_report() -> Tuple[bool, str, str]:
    torch.set_num_threads(1)
    return kernel_at("AutocastCPU"), str(direct_dtype()), str(direct_dtype("instance_norm"))


@pytest.mark.parametrize("method", [
    "fork",
    pytest.param("spawn", marks=pytest.mark.slow),  # a fresh interpreter imports torch and this module
])
def test_worker_processes_see_the_kernel(method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} here")
    with multiprocessing.get_context(method).Pool(1) as pool:
        assert pool.apply_async(worker_report).get(timeout=SUBPROCESS_TIMEOUT) == (True, "torch.float32", "torch.float32")


@pytest.mark.cuda
def test_cuda_calls_reach_the_kernel():
    x = torch.randn(4, C, 5, device="cuda", dtype=torch.float16)
    mean, var = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.batch_norm(x, None, None, mean, var, True, MOMENTUM, EPS, True).dtype is torch.float32
        assert F.instance_norm(x).dtype is torch.float32
    assert mean.dtype is torch.float32 and torch.isfinite(mean).all()
