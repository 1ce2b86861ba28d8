"""Installing the patch, the public API, pass-through calls and composition with the rest of torch."""

import copy
import os
import threading
import warnings

import pytest
import torch
import wrapt
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import amp_bn_fix
from _bounds import assert_near, assert_within, rounding_bound, same_computation_bound
from _builders import fp64_batch_norm, fp64_module
from _shared import ORIGINAL, SUBPROCESS_TIMEOUT, child_env, compare_outcomes, outcome, shim_disabled
from amp_bn_fix import _config, _patch, _state



def seed_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))


def layer_dtypes(net, x, device_type="cpu", dtype=torch.bfloat16):
    dtypes = []
    with torch.autocast(device_type, dtype=dtype):
        for layer in net:
            x = layer(x)
            dtypes.append(x.dtype)
    return dtypes


# --- the seed report -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_seed_layer_dtypes_on_cpu(dtype):
    net, x = seed_net(), torch.randn(2, 4)
    assert layer_dtypes(net, x, dtype=dtype) == [dtype, torch.float32, dtype]
    amp_bn_fix.disable()
    assert layer_dtypes(net, x, dtype=dtype) == [dtype, dtype, dtype]  # the bug, natively


# --- enable / disable ------------------------------------------------------------------------


def test_import_enables_and_disable_restores_the_very_original():
    assert amp_bn_fix.is_enabled()
    assert F.batch_norm is not ORIGINAL and F.batch_norm.__wrapped__ is ORIGINAL
    amp_bn_fix.disable()
    assert F.batch_norm is ORIGINAL and not amp_bn_fix.is_enabled()
    amp_bn_fix.disable()  # idempotent
    assert F.batch_norm is ORIGINAL


def test_enable_is_idempotent_one_wrapper():
    amp_bn_fix.enable()
    amp_bn_fix.enable("input")
    assert F.batch_norm.__wrapped__ is ORIGINAL  # not a wrapper around a wrapper
    assert amp_bn_fix.get_policy() == "input"


def test_disable_removes_only_our_wrapper():
    other = wrapt.wrap_function_wrapper(F, "batch_norm", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    try:
        amp_bn_fix.disable()
        assert F.batch_norm is other and other.__wrapped__ is ORIGINAL  # theirs stays, ours is gone
    finally:
        wrapt.unwrap_object(F, "batch_norm", other)
    assert F.batch_norm is ORIGINAL


def test_a_wrapper_that_cannot_be_removed_stays_active_and_the_rest_come_back():
    import functools

    inner = F.batch_norm
    F.batch_norm = functools.wraps(inner)(lambda *args, **kwargs: inner(*args, **kwargs))  # not wrapt
    try:
        with pytest.warns(RuntimeWarning, match="could not remove"):
            amp_bn_fix.disable()
        assert amp_bn_fix.is_enabled()  # the batch_norm wrapper is still there, and says so
        assert "_apply" not in nn.modules.batchnorm._BatchNorm.__dict__
        amp_bn_fix.enable()
        with amp_bn_fix.configure(keep_fp32="all"):  # the cast patch is back in place
            assert nn.BatchNorm1d(3).half().running_mean.dtype is torch.float32
    finally:
        F.batch_norm = inner
    amp_bn_fix.disable()
    assert F.batch_norm is ORIGINAL and "_apply" not in nn.modules.batchnorm._BatchNorm.__dict__


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.InstanceNorm1d])
@pytest.mark.parametrize("order", ["theirs-first", "ours-first"])
def test_another_library_s_wrapper_of_the_norm_s_cast_leaves_the_shim_s_in_force_or_off(norm, order):
    """A library that wraps a norm's ``_apply`` (wrapt), before the shim's or after it: casts keep
    the shim's FP32 stats while the shim is on, and are torch's own once it is off."""
    owner = norm.__mro__[1]  # _BatchNorm, _InstanceNorm
    calls = []

    def theirs(wrapped, instance, args, kwargs):
        calls.append(type(instance))
        return wrapped(*args, **kwargs)

    if order == "theirs-first":
        amp_bn_fix.disable()
    handle = wrapt.wrap_function_wrapper(owner, "_apply", theirs)
    try:
        amp_bn_fix.enable()
        amp_bn_fix.configure(keep_fp32="all")
        kept = torch.float32 if norm is nn.BatchNorm1d else torch.float16  # InstanceNorm: torch's cast
        assert norm(3, track_running_stats=True).half().running_mean.dtype is kept
        amp_bn_fix.disable()
        assert norm(3, track_running_stats=True).half().running_mean.dtype is torch.float16
        assert calls == [norm, norm]
    finally:
        amp_bn_fix.disable()
        wrapt.unwrap_object(owner, "_apply", handle)
        if vars(owner).get("_apply") is nn.Module._apply:  # wrapt may restore the inherited function there
            delattr(owner, "_apply")
        amp_bn_fix.enable()


