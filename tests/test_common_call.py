"""The common call: a ``plain`` plan, and the plan's memo.

BatchNorm modules call ``F.batch_norm`` with eight arguments by position; when that call is the
common one, the plan marks it ``plain``, and ``_compute.run`` and the guard skip the questions such a
call has settled. The same call planned as any other (``plain`` off, the ``general`` runs here) must
give the same output, gradients, running stats and record, bit for bit, on every route; so must the
same call spelled with keywords.

The plan keeps the table's answer for untraced calls: whatever it kept, each call's plan must be
the one the table makes for it (the last section).
"""

import contextlib
import functools
import itertools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
import wrapt

import amp_bn_fix
from _shared import ORIGINAL, SUBPROCESS_TIMEOUT, child_env, outcome
from amp_bn_fix import _compat, _compute, _doors, _master, _plan, _record, _state

NAMES = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
# The calls' tests on the CPU's route (its guard both ways) and on the route a CUDA call takes (see conftest).
every_route = pytest.mark.usefixtures("every_route")
both_routes = pytest.mark.usefixtures("both_routes")
POLICIES = ["fp32", "input", "autocast", "off"]


@pytest.fixture
def lane_calls(monkeypatch):
    """How many calls ``_compute.run`` computed on a plain plan (the lane)."""
    calls = []
    real = _compute.run

    def counting(original, call, plan, **kwargs):
        if plan.plain:
            calls.append(1)
        return real(original, call, plan, **kwargs)

    monkeypatch.setattr(_compute, "run", counting)
    return calls


@contextlib.contextmanager
def _general(on=True):
    """With ``on``, every plan is made as for a call that is not the common one (``plain`` off)."""
    if not on:
        yield
        return
    real = _plan.plan

    def general(*args, **kwargs):
        found = real(*args, **kwargs)
        return found if found is None else found._replace(plain=False)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_doors, "plan", general)
        yield


def _common(args):
    """Whether the lane takes ``args`` (the default settings' plan)."""
    found = _plan.plan(args)
    return found is not None and found.plain


def _tensors(dtype, layout, affine, stats, finite, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, 5, 3, generator=g) * 3 + 1.5
    if not finite:
        x[1, 2, 0, 0] = float("inf")
    x = x.to(dtype).contiguous(memory_format=layout).requires_grad_()
    weight = (torch.rand(6, generator=g) + 0.5).requires_grad_() if affine else None
    bias = torch.randn(6, generator=g).requires_grad_() if affine else None
    mean = torch.randn(6, generator=g) if stats else None
    var = torch.rand(6, generator=g) + 0.5 if stats else None
    return [x, mean, var, weight, bias]


def _run(tensors, training, by_keyword, general=False):
    """One call on copies of ``tensors``: output, gradients, running stats and what report() counted."""
    copies = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    for i, t in enumerate(tensors):
        if t is not None and i == 0:
            copies[0] = t.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    args = (*copies, training, 0.1, 1e-5)
    _record.reset()  # a record of a dead tensor whose id a new one takes would be replaced
    with torch.autocast("cpu", dtype=torch.bfloat16), _general(general):
        out = F.batch_norm(**dict(zip(NAMES, args))) if by_keyword else F.batch_norm(*args)
    out.float().square().sum().backward()
    record = amp_bn_fix.report()
    counted, skips = record["handled"], sum(record["guard_skips"].values())
    grads = [None if t is None or not t.requires_grad else t.grad for t in copies]
    return out, grads, copies[1:3], counted, skips


def _assert_identical(a, b, what):
    if a is None or b is None:
        assert a is b, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), what


@every_route
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# (training, running stats): eval without running stats is torch's error, not a computation.
@pytest.mark.parametrize("training,stats", [(True, True), (True, False), (False, True)],
                         ids=["train", "train-no-stats", "eval"])
