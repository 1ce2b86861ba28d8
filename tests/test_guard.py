"""The guard: a training step with non-finite batch statistics leaves the running stats untouched."""

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_bn_fix
from _bounds import assert_near, assert_within, fp32_bound, unit_roundoff
from _builders import fp64_batch_norm
from _shared import computed_stats, guarded_update

C = 8
N = 32  # values per channel in _batch
BAD = [float("inf"), float("-inf"), float("nan")]

# Every test on the CPU's route and on the route a CUDA call takes (see conftest).
pytestmark = pytest.mark.usefixtures("every_route")


def _batch(seed, dtype=torch.float32, bad=None):
    x = 2 + 3 * torch.randn(32, C, generator=torch.Generator().manual_seed(seed))
    if bad is not None:
        x[5, 3] = bad
    return x.to(dtype)


def _bn(seed=0):
    bn = nn.BatchNorm1d(C)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(C, generator=torch.Generator().manual_seed(seed)))
        bn.running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(seed + 1))
    return bn


def _stats(bn):
    return bn.running_mean.detach().clone(), bn.running_var.detach().clone()


# Every kind of call the shim handles: (how to prepare the module, input dtype, under autocast).
HANDLED = {
    "autocast-bf16": (lambda bn: bn, torch.bfloat16, True),
    "autocast-fp16": (lambda bn: bn, torch.float16, True),
    "half-model": (lambda bn: bn.half(), torch.float16, False),
    "half-model-bf16": (lambda bn: bn.bfloat16(), torch.bfloat16, False),
    "keep-all-model": (lambda bn: bn.half(), torch.float16, False),
    # Cast while the shim was off (or built, loaded or copied so): its first training call starts a master.
    "half-model-cast-without-shim": (lambda bn: _cast_without_shim(bn, torch.bfloat16), torch.bfloat16, False),
}


def _cast_without_shim(bn, dtype):
    amp_bn_fix.disable()
    try:
        return bn.to(dtype)
    finally:
        amp_bn_fix.enable()