def test_an_install_failing_part_way_leaves_nothing_untracked(monkeypatch):
    amp_bn_fix.disable()
    patches = _patch.PATCHES
    failing = _patch.WraptPatch(nn.functional, "no_such_function", lambda *a: None)
    monkeypatch.setattr(_patch, "PATCHES", (*patches[:1], failing))
    with pytest.raises(AttributeError, match="no_such_function"):
        amp_bn_fix.enable()
    monkeypatch.setattr(_patch, "PATCHES", patches)
    amp_bn_fix.enable()
    assert F.batch_norm.__wrapped__ is ORIGINAL  # completed, not wrapped twice
    amp_bn_fix.disable()
    assert F.batch_norm is ORIGINAL


def test_a_reference_kept_after_disable_runs_natively():
    kept = F.batch_norm  # e.g. ``from torch.nn.functional import batch_norm`` after the import
    x = torch.randn(4, 3).bfloat16()
    amp_bn_fix.disable()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kept(x, None, None, training=True)
    assert out.dtype is torch.bfloat16
    assert torch.equal(out, ORIGINAL(x, None, None, training=True))


def test_modules_reach_the_patch_through_f_batch_norm():
    bns = [nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3), nn.SyncBatchNorm(3)]
    shapes = [(4, 3), (4, 3, 2, 2), (4, 3, 2, 2, 2), (4, 3, 2, 2)]
    lazy = nn.LazyBatchNorm2d()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [bn(torch.randn(s).bfloat16()) for bn, s in zip(bns, shapes)]
        outs.append(lazy(torch.randn(4, 3, 2, 2).bfloat16()))
    assert [o.dtype for o in outs] == [torch.float32] * 5


# --- policies and settings -------------------------------------------------------------------


def test_set_policy_and_scoped_policy():
    bn, x = nn.BatchNorm2d(3), torch.randn(4, 3, 2, 2).bfloat16()
    amp_bn_fix.set_policy("INPUT")  # names are case-insensitive
    assert amp_bn_fix.get_policy() == "input"
    assert amp_bn_fix.get_config().sources["policy"] == "API"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bn(x).dtype is torch.bfloat16
        with amp_bn_fix.policy("fp32"):
            assert amp_bn_fix.get_policy() == "fp32"
            assert bn(x).dtype is torch.float32
            with amp_bn_fix.policy("off"):
                assert bn(x).dtype is torch.bfloat16
            assert bn(x).dtype is torch.float32
        assert amp_bn_fix.get_policy() == "input"


@pytest.mark.parametrize("call", [amp_bn_fix.set_policy, amp_bn_fix.enable, lambda n: amp_bn_fix.policy(n).__enter__()])
def test_unknown_policy_names_the_allowed_ones(call):
    with pytest.raises(ValueError, match=r"'fp16'.*fp32, input, autocast, off"):
        call("fp16")
    assert amp_bn_fix.get_policy() == "fp32"