@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf"])
@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left")
def test_lane_equals_full_decision(policy, dtype, training, stats, guard, layout, affine, finite, lane_calls):
    tensors = _tensors(dtype, layout, affine, stats, finite)
    with amp_bn_fix.policy(policy), amp_bn_fix.configure(guard=guard):
        full = _run(tensors, training, by_keyword=False, general=True)
        assert not lane_calls, "a plan made as for any other call is not plain"
        lane = _run(tensors, training, by_keyword=False)
        assert lane_calls == [1], "the modules' call (by position) takes the lane"
        keyword = _run(tensors, training, by_keyword=True)
        assert lane_calls == [1, 1], "the same call by keyword is the same plain call"
    for a, b in zip(keyword, lane):
        if isinstance(a, torch.Tensor):
            _assert_identical(a, b, "by keyword")
    _assert_identical(lane[0], full[0], "output")
    for name, a, b in zip(("input", "weight", "bias"), lane[1][:1] + lane[1][3:], full[1][:1] + full[1][3:]):
        _assert_identical(a, b, f"{name} gradient")
    for name, a, b in zip(("running_mean", "running_var"), lane[2], full[2]):
        _assert_identical(a, b, name)
    assert lane[3] == full[3] == {policy: 1}
    assert lane[4] == full[4] == (1 if training and stats and guard and not finite else 0)


def _bf16(*shape):
    return torch.randn(*shape).bfloat16()


class _Sub(torch.Tensor):
    pass


def _common_args():
    return [_bf16(4, 6, 3), torch.zeros(6), torch.ones(6), torch.ones(6, requires_grad=True),
            torch.zeros(6, requires_grad=True), True, 0.1, 1e-5]


def _set(index, value):
    def change(args):
        args[index] = value(args[index]) if callable(value) else value
    return change


# Each is one reason the call is not the common one; the full decision then takes it.
NOT_COMMON = {
    "16-bit weight": _set(3, lambda w: w.detach().bfloat16()),
    "16-bit bias": _set(4, lambda b: b.detach().bfloat16()),
    "16-bit running_mean": _set(1, lambda m: m.bfloat16()),
    "16-bit running_var": _set(2, lambda v: v.bfloat16()),
    "one-dimensional input": _set(0, _bf16(6)),
    "training given as int": _set(5, 1),
    "only running_mean": _set(2, None),
    "only running_var": _set(1, None),
    "stats require grad": _set(1, lambda m: m.requires_grad_()),
    "expanded stats": _set(2, torch.ones(1).expand(6)),
    "two-dimensional stats": _set(1, torch.zeros(1, 6)),
    "stats of other shapes": _set(2, torch.ones(7)),
    "no channels": _set(1, torch.zeros(0)),
    "stats on another device": _set(2, torch.ones(6, device="meta")),
    "a tensor subclass": _set(0, lambda x: x.as_subclass(_Sub)),
    "eval with 16-bit stats": lambda args: (_set(5, False)(args), _set(1, lambda m: m.half())(args)),
}


@every_route
@pytest.mark.parametrize("reason", list(NOT_COMMON))
def test_not_common(reason):
    args = _common_args()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _common(tuple(args)), "the unchanged call is the common one"
        NOT_COMMON[reason](args)
        assert not _common(tuple(args))