def _prepare(case):
    if case == "keep-all-model":
        amp_bn_fix.configure(keep_fp32="all")
    prepare, dtype, autocast = HANDLED[case]
    return prepare(_bn()), dtype, autocast


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("case", sorted(HANDLED))
def test_non_finite_batch_leaves_stats_exactly_and_next_batch_updates(case, bad):
    bn, dtype, autocast = _prepare(case)
    before, computed = _stats(bn), computed_stats(bn)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = bn(_batch(1, dtype, bad))
    assert not torch.isfinite(out).all()  # GradScaler still sees the bad step
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert all(torch.equal(a, b) for a, b in zip(computed_stats(bn), computed))
    good = _batch(2, dtype)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        bn(good)
    want = fp64_batch_norm(good, *computed)
    mean, var = computed_stats(bn)
    assert_near(mean, want.running_mean, N, what="running mean")
    assert_near(var, want.running_var, N, what="running var")
    # A half model's buffers hold its master rounded once.
    assert torch.equal(bn.running_mean, mean.to(bn.running_mean.dtype))


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
def test_a_batch_whose_squared_deviations_overflow_fp32_is_skipped_as_torch_overflows():
    # Variance about 1e38, within FP32's range; the sum of the squared deviations it comes from is
    # not. Torch's FP32 kernels (and CUDA's Welford, which the device route's CPU stand-in
    # follows) hold that sum in FP32: the variance is inf, and the guard keeps the stats.
    x = (1e19 * torch.randn(N, C, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    plain = _bn()
    plain(x.float())
    assert torch.isinf(plain.running_var).all()  # what torch's own update makes of it
    bn = _bn()
    before = _stats(bn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bn(x)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


def test_half_stats_model_under_autocast_is_guarded_too():
    """A module built with 16-bit stats (outside the shim's casts) is handled under autocast."""
    bn = nn.BatchNorm1d(C, dtype=torch.bfloat16)
    before = _stats(bn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bn(_batch(1, torch.bfloat16, float("inf")))
    assert bn.running_mean.dtype == torch.bfloat16
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


@pytest.mark.parametrize("case", sorted(HANDLED))
def test_guard_off_lets_the_bad_batch_corrupt_the_stats(case):
    amp_bn_fix.configure(guard=False)
    bn, dtype, autocast = _prepare(case)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        bn(_batch(1, dtype, float("inf")))
    assert not torch.isfinite(bn.running_mean).all() or not torch.isfinite(bn.running_var).all()


@pytest.mark.parametrize(
    "dtype, autocast, policy",
    [
        (torch.float32, False, "fp32"),  # fp32 input outside autocast
        (torch.float32, True, "fp32"),  # fp32 input under autocast (not a low-precision input)
        (torch.float64, False, "fp32"),
        (torch.bfloat16, True, "off"),  # policy off: untouched
        (torch.bfloat16, False, "off"),  # a half model outside autocast, policy off
    ],
)
def test_pass_through_calls_stay_bitwise_native(dtype, autocast, policy):
    """The guard covers handled calls only; everything else is torch's own call, bad batch and all."""
    x = _batch(1, dtype, float("inf"))
    amp_bn_fix.disable()
    modules = [_bn().to(dtype), _bn().to(dtype)]  # identical, all in the input's dtype
    results = []
    for bn, enabled in zip(modules, (True, False)):
        if enabled:
            amp_bn_fix.enable()
        else:
            amp_bn_fix.disable()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), amp_bn_fix.policy(policy):
            out = bn(x)
        results.append((out, bn.running_mean, bn.running_var))
    for shimmed, native in zip(*results):
        assert shimmed.dtype == native.dtype
        assert torch.equal(shimmed.nan_to_num(), native.nan_to_num())
        assert torch.equal(shimmed.isnan(), native.isnan())
    assert not torch.isfinite(results[0][1]).all()  # unguarded, exactly as in torch


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("case", sorted(HANDLED))
def test_backward_with_the_guard(case, guard):
    """No tensor saved for backward is modified in place afterwards (as torch's kernels do)."""
    amp_bn_fix.configure(guard=guard)
    bn, dtype, autocast = _prepare(case)
    stats = computed_stats(bn)  # the stats the shim computes with (rounded by a cast without a master)
    x = _batch(3, dtype)
    upstream = torch.randn(32, C, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        # Two forwards before one backward (a siamese network, or real and fake batches in a GAN).
        out = bn(x) + bn(_batch(5, dtype))
    upstream = upstream.to(out.dtype)  # the gradient as the half output receives it
    out.backward(upstream)
    # The second forward normalizes with the batch's statistics, and updates the stats the first left.
    branches = []
    for batch in (x, _batch(5, dtype)):
        branches.append(fp64_batch_norm(batch, *stats, bn.weight, bn.bias, grad_out=upstream))
        stats = branches[-1].running_mean, branches[-1].running_var
    # The parameters accumulate the two branches' gradients, each rounded to their dtype: a
    # rounding of each branch's value on top of the FP32 sums and the rounding of their sum.
    for name in ("weight", "bias"):
        grad = getattr(bn, name).grad
        exact = sum(getattr(branch, f"grad_{name}") for branch in branches)
        each = sum(getattr(branch, f"grad_{name}").abs() for branch in branches)
        bound = fp32_bound(exact, N, grad.dtype, scale=each.max().item()) + unit_roundoff(grad.dtype) * each
        assert_within(grad, exact, bound, what=f"{name} gradient")
    assert_near(computed_stats(bn)[1], stats[1], N, what="running var")


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("case", sorted(HANDLED))
def test_backward_through_an_eval_call_after_the_stats_were_updated(case, guard):
    """An eval call saves the running stats for backward; a later training call updates them.

    torch's kernels update running stats without bumping their version counter, so this works
    natively (a mean teacher, or validation inside a step); a write-back must not break it.
    """
    amp_bn_fix.configure(guard=guard)
    bn, dtype, autocast = _prepare(case)
    x = _batch(1, dtype).requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        bn.eval()
        first = bn(x)
        bn.train()
        second = bn(_batch(2, dtype))
    (first.float().sum() + second.float().sum()).backward()
    # As torch computes it: the eval call's backward reads the running variance at backward time.
    scale = bn.weight.double() / (computed_stats(bn)[1].double() + bn.eps).sqrt()
    assert_near(x.grad, scale.expand(x.shape), 1, what="input gradient")  # no sums: weight * invstd


def test_eval_mode_reads_the_stats_and_never_touches_them():
    bn = _bn().eval()
    before = _stats(bn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bn(_batch(1, torch.bfloat16, float("nan")))
    assert torch.isnan(out).any() and torch.isfinite(out).any()
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_guard_compiles_with_fullgraph(backend):
    torch._dynamo.reset()
    bn = _bn()
    compiled = torch.compile(bn, backend=backend, fullgraph=True)
    stats = _stats(bn)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for seed, bad in [(1, None), (2, float("inf")), (3, None), (4, float("nan"))]:
                x = _batch(seed, torch.bfloat16, bad)
                out = compiled(x)
                out.sum().backward()
                if bad is None:
                    ref = fp64_batch_norm(x, *stats)
                    stats = ref.running_mean, ref.running_var
                    assert torch.isfinite(out).all()
                else:
                    assert not torch.isfinite(out).all()
                assert_near(bn.running_mean, stats[0], N, what="running mean")
                assert_near(bn.running_var, stats[1], N, what="running var")
        assert out.dtype == torch.float32 and bn.weight.grad is not None
    finally:
        torch._dynamo.reset()


def _train(batches, guard, skip=None):
    """An AMP training loop on CPU: float16 autocast, GradScaler, SGD."""
    amp_bn_fix.configure(guard=guard)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(C, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skipped = 0
    for index, (x, y) in enumerate(batches):
        if index == skip:
            continue
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale  # the scaler backs off when it skips a step
    return model, skipped


def test_gradscaler_loop_with_one_inf_batch_equals_a_run_that_skipped_it():
    generator = torch.Generator().manual_seed(0)
    batches = [(_batch(seed), torch.randn(32, 1, generator=generator)) for seed in range(12)]
    bad = 5
    batches[bad] = (_batch(bad, bad=float("inf")), batches[bad][1])

    guarded, skipped = _train(batches, guard=True)
    clean, clean_skipped = _train(batches, guard=True, skip=bad)
    assert (skipped, clean_skipped) == (1, 0)
    bn, clean_bn = guarded[1], clean[1]
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
    assert torch.equal(bn.running_mean, clean_bn.running_mean)
    assert torch.equal(bn.running_var, clean_bn.running_var)
    for param, clean_param in zip(guarded.parameters(), clean.parameters()):
        assert torch.equal(param, clean_param)
    # The step counter still counts the skipped batch (it only matters for momentum=None).
    assert bn.num_batches_tracked.item() == clean_bn.num_batches_tracked.item() + 1

    unguarded, _ = _train(batches, guard=False)
    assert not torch.isfinite(unguarded[1].running_mean).all()


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    """Any TorchFunctionMode takes calls out of plain eager mode: the reference path, plain copies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced-like"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
@pytest.mark.parametrize("bad", BAD)
def test_stats_are_bit_for_bit_those_of_a_run_that_never_saw_the_bad_batch(policy, layout, eager, bad):
    # 16x16 feature maps: long enough rows for every fast path (FP32 training kernel, mixed kernel).
    amp_bn_fix.set_policy(policy)
    generator = torch.Generator().manual_seed(7)
    batches = [(2 + 3 * torch.randn(4, C, 16, 16, generator=generator)).bfloat16() for _ in range(3)]
    poisoned = batches[1].clone()
    poisoned[1, 2, 3, 4] = bad
    runs = {}
    for name, sequence in (("with", [batches[0], poisoned, batches[2]]), ("without", [batches[0], batches[2]])):
        bn = nn.BatchNorm2d(C).to(memory_format=layout)
        with torch.autocast("cpu", dtype=torch.bfloat16), (contextlib.nullcontext() if eager else _PassThroughMode()):
            for x in sequence:
                bn(x.contiguous(memory_format=layout).requires_grad_()).sum().backward()
        runs[name] = _stats(bn)
    assert torch.equal(runs["with"][0], runs["without"][0]) and torch.equal(runs["with"][1], runs["without"][1])
    assert runs["with"][0].dtype is torch.float32


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("host", [True, False], ids=["host-route", "device-route"])
@pytest.mark.parametrize("bad", [None, *BAD])
@pytest.mark.parametrize("where", [0, 1], ids=["mean", "var"])
def test_guarded_update_takes_all_or_nothing(host, bad, where, raises):
    # A kernel stand-in writes chosen values as its update; both routes decide on CPU tensors.
    # Finite values near float32's limits must still be written (the host route's dot product of
    # the stats overflows there and must not count as a non-finite batch).
    old = (torch.randn(C), torch.rand(C) + 0.5)
    # Values whose bits a restore must keep: a negative zero, a subnormal, the largest float32.
    old[0][:3] = torch.tensor([-0.0, 1e-40, torch.finfo(torch.float32).max])
    stats = tuple(t.clone() for t in old)
    new = torch.stack((torch.full((C,), -3e38), torch.full((C,), 3e38)))
    if bad is not None:
        new[where, 3] = bad

    def kernel(mean, var):
        mean.copy_(new[0])
        var.copy_(new[1])
        if raises:  # as checkpointing's early stop raises out of a recomputed kernel after its update
            raise RuntimeError("stopped")
        return mean

    with pytest.raises(RuntimeError, match="stopped") if raises else contextlib.nullcontext():
        guarded_update(*stats, host, kernel)
    expected = old if bad is not None else tuple(new)
    assert all(torch.equal(s.view(torch.int32), e.view(torch.int32)) for s, e in zip(stats, expected))



def _no_host_reads(monkeypatch):
    """Every way Python code reads a tensor's value on the host raises (a sync on a device)."""

    def read(self, *args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read)


@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
@pytest.mark.parametrize("bad", [None, float("nan")])
def test_device_route_reads_nothing_on_the_host(every_route, policy, bad):
    if every_route != "device":
        pytest.skip("the host route reads the guard's decision on purpose")
    amp_bn_fix.set_policy(policy)
    bn = _bn()
    before = _stats(bn)
    x = _batch(1, torch.bfloat16, bad).requires_grad_()
    with pytest.MonkeyPatch.context() as patch, torch.autocast("cpu", dtype=torch.bfloat16):
        _no_host_reads(patch)
        bn(x).float().sum().backward()
        bn.eval()
        bn(x)
    assert x.grad is not None
    after = _stats(bn)
    if bad is None:
        assert not torch.equal(after[0], before[0])
    else:
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert amp_bn_fix.report(nn.Sequential(bn))["guard_skips"].get("0", 0) == (1 if bad is not None else 0)


@pytest.mark.parametrize("stats", ["meta", "0-d", "2-d"])
def test_the_guard_leaves_torchs_errors_to_torch(stats):
    """Stats torch rejects (on another device, of a shape it refuses) get torch's own error, and the
    record stays readable: the guard judges only stats on the input's device, of any shape."""
    make = {"meta": lambda v: torch.full((C,), v, device="meta"), "0-d": lambda v: torch.tensor(v),
            "2-d": lambda v: torch.full((1, C), v)}[stats]
    x = _batch(0, torch.bfloat16)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.batch_norm(x, make(0.0), make(1.0), torch.ones(C), torch.zeros(C), True)

    amp_bn_fix.disable()
    with pytest.raises(Exception) as theirs:
        call()
    amp_bn_fix.enable()
    before = amp_bn_fix.report()["guard_skips"]
    with pytest.raises(type(theirs.value), match=f"^{re.escape(str(theirs.value))}$"):
        call()
    assert amp_bn_fix.report()["guard_skips"] == before


@pytest.mark.parametrize("channels", [2, 32, 33])
@pytest.mark.parametrize("spelling", ["module", "full path"])
def test_a_nan_already_in_the_stats_keeps_its_bits(channels, spelling):
    """Stats that hold a NaN before the call (a signalling one, which a Python float would make
    quiet, or a negative one) come back bit for bit, whatever route and channel count."""
    bn = nn.BatchNorm1d(channels)
    bits = bn.running_mean.view(torch.int32)
    bits[0], bits[-1] = 0x7FA00001, -0x00400001  # signalling NaN; negative quiet NaN (0xFFBFFFFF)
    before = bn.running_mean.view(torch.int32).clone(), bn.running_var.view(torch.int32).clone()
    x = 2 + 3 * torch.randn(16, channels, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if spelling == "module":
            bn(x.bfloat16())
        else:
            F.batch_norm(input=x.bfloat16(), running_mean=bn.running_mean, running_var=bn.running_var, training=True)
    assert torch.equal(bn.running_mean.view(torch.int32), before[0])
    assert torch.equal(bn.running_var.view(torch.int32), before[1])
    assert sum(amp_bn_fix.report()["guard_skips"].values()) >= 1


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("channels", [4, 40], ids=["few-channels", "many-channels"])
def test_a_default_device_elsewhere_leaves_the_guard_on_the_stats_device(channels):
    # torch.set_default_device (or ``with torch.device(...)``) names where factory functions
    # allocate: the guard's restore of a CPU module's stats stays on the CPU.
    bn = nn.BatchNorm1d(channels)
    before = _stats(bn)
    x = torch.randn(8, channels)
    x[0, 0] = float("nan")
    with torch.device("meta"), torch.autocast("cpu", dtype=torch.bfloat16):
        bn(x.bfloat16())
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