def test_scoped_policies_are_per_thread():
    bn, x = nn.BatchNorm2d(3), torch.randn(4, 3, 2, 2).bfloat16()
    barrier = threading.Barrier(2)
    seen = {}

    def worker(name, policy):
        with amp_bn_fix.policy(policy), torch.autocast("cpu", dtype=torch.bfloat16):
            barrier.wait()  # both scopes are open at once
            seen[name] = (amp_bn_fix.get_policy(), bn(x).dtype)
            barrier.wait()

    threads = [threading.Thread(target=worker, args=args) for args in (("a", "input"), ("b", "fp32"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": ("input", torch.bfloat16), "b": ("fp32", torch.float32)}
    assert amp_bn_fix.get_policy() == "fp32"


def test_enable_disable_from_many_threads_never_doubles_or_loses_the_patch():
    def toggle(i):
        for j in range(200):
            amp_bn_fix.enable() if (i + j) % 2 else amp_bn_fix.disable()

    threads = [threading.Thread(target=toggle, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    amp_bn_fix.enable()
    assert F.batch_norm.__wrapped__ is ORIGINAL
    amp_bn_fix.disable()
    assert F.batch_norm is ORIGINAL


def test_devices_setting_selects_device_types():
    bn, x = nn.BatchNorm2d(3), torch.randn(4, 3, 2, 2).bfloat16()
    amp_bn_fix.configure(devices="cuda")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bn(x).dtype is torch.bfloat16  # cpu not selected: native
    amp_bn_fix.configure(devices="cuda,cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bn(x).dtype is torch.float32


# --- pass-through calls are bitwise native ---------------------------------------------------


def native_and_patched(fn):
    """Run ``fn`` on fresh copies with the shim disabled and enabled; return both results."""
    results = []
    for enabled in (False, True):
        amp_bn_fix.enable() if enabled else amp_bn_fix.disable()
        results.append(fn())
    return results


@pytest.mark.parametrize(
    "case",
    ["fp32-no-autocast", "fp32-under-autocast", "fp64", "policy-off", "device-not-selected"],
)
def test_pass_through_is_bitwise_native(case):
    torch.manual_seed(0)
    base = nn.BatchNorm2d(3).train()
    dtype = {"fp64": torch.float64, "fp32-no-autocast": torch.float32, "fp32-under-autocast": torch.float32}.get(
        case, torch.bfloat16
    )
    # (An all-half call outside autocast is torch's too, but for its running-stat update:
    # test_half_models.)
    if dtype is torch.float64:
        base = base.double()
    x0 = torch.randn(4, 3, 5, 5).to(dtype)
    if case == "policy-off":
        amp_bn_fix.set_policy("off")
    if case == "device-not-selected":
        amp_bn_fix.configure(devices=["cuda"])
    autocast = case not in ("fp32-no-autocast", "fp64")

    def step():
        bn, x = copy.deepcopy(base), x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = bn(x)
        out.float().square().sum().backward()
        return out, bn.running_mean, bn.running_var, x.grad, bn.weight.grad, bn.bias.grad

    native, patched = native_and_patched(step)
    for a, b in zip(native, patched):
        assert a.dtype is b.dtype and torch.equal(a, b)


def test_every_calling_style_matches_the_original_outside_autocast():
    x = torch.randn(4, 3, 2, 2)
    rm, rv, w, b = torch.zeros(3), torch.ones(3), torch.rand(3), torch.rand(3)
    styles = [
        lambda f: f(x, rm.clone(), rv.clone()),
        lambda f: f(x, rm.clone(), rv.clone(), w, b, True, 0.3, 1e-3),
        lambda f: f(input=x, running_mean=rm.clone(), running_var=rv.clone(), weight=w, training=True),
        lambda f: f(x, None, None, training=True),
        lambda f: f(x, rm.clone(), rv.clone(), None, b),
    ]
    for style in styles:
        torch.testing.assert_close(style(F.batch_norm), style(ORIGINAL), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_calling_style_is_handled_under_autocast(dtype):
    x = torch.randn(4, 3, 2, 2).to(dtype)
    tensors = (torch.zeros(3), torch.ones(3), torch.rand(3) + 0.5, torch.rand(3))
    styles = [
        lambda f, y, rm, rv, w, b: f(y, rm, rv),
        lambda f, y, rm, rv, w, b: f(y, rm, rv, w, b, True, 0.3, 1e-3),
        lambda f, y, rm, rv, w, b: f(input=y, running_mean=rm, running_var=rv, weight=w, training=True),
        lambda f, y, rm, rv, w, b: f(y, None, None, training=True),
        lambda f, y, rm, rv, w, b: f(y, rm, rv, None, b),
    ]
    for style in styles:
        ours = [t.clone() for t in tensors]
        ref = [t.double() for t in tensors]
        with torch.autocast("cpu", dtype=dtype):
            out = style(F.batch_norm, x, *ours)
        expected = style(ORIGINAL, x.double(), *ref)
        assert out.dtype is torch.float32
        n = x.numel() // x.shape[1]
        assert_near(out, expected, n, what="output")
        assert_near(ours[0], ref[0], n, what="running mean")
        assert_near(ours[1], ref[1], n, what="running var")


def test_empty_batch_under_autocast():
    rm, rv = torch.zeros(3), torch.ones(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.batch_norm(torch.empty(0, 3, 2, 2, dtype=torch.bfloat16), rm, rv, training=True)
    native_rm, native_rv = torch.zeros(3), torch.ones(3)
    ORIGINAL(torch.empty(0, 3, 2, 2, dtype=torch.bfloat16), native_rm, native_rv, training=True)
    assert out.shape == (0, 3, 2, 2) and out.dtype is torch.float32
    assert torch.equal(rm, native_rm) and torch.equal(rv, native_rv)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((torch.randn(1, 3).bfloat16(), torch.zeros(3), torch.ones(3)), {"training": True}),  # one value per channel
        ((torch.randn(4, 3).bfloat16(), torch.zeros(3), torch.ones(3)), {"training": True, "eps": 0.0}),
        ((torch.randn(4, 3).bfloat16(), torch.zeros(3), torch.ones(3)), {"eps": -1.0}),
        ((torch.randn(4, 3).bfloat16(),), {}),  # missing arguments
        ((torch.randn(4, 3).bfloat16(), torch.zeros(3), torch.ones(3)), {"bogus": 1}),
        ((torch.randn(4, 3).bfloat16(), torch.zeros(2), torch.ones(2)), {"training": True}),  # wrong size
        # Wrong types, on a shape the FP32 training fast path would take if they were right.
        ((torch.randn(4, 3, 8, 8).bfloat16(), torch.zeros(3), torch.ones(3)), {"training": True, "momentum": None}),
        ((torch.randn(4, 3, 8, 8).bfloat16(), torch.zeros(3), torch.ones(3)), {"training": "yes"}),
        ((torch.randn(4, 3, 8, 8).bfloat16(), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long)), {"training": True}),
    ],
)
def test_errors_are_the_originals(args, kwargs):
    # torch 2.4 to 2.8 accept eps <= 0: then the shim must accept it too, and compute what they do.
    with shim_disabled(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = outcome(ORIGINAL, args, kwargs, input_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = outcome(F.batch_norm, args, kwargs)
    x = args[0]
    compare_outcomes(ours, theirs, lambda: outcome(ORIGINAL, args, kwargs, dtype=torch.float64),
                     n=x.numel() // x.shape[1])


@pytest.mark.parametrize("which", ["stats", "weight", "module"])
def test_float64_parameters_with_a_16_bit_input_get_torchs_error(which):
    """torch's kernels reject them with a 16-bit input; the shim must not compute the call instead."""
    x = torch.randn(4, 3, 5, 5).bfloat16()

    def call():
        if which == "module":
            return nn.BatchNorm2d(3).double()(x)
        double = torch.zeros(3, dtype=torch.float64)
        if which == "stats":
            return F.batch_norm(x, double, double + 1, torch.ones(3), torch.zeros(3), training=True)
        return F.batch_norm(x, torch.zeros(3), torch.ones(3), double + 1, None, training=True)

    with shim_disabled(), torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError) as theirs:
        call()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError) as ours:
        call()
    assert str(ours.value) == str(theirs.value)


# --- re-entrancy -----------------------------------------------------------------------------


class CountingMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.batch_norm_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.batch_norm or getattr(func, "__wrapped__", None) is ORIGINAL:
            self.batch_norm_calls += 1
        return func(*args, **(kwargs or {}))


class PassThroughTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs)


@pytest.fixture
def counted_calls():
    """What ``amp_bn_fix.report()`` counts from here on: the calls handled per policy, and those
    passed through. Every call the shim decides on is counted once, one way or the other; a
    re-entered call, never decided, is not counted."""
    before = amp_bn_fix.report()

    def counted():
        after = amp_bn_fix.report()
        handled = {policy: calls - before["handled"].get(policy, 0) for policy, calls in after["handled"].items()}
        passed = after["passed_through"] - before["passed_through"]
        return {policy: calls for policy, calls in handled.items() if calls}, passed

    return counted


def test_torch_function_mode_reentry_applies_the_policy_once(counted_calls):
    bn, x = nn.BatchNorm2d(3), torch.randn(4, 3, 2, 2).bfloat16()
    expected = fp64_batch_norm(x, weight=bn.weight, bias=bn.bias).out
    with CountingMode() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        out = bn(x)
    assert mode.batch_norm_calls >= 1  # the mode did route F.batch_norm back through the wrapper
    assert counted_calls() == ({"fp32": 1}, 0)  # decided and handled once, not again when re-entered
    assert out.dtype is torch.float32
    assert_near(out, expected, x.numel() // x.shape[1])


def test_tensor_subclass_reentry_applies_the_policy_once(counted_calls):
    bn = nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2).bfloat16().as_subclass(PassThroughTensor)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bn(x)
    assert counted_calls() == ({"fp32": 1}, 0)  # decided and handled once, not again when re-entered
    assert out.dtype is torch.float32 and isinstance(out, PassThroughTensor)


# --- compilers and transforms ----------------------------------------------------------------


def autocast_step(model, dtype=torch.bfloat16):
    def step(x):
        with torch.autocast("cpu", dtype=dtype):
            y = model(x)
        return y.float().square().mean(), y

    return step


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("policy", ["fp32", "input"])
def test_torch_compile_fullgraph_matches_eager(backend, policy):
    torch._dynamo.reset()
    amp_bn_fix.set_policy(policy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    eager_loss, eager_y = autocast_step(model)(x)
    eager_loss.backward()
    compiled = torch.compile(autocast_step(twin), backend=backend, fullgraph=True)
    loss, y = compiled(x)
    loss.backward()
    assert y.dtype is eager_y.dtype is torch.bfloat16
    # float64 from the BatchNorm's input on: the first conv is torch's own, in bfloat16.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](x).detach().double()
    bn, head = model[1], model[3]
    # From zeros and ones: the model's own stats hold the eager step's update by now.
    ref = fp64_batch_norm(hidden, torch.zeros(4), torch.ones(4), bn.weight, bn.bias, True, bn.momentum, bn.eps)
    out64 = ref.out.relu()
    y64 = F.conv2d(out64, head.weight.double(), head.bias.double())
    # The last conv in bfloat16: its input, its weights and its output rounded once each.
    magnitude = F.conv2d(out64.abs(), head.weight.double().abs(), head.bias.double().abs())
    n = hidden.numel() // 4
    for name, net, out in (("eager", model, eager_y), ("compiled", twin, y)):
        assert_within(out, y64, rounding_bound(magnitude, {torch.bfloat16: 3}, n=4, sums=1), what=f"{name} output")
        assert_near(net[1].running_mean, ref.running_mean, n, what=f"{name} running mean")
        assert_near(net[1].running_var, ref.running_var, n, what=f"{name} running var")
    # The same bfloat16 backward, its reductions possibly in another order: a few roundings apart.
    eager_grad = model[0].weight.grad
    bound = same_computation_bound(eager_grad, {torch.bfloat16: 4})
    assert_within(twin[0].weight.grad, eager_grad, bound, what="compiled weight gradient")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fp32_output_of_bn(backend):
    torch._dynamo.reset()
    bn = nn.BatchNorm2d(4)
    x = torch.randn(4, 4, 5, 5).bfloat16()
    expected = fp64_batch_norm(x, weight=bn.weight, bias=bn.bias).out

    @torch.compile(backend=backend, fullgraph=True)
    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return bn(x)

    out = f(x)
    assert out.dtype is torch.float32
    assert_near(out, expected, x.numel() // x.shape[1])


def compiled_bn_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)).train()

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    return step, torch.compile(step, backend="aot_eager", fullgraph=True)


def test_compiled_code_follows_process_wide_settings():
    # Dynamo cannot see the policy: a settings change must make compiled code recompile.
    torch._dynamo.reset()
    step, compiled = compiled_bn_step()
    x = torch.randn(64, 8)
    assert compiled(x).dtype is step(x).dtype is torch.float32
    amp_bn_fix.set_policy("input")
    assert compiled(x).dtype is step(x).dtype is torch.bfloat16
    amp_bn_fix.set_policy("fp32")
    assert compiled(x).dtype is torch.float32
    amp_bn_fix.disable()
    assert compiled(x).dtype is step(x).dtype is torch.bfloat16
    amp_bn_fix.enable()
    assert compiled(x).dtype is torch.float32


def test_scope_around_compiled_code_warns_that_it_does_not_reach_it(monkeypatch):
    monkeypatch.setattr(_config, "_warned_compiled_scope", False)
    torch._dynamo.reset()
    step, compiled = compiled_bn_step()
    x = torch.randn(64, 8)
    compiled(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp_bn_fix.policy("fp32"):  # the policy it was compiled under: nothing to say
            assert compiled(x).dtype is torch.float32
    with pytest.warns(RuntimeWarning, match=r"in force here, 'input', does not reach code torch.compile") as record:
        with amp_bn_fix.policy("input"):
            pass
    ours = [w for w in record if "amp_bn_fix: the policy in force here" in str(w.message)]
    assert [w.filename for w in ours] == [__file__]  # torch may warn too, from its own files


@pytest.mark.parametrize("how", ["with", "decorator"])
def test_leaving_the_scope_compiled_code_was_compiled_in_warns_that_it_keeps_that_policy(monkeypatch, how):
    # Compiled inside a policy() block, as the warning above recommends: the code keeps that policy
    # after the block too, where another one is in force.
    monkeypatch.setattr(_config, "_warned_compiled_scope", False)
    monkeypatch.setattr(_state, "compiled_policies", set())
    torch._dynamo.reset()
    step, compiled = compiled_bn_step()
    x = torch.randn(64, 8)

    @amp_bn_fix.policy("input")
    def call():
        return compiled(x)

    with pytest.warns(RuntimeWarning, match=r"in force here, 'fp32', does not reach code .*\(under input\)") as record:
        if how == "with":
            with amp_bn_fix.policy("input"):
                assert compiled(x).dtype is torch.bfloat16  # compiled here, under "input"
        else:
            assert call().dtype is torch.bfloat16
    ours = [w for w in record if "amp_bn_fix: the policy in force here" in str(w.message)]
    assert [w.filename for w in ours] == [__file__]  # torch may warn too, from its own files


def test_compile_cache_key_carries_the_settings():
    config = pytest.importorskip("torch.compiler.config")
    if not hasattr(config, "cache_key_tag"):
        pytest.skip("this torch has no compile cache key tag")
    # Restored by hand: pytest 9's monkeypatch restores an attribute missing from the module's
    # __dict__ by deleting it, which hides torch's config entry and breaks every later compile.
    saved = config.cache_key_tag
    config.cache_key_tag = "user-tag"
    try:
        amp_bn_fix.set_policy("input")
        # ``dispatch``: the autocast keys the dispatcher door's kernels are registered at
        assert config.cache_key_tag == "user-tag|amp_bn_fix:policy=input,guard=1,devices=all,dispatch=cpu+cuda+xpu"
        with amp_bn_fix.policy("off"):
            assert config.cache_key_tag == "user-tag|amp_bn_fix:policy=off,guard=1,devices=all,dispatch=cpu+cuda+xpu"
        assert config.cache_key_tag.endswith("policy=input,guard=1,devices=all,dispatch=cpu+cuda+xpu")
        amp_bn_fix.disable()
        assert config.cache_key_tag == "user-tag"
    finally:
        config.cache_key_tag = saved


COMPILE_PROBE = """
import os, sys, torch
from torch import nn
if os.environ.get("PROBE_SHIM"):
    import amp_bn_fix
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).train()
def step(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)
x = torch.randn(4, 3, 16, 16)
compiled = torch.compile(step, backend="inductor")(x)
torch.compiler.reset()
eager = step(x)
print(compiled.dtype, eager.dtype, (compiled.float() - eager.float()).abs().max().item(), eager.abs().max().item())
"""


@pytest.mark.slow
def test_on_disk_compile_caches_do_not_mix_runs_with_and_without_the_shim(tmp_path):
    # Inductor's and AOTAutograd's caches outlive the process and are shared by a user's runs.
    import subprocess
    import sys

    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    # Each run finds the others' artifacts on disk: none may take another setting's.
    runs = [({}, "torch.bfloat16"), ({"PROBE_SHIM": "1"}, "torch.float32"),
            ({"PROBE_SHIM": "1", "AMP_BN_FIX_POLICY": "input"}, "torch.bfloat16"), ({}, "torch.bfloat16")]
    for extra, dtype in runs:
        result = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env={**env, **extra},
                                capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        assert result.returncode == 0, result.stderr[-2000:]
        compiled_dtype, eager_dtype, diff, scale = result.stdout.split()
        assert (compiled_dtype, eager_dtype) == (dtype, dtype), extra
        # Two computations of one output, rounded to bfloat16: an ulp (two roundings) apart at most.
        assert float(diff) <= rounding_bound(float(scale), {torch.bfloat16: 2}), extra


@pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 5),
    reason="torch 2.4's export cannot handle torch.autocast inside forward, with or without the shim: "
    "strict export fails its own verifier (Node.meta _enter_autocast is missing val field), non-strict "
    "export does not apply the block",
)
def test_torch_export():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.bn(self.linear(x))

    x = torch.randn(8, 4)
    model = Net().eval()
    # Non-strict, the default from torch 2.8: strict export (the default up to 2.6) records the block
    # without running it, and the shim raises then (README, Compatibility).
    program = torch.export.export(model, (x,), strict=False)
    out = program.module()(x)
    assert out.dtype is torch.float32
    # The program and eager mode compute the same FP32 batch norm, in kernels that may sum in other
    # orders: each against float64 on the linear layer's bfloat16 output.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.linear(x)
    exact = fp64_module(model.bn, hidden).out
    for result in (out, model(x)):
        assert_near(result, exact, 1, what="exported eval")


def test_vmap_and_functional_call():
    bn = nn.BatchNorm2d(3)
    xs = torch.randn(5, 4, 3, 2, 2).bfloat16()
    # Under vmap too a 16-bit input with autocast enabled gets the policy: FP32 arithmetic, FP32 out.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batched = torch.func.vmap(lambda x: F.batch_norm(x, None, None, bn.weight, bn.bias, training=True))(xs)
    exact = torch.stack([fp64_batch_norm(x, weight=bn.weight, bias=bn.bias).out for x in xs])
    assert batched.dtype is torch.float32
    # vmap's batched kernel and the per-sample one sum in different orders: each against float64.
    assert_near(batched, exact, xs[0].numel() // xs.shape[2], what="vmap")

    state = {k: v.clone() for k, v in bn.state_dict().items()}
    params = {**dict(bn.named_parameters()), **state}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.func.functional_call(bn, params, (xs[0],))
    # The call functional_call made, with the module's state (unchanged, as checked below).
    expected = fp64_module(bn, xs[0])
    assert out.dtype is torch.float32
    assert_near(out, expected.out, xs[0].numel() // xs.shape[2], what="functional_call")
    # The passed-in buffers got the update, the module's own did not.
    assert_near(state["running_mean"], expected.running_mean, xs[0].numel() // xs.shape[2], what="running mean")
    assert torch.equal(bn.running_mean, torch.zeros(3))


def test_disable_under_a_wrapper_without_wrapped_says_the_shim_stays(monkeypatch):
    inner = F.batch_norm

    def foreign(*args, **kwargs):  # another library's patch, keeping no __wrapped__
        return inner(*args, **kwargs)

    monkeypatch.setattr(F, "batch_norm", foreign)
    with pytest.warns(RuntimeWarning, match=r"cannot remove the shim from torch\.nn\.functional\.batch_norm.*"
                      r"no __wrapped__.*stays active"):
        amp_bn_fix.disable()
    assert amp_bn_fix.is_enabled()
    x = torch.randn(4, 3, 2, 2).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.batch_norm(x, None, None, training=True).dtype is torch.float32  # still the shim's


def test_the_wrapper_binds_as_a_static_function():
    # Set through wrapt's base class (no public spelling): a function binding would look up
    # ``__self__`` on every call. If wrapt renames or reorders it, this fails.
    assert F.batch_norm._self_binding == "staticmethod"
    assert F.batch_norm._self_instance is None and F.batch_norm.__wrapped__ is ORIGINAL