@every_route
@pytest.mark.parametrize("context", ["autocast off", "a TorchFunctionMode", "torch.func"])
def test_not_common_where_the_call_runs(context):
    args = tuple(_common_args())
    if context == "autocast off":
        assert not _common(args)
        return
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if context == "a TorchFunctionMode":
            class Mode(torch.overrides.TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    return func(*args, **(kwargs or {}))

            with Mode():
                assert not _common(args)
        else:
            seen = []
            torch.func.grad(lambda w: (seen.append(_common((args[0], *args[1:3], w, *args[4:])))
                                       or w.sum()))(args[3].detach())
            assert seen == [False]


CHECKS = {
    "one value per channel": dict(input=_bf16(1, 6, 1, 1)),
    "eps 0 in training": dict(eps=0.0),
    "negative eps": dict(training=False, eps=-1.0),
    "eps an int": dict(eps=1),
    "weight a float": dict(weight=1.0),
    "bias a list": dict(bias=[0.0] * 6),
    "running_mean a float in eval": dict(training=False, running_mean=0.0),
}


@every_route
@pytest.mark.parametrize("policy", ["fp32", "off"])
@pytest.mark.parametrize("case", list(CHECKS))
def test_lane_keeps_torchs_checks(case, policy):
    """F.batch_norm's own checks and torch's argument errors (the lane calls torch.batch_norm
    directly once they pass), whatever the policy."""
    given = dict(zip(NAMES, (_bf16(4, 6, 3), torch.zeros(6), torch.ones(6), torch.ones(6), torch.zeros(6), True,
                             0.1, 1e-5)))
    given.update(CHECKS[case])
    outcomes = []
    for general in (False, True):
        args = tuple(given[name] for name in NAMES)
        with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy(policy), _general(general):
            try:
                out = F.batch_norm(*args)
            except Exception as error:  # the error is what is compared
                outcomes.append((type(error), str(error)))
            else:
                outcomes.append((out, args[1], args[2]))
    lane, full = outcomes
    if isinstance(full[0], type):  # an error (which ones depends on the torch version)
        assert lane == full
    else:
        for a, b in zip(lane, full):
            _assert_identical(a, b, case)


def _counting(calls, function):
    @functools.wraps(function)
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)
    return counted


WRAPPERS = {
    "wrapt": lambda calls, f: wrapt.FunctionWrapper(f, lambda wrapped, _, args, kwargs: (
        calls.append(1), wrapped(*args, **kwargs))[1]),
    "functools.wraps": _counting,
    "plain": lambda calls, f: lambda *args, **kwargs: calls.append(1) or f(*args, **kwargs),
}


@contextlib.contextmanager
def _under_the_shim(library_wrapper):
    """``library_wrapper(F.batch_norm)`` put on while the shim is off: the function the shim wraps."""
    amp_bn_fix.disable()
    plain = F.batch_norm
    F.batch_norm = library_wrapper(plain)
    try:
        amp_bn_fix.enable()
        yield
    finally:
        amp_bn_fix.disable()
        F.batch_norm = plain
        amp_bn_fix.enable()


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_another_librarys_wrapper_under_the_shim_still_runs(kind):
    """A wrapper put on F.batch_norm while the shim was off is the function the shim wraps then:
    the lane calls it, not torch.batch_norm directly."""
    calls = []
    with _under_the_shim(functools.partial(WRAPPERS[kind], calls)):
        bn, x = torch.nn.BatchNorm2d(6), _bf16(4, 6, 3, 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = bn(x)
    assert calls == [1] and out.dtype == torch.float32


def test_a_patch_of_torch_batch_norm_still_runs(monkeypatch):
    """F.batch_norm looks torch.batch_norm up at each call; so does the lane."""
    calls = []
    monkeypatch.setattr(torch, "batch_norm", _counting(calls, torch.batch_norm))
    bn, x = torch.nn.BatchNorm2d(6), _bf16(4, 6, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bn(x)
    assert calls == [1]


def test_a_wrapper_put_on_before_the_import_still_runs():
    script = textwrap.dedent("""
        import functools, torch, torch.nn.functional as F
        calls = []
        plain = F.batch_norm

        @functools.wraps(plain)
        def counted(*args, **kwargs):
            calls.append(1)
            return plain(*args, **kwargs)

        F.batch_norm = counted
        import amp_bn_fix
        bn, x = torch.nn.BatchNorm2d(6), torch.randn(4, 6, 3, 3).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = bn(x)
        print(len(calls), out.dtype)
    """)
    result = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "torch.float32"]


@every_route
def test_default_device_modes_count_alike_in_both_spellings(lane_calls):
    """Under torch.set_default_device's mode the lane calls F.batch_norm itself, as a general plan does."""
    tensors = _tensors(torch.bfloat16, torch.contiguous_format, True, True, True)
    counts = []
    for by_keyword in (True, False):
        with torch.device("cpu"):
            _run(tensors, True, by_keyword)
        counts.append(amp_bn_fix.report())
    assert lane_calls == [1, 1]
    assert counts[0]["handled"] == counts[1]["handled"] == {"fp32": 1}
    assert counts[0]["passed_through"] == counts[1]["passed_through"]


@every_route
@pytest.mark.parametrize("by_keyword", [False, True], ids=["by-position", "by-keyword"])
def test_an_fp32_input_under_a_default_device_mode_is_torchs(lane_calls, by_keyword):
    """A mode makes FP32 calls reach the decision; an FP32 input is still not the shim's to compute."""
    tensors = _tensors(torch.float32, torch.contiguous_format, True, True, True)
    with torch.device("cpu"):
        out, *_ = _run(tensors, True, by_keyword)
    assert lane_calls == []
    assert amp_bn_fix.report()["handled"] == {}
    assert out.dtype is torch.float32


# ---- The call an FP32 model makes outside autocast: torch's, with no flag and no plan ----

_NEXT_TO = {"FP32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "absent": None}


def _fp32_calls():
    """FP32 inputs next to every dtype of weights and stats (each absent too), in training and eval."""
    for (stats, params), training in itertools.product(itertools.product(_NEXT_TO.values(), repeat=2), (False, True)):
        mean, var = (None, None) if stats is None else (torch.zeros(6, dtype=stats), torch.ones(6, dtype=stats))
        weight, bias = (None, None) if params is None else (torch.ones(6, dtype=params), torch.zeros(6, dtype=params))
        yield (torch.randn(4, 6, 3, 3), mean, var, weight, bias, training, 0.1, 1e-5)


@every_route
@pytest.mark.parametrize("keep_fp32", ["master", "stats", "none"])
def test_an_unseen_fp32_call_is_the_tables_torchs(keep_fp32):
    """The pass-through lane's rule (an FP32 input no autocast or override sees) gives what the
    table gives: torch's, under every policy and setting, whatever is next to the input."""
    calls = list(_fp32_calls())
    with amp_bn_fix.configure(keep_fp32=keep_fp32):
        for policy in POLICIES:
            with amp_bn_fix.policy(policy):
                for call in calls:
                    assert _plan.unseen_fp32(call)
                    assert _walked(call) is None, (policy, call)


@pytest.mark.parametrize("seen_by", ["autocast", "a mode", "a subclass", "16-bit input", "an FP64 input"])
def test_a_seen_call_is_not_unseen(seen_by):
    call = list(_common_args())
    call[0] = call[0].float()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if seen_by == "autocast" else (
        torch.device("cpu") if seen_by == "a mode" else contextlib.nullcontext())
    if seen_by == "a subclass":
        call[0] = call[0].as_subclass(_Sub)
    elif seen_by == "16-bit input":
        call[0] = call[0].bfloat16()
    elif seen_by == "an FP64 input":
        call[0] = call[0].double()
    with context:
        assert not _plan.unseen_fp32(tuple(call))


# Each changes one argument of an FP32 BatchNorm2d's call: torch's output, stats and errors, each
# once through F.batch_norm's own checks where the lane does not take torch.batch_norm directly.
FP32_CASES = {
    "train": {},
    "eval": dict(training=False),
    "no stats": dict(running_mean=None, running_var=None),
    "no affine": dict(weight=None, bias=None),
    "one value per channel": dict(input=torch.randn(1, 6, 1, 1)),
    "one value per channel in eval": dict(input=torch.randn(1, 6, 1, 1), training=False),
    "one-dimensional input": dict(input=torch.randn(6)),
    "eps 0 in training": dict(eps=0.0),
    "negative eps in eval": dict(training=False, eps=-1.0),
    "eps an int": dict(eps=1),
    "training an int": dict(training=1),
    "momentum None": dict(momentum=None),
    "16-bit stats": dict(running_mean=torch.zeros(6).bfloat16(), running_var=torch.ones(6).bfloat16()),
    "stats of another size": dict(running_mean=torch.zeros(7), running_var=torch.ones(7)),
    "weight a float": dict(weight=1.0),
    "channels_last": dict(input=torch.randn(4, 6, 3, 3).contiguous(memory_format=torch.channels_last)),
}


@pytest.mark.usefixtures("fresh_record")
@pytest.mark.parametrize("by_keyword", [False, True], ids=["by-position", "by-keyword"])
@pytest.mark.parametrize("case", list(FP32_CASES))
def test_an_fp32_call_outside_autocast_is_torchs_own_and_counted_once(case, by_keyword):
    given = dict(zip(NAMES, (torch.randn(4, 6, 3, 3) * 2 + 1, torch.zeros(6), torch.ones(6), torch.rand(6) + 0.5,
                             torch.randn(6), True, 0.1, 1e-5)))
    given.update(FP32_CASES[case])
    args = tuple(given[name] for name in NAMES)
    fn = (lambda *a: F.batch_norm(**dict(zip(NAMES, a)))) if by_keyword else F.batch_norm
    ours = outcome(fn, args)
    theirs = outcome(ORIGINAL, args)
    if isinstance(theirs, Exception):
        assert (type(ours), str(ours)) == (type(theirs), str(theirs))
    else:
        for a, b in zip(ours, theirs):
            _assert_identical(a, b, case)
    record = amp_bn_fix.report()
    assert (record["handled"], record["passed_through"]) == ({}, 1)


class _Recording(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", func))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.usefixtures("fresh_record")
@pytest.mark.parametrize("which", ["input", "weight"])
def test_an_fp32_subclass_outside_autocast_still_sees_its_call(which):
    """The lane calls torch.batch_norm directly only where no override would see F.batch_norm."""
    args = [torch.randn(4, 6, 3, 3), torch.zeros(6), torch.ones(6), torch.ones(6), torch.zeros(6), True, 0.1, 1e-5]
    index = NAMES.index(which)
    args[index] = args[index].as_subclass(_Recording)
    _Recording.seen = []
    out = F.batch_norm(*args)
    assert _Recording.seen.count("batch_norm") == 1 and type(out) is _Recording
    assert _Recording.seen.count("__get__") <= 1  # the shim reads a dtype once: the subclass sees its reads
    assert amp_bn_fix.report()["passed_through"] == 1


def _library_bn(input, running_mean, running_var, *, weight=None, bias=None, training=False, momentum=0.1,
                eps=1e-3):
    """Another library's F.batch_norm: keyword-only parameters, its own default eps."""
    return ORIGINAL(input, running_mean, running_var, weight, bias, training, momentum, eps)


@pytest.mark.usefixtures("fresh_record")
def test_an_fp32_call_reaches_a_library_wrapper_under_the_shim_as_it_came():
    """The lane hands a function other than torch's own the caller's arguments, not a bound call."""
    x = torch.randn(8, 4)
    expected = outcome(_library_bn, (x, torch.zeros(4), torch.ones(4)), dict(training=True))
    with _under_the_shim(lambda plain: _library_bn):
        got = outcome(F.batch_norm, (x, torch.zeros(4), torch.ones(4)), dict(training=True))
    for a, b in zip(got, expected):
        _assert_identical(a, b, "library wrapper")
    assert amp_bn_fix.report()["passed_through"] == 1


class _CallsAgainBelow(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that makes an F.batch_norm call of its own from inside torch's kernel."""

    busy = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "batch_norm" in str(func) and not self.busy:
            self.busy = True
            try:
                F.batch_norm(args[0], None, None, training=True)
            finally:
                self.busy = False
        return func(*args, **(kwargs or {}))


@pytest.mark.usefixtures("fresh_record")
def test_a_call_from_inside_torchs_kernel_goes_to_torch_uncounted():
    """A call passed to torch is decided once, also where a dispatch mode calls F.batch_norm again below it."""
    with _CallsAgainBelow():
        F.batch_norm(torch.randn(8, 4), torch.zeros(4), torch.ones(4), training=True)
    assert amp_bn_fix.report()["passed_through"] == 1


def test_an_object_with_a_float32_dtype_gets_torchs_error():
    given = (torch.TypedStorage(8, dtype=torch.float32), None, None)
    ours, theirs = outcome(F.batch_norm, given, dict(training=True)), outcome(ORIGINAL, given, dict(training=True))
    assert (type(ours), str(ours)) == (type(theirs), str(theirs))


def test_an_asyncio_task_made_inside_a_computed_call_is_computed_too():
    """The thread's flag is not a context's: a task scheduled while the shim computes a call does
    not inherit it, and its own autocast BatchNorm is computed in FP32."""
    import asyncio

    dtypes = []

    async def later():
        await asyncio.sleep(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes.append(torch.nn.BatchNorm1d(4)(torch.randn(8, 4).bfloat16()).dtype)

    class Spawn(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "batch_norm":
                asyncio.get_running_loop().create_task(later())
            return func(*args, **(kwargs or {}))

    async def main():
        with Spawn(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.BatchNorm1d(4)(torch.randn(8, 4).bfloat16())
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert dtypes and set(dtypes) == {torch.float32}


# ---- The plan's memo: the table's answer, kept by what the routes read ----


def _half_bn(dtype, state):
    """A 16-bit BatchNorm2d(6) whose buffers have no master, a master, or a master beyond float16's
    range (its 16-bit variance an inf): made under the default settings, on the route under test."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(6).to(dtype)
    if state != "no master":
        scale = 3e3 if state == "overflowed" else 1.0
        with torch.autocast("cpu", dtype=dtype), torch.no_grad():
            bn((torch.randn(8, 6, 4, 4) * scale).to(dtype))
        assert _master.peek(bn.running_mean, bn.running_var) is not None
        assert torch.isinf(bn.running_var).any() == (state == "overflowed")
    return bn


CALL_FORMS = {
    "half model": lambda bn, x: (x, bn.running_mean, bn.running_var, bn.weight, bn.bias),
    "affine=False": lambda bn, x: (x, bn.running_mean, bn.running_var, None, None),
    "FP32 weight": lambda bn, x: (x, bn.running_mean, bn.running_var, bn.weight.float(), bn.bias),
    "FP32 stats": lambda bn, x: (x, bn.running_mean.float(), bn.running_var.float(), bn.weight, bn.bias),
    "FP32 model": lambda bn, x: (x, bn.running_mean.float(), bn.running_var.float(), bn.weight.float(),
                                 bn.bias.float()),
    "no stats": lambda bn, x: (x, None, None, bn.weight, bn.bias),
    "FP32 input": lambda bn, x: (x.float(), bn.running_mean, bn.running_var, bn.weight, bn.bias),
}


def _calls(dtype):
    """Calls that differ in one fact each: every form of a half and an FP32 BatchNorm's call, each
    state of a master, training and eval, and each reason a call is not the common one."""
    calls = []
    for state in ["no master", "master", "overflowed"]:
        if state == "overflowed" and dtype is torch.bfloat16:
            continue  # bfloat16 holds any variance these inputs give
        bn = _half_bn(dtype, state)
        x = torch.randn(4, 6, 3, 3).to(dtype)
        for form in CALL_FORMS.values():
            calls += [(*form(bn, x), training, 0.1, 1e-5) for training in (False, True)]
    for change in [lambda args: None, *NOT_COMMON.values()]:  # the common call, and each way it is not
        args = _common_args()
        args[0] = args[0].to(dtype)
        change(args)
        calls.append(tuple(args))
    return calls


def _walked(call):
    """The table walked afresh for ``call``, as for any untraced call (no memo)."""
    device_type = call[0].device.type
    found = _plan.decide(_plan.Ask(call, _state.config, device_type, _state.policy(device_type), True,
                                   _compat.untraced(*call[:5])))
    if isinstance(found, _plan.Deferred):
        return found.plan if found.when(call[1], call[2]) else None
    return found


@both_routes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("keep_fp32", ["master", "none"])
def test_the_memo_answers_as_the_table(dtype, keep_fp32):
    """Whatever the memo saw before, the plan of each call is the table's for that call: the memo's
    key holds every fact a route reads (a fact left out would give two of these calls one answer).
    Every policy and autocast on and off, in both orders."""
    calls = _calls(dtype)
    with amp_bn_fix.configure(keep_fp32=keep_fp32):
        for order in (calls, calls[::-1]):
            for policy, autocast in itertools.product(POLICIES, [False, True]):
                with amp_bn_fix.policy(policy), torch.autocast("cpu", dtype=dtype, enabled=autocast):
                    for call in order:
                        if _plan.considered(call):
                            assert _plan.plan(call) == _walked(call), (policy, autocast, call)


def test_the_memo_follows_the_settings():
    """A change of settings is a new memo: the guard's setting reaches the next plan."""
    args = tuple(_common_args())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _plan.plan(args).guard
        with amp_bn_fix.configure(guard=False):
            assert not _plan.plan(args).guard
        assert _plan.plan(args).guard


def test_the_memo_stays_bounded(monkeypatch):
    monkeypatch.setattr(_plan, "_MEMO_SIZE", 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for channels in range(1, 40):
            x = _bf16(4, channels, 3)
            assert _plan.plan((x, torch.zeros(channels), torch.ones(channels), None, None, True, 0.1, 1e-5)).plain
    assert len(_plan._memo[1]) <= 8


@pytest.fixture
def tracing_context_reads(monkeypatch):
    """How many times torch's tracing context was read (dynamo imported, as an optimizer step imports it)."""
    import torch._dynamo  # noqa: F401
    import torch._guards

    reads = []
    real = torch._guards.TracingContext.try_get

    def counting():
        reads.append(1)
        return real()

    monkeypatch.setattr(torch._guards.TracingContext, "try_get", staticmethod(counting))
    return reads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32-program", "under-autocast"])
def test_a_call_passed_to_torch_reads_no_tracing_context(tracing_context_reads, autocast):
    # Once dynamo is imported (any optimizer step imports it), reading the tracing context cost the
    # call the shim passes on more than the rest of the shim together. Outside a tracer's modes no
    # compile can be under way that ``torch.compiler.is_compiling()`` does not report.
    bn = torch.nn.BatchNorm2d(4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), amp_bn_fix.policy("off"):
        bn(torch.randn(2, 4, 3, 3))  # FP32: not the shim's; bf16 under "off": considered, then torch's
        bn(torch.randn(2, 4, 3, 3, dtype=torch.bfloat16))
    assert amp_bn_fix.report()["passed_through"] >= 2
    assert tracing_context_reads == []


def test_a_tracer_under_a_tracing_context_counts_as_compiling(tracing_context_reads):
    # Where AOTAutograd traces a graph dynamo made: its modes on the stack and a tracing context
    # set, while ``torch.compiler.is_compiling()`` says nothing (torch 2.4 to 2.6 run the wrapper there).
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    assert not _compat.is_compiling()
    with tracing(TracingContext(fake)):
        assert not _compat.is_compiling()  # no tracer's mode: an eager call
        with fake:
            assert _compat.is_compiling()
    assert tracing_context_reads  # the context decided it


def test_a_call_torch_says_is_compiling_is_not_plain(monkeypatch):
    """Plain eager mode reads torch.compiler.is_compiling() as torch computes it, from its flag
    (which export sets while it traces): a call under it is not the common one."""
    args = tuple(_common_args())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _plan.plan(args).plain
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        assert torch.compiler.is_compiling()
        assert not _compat.untraced(*args[:5]) and not _plan.plan(args).plain
