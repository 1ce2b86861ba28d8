"""Programs that work on plain torch must work, and do the same, with the shim enabled.

Each test is one of the cases users met (TorchScript, copies and pickles, torch.export, jit.trace,
make_fx, FakeTensorMode, torch.compile, asyncio, generators, meta device, torch.func ensembles,
torch's own errors, importlib.reload), written as user code. Expected results come from plain torch
(the shim disabled, or the unpatched function) and from float64 references. Inputs are (4,3,16,16)
so every call is long enough per channel for the CPU fast paths that tracers must not record.
"""

import asyncio
import copy
import functools
import importlib
import io
import pickle
import threading
import warnings
import zipfile

import pytest
import torch
import torch.nn.functional as F
import wrapt
from torch import nn

import amp_bn_fix
from _bounds import assert_near, assert_within, fp32_bound, rounding_bound, same_computation_bound
from _builders import batch_norm, fp64_batch_norm, seeded_input
from _shared import ORIGINAL, assert_stats_replayed, record_inputs, shim_disabled
from amp_bn_fix import _config, _patch, _state

# TorchScript, jit.trace and jit.save/load say they are deprecated; these tests use them on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.* is deprecated:DeprecationWarning")

BF16 = torch.bfloat16
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def conv_bn(training=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).train(training)


def image():
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def plain_torch(fn):
    """``fn()`` with the shim disabled (plain torch), then as it was."""
    with shim_disabled():
        return fn()


def stats(model):
    bn = model[1]
    return bn.running_mean.clone(), bn.running_var.clone()


# --- 1. TorchScript ---------------------------------------------------------------------------


def helper(x: int) -> int:
    return x + 3


def test_torchscript_class_resolves_names_from_its_own_module():
    # TorchScript resolves a scripted class's names from the caller's frame: a wrapper frame around
    # torch.jit.script made ``helper`` undefined.
    @torch.jit.script
    class Counter:
        def __init__(self, start: int):
            self.value = start

        def bump(self) -> int:
            self.value = helper(self.value)
            return self.value

    assert Counter(1).bump() == 4


def bn_function(x, rm, rv, w, b, training: bool):
    return F.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's own deprecation notice

    @torch.jit.interface
    class NormInterface(nn.Module):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            pass


class UsesInterface(nn.Module):
    norm: NormInterface

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.norm(x)


def scripted_runs(script=True):
    """Run a scripted function, module and interface user, in training and eval, under autocast."""
    compile = torch.jit.script if script else (lambda f: f)
    x = image().to(BF16)
    results = []
    fn = compile(bn_function)
    for training in (True, False):
        rm, rv = torch.zeros(3, dtype=BF16), torch.ones(3, dtype=BF16)
        w, b = torch.rand(3, generator=torch.Generator().manual_seed(2)).to(BF16), torch.zeros(3, dtype=BF16)
        with autocast():
            out = fn(x, rm, rv, w, b, training)
        results += [out, rm, rv]
        for make in (lambda: nn.BatchNorm2d(3), UsesInterface):
            torch.manual_seed(0)
            module = compile(make().train(training))  # FP32 module, bfloat16 input
            with autocast():
                out = module(x)
            results += [out, *[buf for name, buf in module.named_buffers() if "running" in name]]
    return results


def fp64_runs():
    """``scripted_runs``' results computed in float64 on the same values."""
    x = image().to(BF16)
    results = []
    for training in (True, False):
        w = torch.rand(3, generator=torch.Generator().manual_seed(2)).to(BF16)
        for weight in (w, torch.ones(3), torch.ones(3)):
            ref = fp64_batch_norm(x, torch.zeros(3), torch.ones(3), weight, torch.zeros(3), training, 0.1, 1e-5)
            results += [ref.out, ref.running_mean, ref.running_var]
    return results


def test_torchscript_function_module_and_interface_get_the_policy():
    # TorchScript compiles the original F.batch_norm, whose ATen op reaches the shim's kernel at
    # autocast's key: scripted code gets the policy, and the eager shim's accuracy.
    ours = scripted_runs()
    eager = scripted_runs(script=False)
    assert len(ours) == len(eager) == 18
    n = image()[:, 0].numel()
    for a, b, exact in zip(ours, eager, fp64_runs()):
        assert a.dtype is b.dtype
        assert_near(a, exact, n, what="scripted")
        assert_near(b, exact, n, what="eager")
    outs = ours[0::3]
    assert all(out.dtype is torch.float32 for out in outs)  # the policy's float32, not bfloat16
    with amp_bn_fix.policy("off"):  # the policy off: plain torch's scripted code, bitwise
        off, theirs = scripted_runs(), plain_torch(scripted_runs)
    for a, b in zip(off, theirs):
        assert a.dtype is b.dtype and torch.equal(a, b)


class _ScriptedBlock(nn.Module):
    """Enough ops after a BatchNorm that TorchScript's autodiff differentiates the block itself: from
    its second run in training it calls ``aten::_batch_norm_impl_index`` and that op's backward."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(x)
        return torch.relu(y) * torch.sigmoid(y) + y, y


@pytest.mark.parametrize("half_model", [False, True], ids=["fp32-model", "half-model"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
def test_torchscript_autodiff_blocks_get_the_policy_at_every_run(policy, half_model):
    torch.manual_seed(0)
    block = _ScriptedBlock()
    with torch.no_grad():
        block.bn.weight.uniform_(0.5, 1.5)
        block.bn.bias.uniform_(-0.5, 0.5)
    if half_model:
        block = block.to(BF16)
    exact = copy.deepcopy(block).double()
    scripted = torch.jit.script(block).train()
    want = torch.float32 if policy == "fp32" else BF16
    for step in range(3):
        x = (torch.randn(8, 4, 6, 6, generator=torch.Generator().manual_seed(step)) * 2 + 1).to(BF16)
        x.requires_grad_()
        with torch.autocast("cpu", dtype=BF16), amp_bn_fix.policy(policy):
            out, y = scripted(x)
        out.float().sum().backward()
        x64 = x.detach().double().requires_grad_()
        out64, y64 = exact(x64)
        out64.sum().backward()
        n = x.numel() // 4
        assert y.dtype is want, step  # bfloat16 from the second run, before this door
        assert_near(y, y64, n, what="output")
        if policy == "fp32":  # the block after the BatchNorm in FP32 too: gradients to FP32 accuracy
            scale = x64.grad.abs().max().item()
            assert_near(x.grad, x64.grad, n, ops=8, scale=scale, what="input gradient")
        x.grad = None
    for stat, want in ((scripted.bn.running_mean, exact.bn.running_mean), (scripted.bn.running_var,
                                                                          exact.bn.running_var)):
        scale = want.abs().max().item() + 1
        if half_model:  # the executor hands the op aliases of the buffers, whose master it cannot
            # reach: FP32 updates, each rounded to bfloat16 (three here), as in traced code
            assert_within(stat, want, rounding_bound(scale, {BF16: 3}) + fp32_bound(want, n, scale=scale))
        else:
            assert_near(stat, want, n, scale=scale)
    assert amp_bn_fix.report()["handled"].get("fp32" if policy == "fp32" else policy, 0) >= 3


def test_torchscript_of_a_half_model_runs_as_in_plain_torch():
    # The cast keeps BatchNorm's weight, bias and stats FP32, a mix torch's kernels accept: the
    # scripted original computes it in FP32 and returns bfloat16, as plain torch's all-bfloat16 one.
    def run():
        torch.manual_seed(0)
        module = torch.jit.script(conv_bn().to(BF16))
        return module(image().to(BF16))

    out, expected = run(), plain_torch(run)
    assert out.dtype is expected.dtype is BF16
    # Plain torch's weights and stats are rounded to bfloat16 (these are exact in it: ones, zeros):
    # each result a rounding of nearly the same value.
    assert_within(out, expected, rounding_bound(expected.double().abs(), {BF16: 2}), what="against plain torch")


# --- 2. copies and pickles --------------------------------------------------------------------


class NetWithNormFn(nn.Module):
    """A model that keeps ``F.batch_norm`` in an attribute, as some libraries do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.norm_fn = functools.partial(F.batch_norm, momentum=0.2, eps=1e-3)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.norm_fn(y, None, None, training=True)


def test_copies_of_the_function_are_the_function_itself():
    # Like a plain function: copy and deepcopy return the very object.
    assert copy.copy(F.batch_norm) is F.batch_norm
    assert copy.deepcopy(F.batch_norm) is F.batch_norm
    part = functools.partial(F.batch_norm, training=True)
    assert copy.deepcopy(part).func is F.batch_norm


def stable_dumps(obj):
    """``pickle.dumps`` with storages numbered in order: plain pickles of tensors embed addresses."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
                return "storage", seen.setdefault(id(obj), len(seen))
            return None

    seen, out = {}, io.BytesIO()
    Pickler(out, protocol=4).dump(obj)
    return out.getvalue()


def test_pickles_are_byte_for_byte_plain_torchs_and_load_as_what_is_installed():
    def dumps():
        fn, part = F.batch_norm, functools.partial(F.batch_norm, momentum=0.2)
        saved = io.BytesIO()
        torch.save(part, saved)
        with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as archive:
            data = [archive.read(name) for name in archive.namelist() if name.endswith("data.pkl")]
        return pickle.dumps(fn), pickle.dumps(part), stable_dumps(NetWithNormFn()), saved.getvalue(), data

    ours, theirs = dumps(), plain_torch(dumps)
    assert ours[0] == theirs[0] and ours[1] == theirs[1] and ours[2] == theirs[2]
    assert len(ours[4]) == 1 and ours[4] == theirs[4]  # torch.save's pickle inside its zip
    # By reference: a pickle made with the shim loads as whatever is installed when it loads.
    assert pickle.loads(ours[1]).func is F.batch_norm
    assert plain_torch(lambda: pickle.loads(ours[1]).func) is ORIGINAL
    loaded = torch.load(io.BytesIO(ours[3]), weights_only=False)
    assert loaded.func is F.batch_norm and loaded.keywords == {"momentum": 0.2}


def test_the_other_patched_methods_copy_and_pickle_as_plain_torchs():
    # The methods the shim wraps besides F.batch_norm, looked up on a module or a class, as code that
    # copies or pickles a bound method (a callback, a functools.partial) does.
    bn = nn.BatchNorm1d(3)
    methods = {"bn._apply": lambda: bn._apply, "bn._load_from_state_dict": lambda: bn._load_from_state_dict,
               "BatchNorm1d._apply": lambda: nn.BatchNorm1d._apply,
               "SyncBatchNorm.apply": lambda: torch.nn.modules._functions.SyncBatchNorm.apply,
               "CheckpointFunction.apply": lambda: torch.utils.checkpoint.CheckpointFunction.apply}

    def function(method):  # a bound method's function, and the holder's type
        return getattr(method, "__func__", method), type(getattr(method, "__self__", None))

    for name, method in methods.items():
        ours, theirs = method(), plain_torch(method)
        assert ours is not theirs and function(ours.__wrapped__) == function(theirs), name  # the shim's wrapper
        for copied in (copy.copy(ours), copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
            assert function(copied.__wrapped__) == function(theirs), name
        # By reference: plain torch loads it as its own.
        assert function(plain_torch(lambda: pickle.loads(pickle.dumps(ours)))) == function(theirs), name
    twin = copy.deepcopy(bn._apply)  # as a bound method's: bound to a copy of its module
    assert type(twin.__self__) is nn.BatchNorm1d and twin.__self__ is not bn


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_ema_model_made_by_deepcopy_trains_and_pickles(training):
    def run():
        model = NetWithNormFn().train(training)
        ema = copy.deepcopy(model)  # raised NotImplementedError on the wrapt proxy
        x = image()
        with autocast():
            out = model(x)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            for e, b in zip(ema.buffers(), model.buffers()):
                e.copy_(b)
        with autocast():
            ema_out = ema(x)
        # The copy, and the copy pickled and loaded, hold the function installed now.
        assert ema.norm_fn.func is F.batch_norm
        assert pickle.loads(pickle.dumps(ema)).norm_fn.func is F.batch_norm
        return out, ema_out, stable_dumps(ema)

    out, ema_out, ema_bytes = run()
    plain_out, plain_ema_out, plain_bytes = plain_torch(run)
    assert ema_bytes == plain_bytes
    assert out.dtype is ema_out.dtype is torch.float32  # the policy applies in the copy too
    assert plain_out.dtype is BF16
    # Plain torch rounds the same values to bfloat16 on their way.
    assert_within(ema_out, plain_ema_out, same_computation_bound(plain_ema_out, {BF16: 2}), what="against plain torch")


# --- 3-5. torch.export, jit.trace, make_fx, FakeTensorMode, torch.compile -----------------------


def train_step(module, x):
    """Forward under autocast and backward; the output and each parameter's gradient."""
    with autocast():
        out = module(x)
    out.float().square().mean().backward()
    return out, [p.grad for p in module.parameters()]


def assert_matches_eager(out, grads, expected, expected_grads, policy):
    """One computation run two ways: FP32 values a few roundings apart, a bfloat16 output an ulp
    (two roundings) apart where they round the other way; gradients through bfloat16 convolutions
    likewise, and by FP32 roundings of the largest gradient where they cancel to about 0."""
    assert out.dtype is expected.dtype is (torch.float32 if policy == "fp32" else BF16)
    roundings = {torch.float32: 8}
    roundings[out.dtype] = roundings.get(out.dtype, 0) + 2
    assert_within(out, expected, same_computation_bound(expected, roundings), what="output")
    largest = max(b.abs().max().item() for b in expected_grads)
    for a, b in zip(grads, expected_grads):
        bound = same_computation_bound(b, {BF16: 2}) + rounding_bound(largest, {torch.float32: 16})
        assert_within(a, b, bound, what="gradient")


@pytest.mark.xfail(TORCH < (2, 6), reason="torch 2.4's export functionalization refuses the guard's "
                   "FP32 working copies of the stats (cannot mutate tensors with frozen storage)")
@pytest.mark.parametrize("policy", ["fp32", "input"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_export_in_training_under_autocast_updates_running_stats_like_eager(strict, policy):
    amp_bn_fix.set_policy(policy)
    eager, exported, x = conv_bn(), conv_bn(), image()
    inputs = record_inputs(eager[1])
    expected, expected_grads = train_step(eager, x)
    with autocast():
        program = torch.export.export(exported, (x,), strict=strict)
    module = program.module()
    before = [buf.clone() for name, buf in module.named_buffers() if "running" in name]
    out, grads = train_step(module, x)
    after = [buf for name, buf in module.named_buffers() if "running" in name]
    assert not torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])
    assert_stats_replayed(after, inputs)
    assert_matches_eager(out, grads, expected, expected_grads, policy)
    # Plain torch's program updates them too: the behaviour the shim must keep.
    plain = plain_torch(lambda: torch.export.export(conv_bn(), (x,), strict=strict).module())
    with autocast():
        plain(x)
    assert not torch.equal(dict(plain.named_buffers())["1.running_mean"], before[0])


def _saved_programs():
    torch.manual_seed(0)
    yield "FP32 model under autocast", conv_bn(), image(), True
    yield "half model", conv_bn().bfloat16(), image().bfloat16(), False
    tracked = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True, track_running_stats=True))
    yield "InstanceNorm under autocast", tracked, image(), True


@pytest.mark.skipif(TORCH < (2, 6), reason="torch 2.4's export functionalization refuses the guard's "
                    "FP32 working copies of the stats (cannot mutate tensors with frozen storage)")
@pytest.mark.parametrize("case", range(3), ids=[name for name, *_ in _saved_programs()])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_a_saved_training_program_loads_and_runs_as_it_was_exported(strict, case):
    # torch.export.load verifies every node: a block that only wrote the stats back (the guard's,
    # under the autocast exclusion or no_grad) had no outputs, which it refused.
    _, model, x, under_autocast = list(_saved_programs())[case]
    with torch.autocast("cpu", dtype=BF16, enabled=under_autocast):
        program = torch.export.export(model, (x,), strict=strict)
    initial = [buf.clone() for name, buf in program.module().named_buffers() if "running" in name]
    saved = io.BytesIO()
    torch.export.save(program, saved)
    saved.seek(0)
    loaded = torch.export.load(saved)
    results = []
    for each in (program, loaded):
        module = each.module()
        with torch.autocast("cpu", dtype=BF16, enabled=under_autocast):
            out = module(x)
        results.append((out, [buf.clone() for name, buf in module.named_buffers() if "running" in name]))
    (out, stats), (loaded_out, loaded_stats) = results
    assert torch.equal(out, loaded_out) and all(torch.equal(a, b) for a, b in zip(stats, loaded_stats))
    assert not torch.equal(stats[0], initial[0]) and not torch.equal(stats[1], initial[1])  # updated


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_exported_eval_model_runs_with_and_without_autocast(strict):
    model, x = conv_bn(training=False), image()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    with autocast():
        program = torch.export.export(model, (x,), strict=strict)
        expected = model(x)
        out = program.module()(x)
    assert out.dtype is expected.dtype is torch.float32
    assert_within(out, expected, same_computation_bound(expected, {torch.float32: 4}), what="under autocast")
    # Without autocast the program is an FP32 one, as plain torch's exported program is.
    out = program.module()(x)
    plain = plain_torch(lambda: program.module()(x))
    assert out.dtype is torch.float32
    for other in (model(x), plain):
        assert_within(out, other, same_computation_bound(other, {torch.float32: 4}), what="without autocast")


class AutocastInsideForward(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            return self.bn(self.linear(x))


# Before torch 2.6 strict export ran such blocks (no enter_autocast_nodes): there the shim sees
# autocast on, as in eager mode.
@pytest.mark.skipif(TORCH < (2, 5), reason="torch 2.4's strict export fails its own verifier on an "
                    "autocast block inside forward (Node.meta _enter_autocast is missing val field), with or "
                    "without the shim")
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast", "off"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_strict_export_with_autocast_inside_forward_returns_what_eager_returns(training, policy):
    # Strict export records the autocast block without entering it; the shim records the casts that
    # give the policy's result when the recorded block runs.
    amp_bn_fix.set_policy(policy)
    eager, x = AutocastInsideForward().train(training), torch.randn(8, 4)
    exported = AutocastInsideForward().train(training)
    program = torch.export.export(exported, (x,), strict=True)
    expected, out = eager(x), program.module()(x)
    assert out.dtype is expected.dtype is (torch.float32 if policy == "fp32" else BF16)
    # Same ops on the same values in both: the same kernels' results, up to the output's rounding.
    assert_within(out, expected, same_computation_bound(expected, {out.dtype: 4}))
    if training:
        # Updated through the program, in FP32, as in eager mode.
        assert exported.bn.running_mean.dtype is torch.float32
        with torch.autocast("cpu", dtype=BF16):
            hidden = eager.linear(x)  # what the BatchNorm was given: torch's own bfloat16 linear
        assert_stats_replayed(stats_of(exported.bn), [hidden])
    if policy == "off":
        plain = plain_torch(lambda: torch.export.export(AutocastInsideForward().train(training), (x,), strict=True))
        assert plain.module()(x).dtype is BF16 is out.dtype


def stats_of(bn):
    return bn.running_mean.clone(), bn.running_var.clone()


@pytest.mark.skipif(TORCH < (2, 8), reason="strict export sets torch.compiler.is_exporting() while "
                    "dynamo traces from torch 2.8 (not on 2.6)")
def test_strict_export_leaves_no_compiled_policy_behind(monkeypatch):
    # Strict export traces with dynamo, but keeps no compiled code: a later policy() block (the
    # error message above recommends one) must not warn that it misses compiled code.
    monkeypatch.setattr(_config, "_warned_compiled_scope", False)
    monkeypatch.setattr(_state, "compiled_policies", set())
    with autocast():
        torch.export.export(conv_bn(), (image(),), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp_bn_fix.policy("off"):
            pass


def traced(model, x):
    with autocast(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's own deprecation and tracer warnings
        return torch.jit.trace(model, (x,), check_trace=False)


@pytest.mark.parametrize("policy", ["fp32", "input"])  # "input" with the guard lost the update too
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_jit_trace_records_the_running_stat_update_and_saves(training, policy):
    amp_bn_fix.set_policy(policy)
    eager, x = conv_bn(training), image()
    inputs = record_inputs(eager[1])
    expected, expected_grads = train_step(eager, x)
    traced_model = traced(conv_bn(training), x)
    saved = io.BytesIO()
    torch.jit.save(traced_model, saved)  # raised: a Python autograd.Function was recorded
    saved.seek(0)
    loaded = torch.jit.load(saved)
    for module in (traced_model, loaded):
        buffers = dict(module.named_buffers())
        buffers["1.running_mean"].zero_()
        buffers["1.running_var"].fill_(1)
        module.zero_grad()
        out, grads = train_step(module, x)
        assert_matches_eager(out, grads, expected, expected_grads, policy)
        assert_stats_replayed((buffers["1.running_mean"], buffers["1.running_var"]), inputs if training else [])
        if training:
            assert not torch.equal(buffers["1.running_mean"], torch.zeros(8))


def bn_step(x, rm, rv, w, b, training=True):
    with autocast():
        return F.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5)


def bn_args():
    """``bn_step``'s arguments: a bfloat16 input, fresh FP32 running stats, FP32 weight and bias."""
    gen = torch.Generator().manual_seed(3)
    x = seeded_input((4, 8, 16, 16), BF16, seed=gen)
    bn = batch_norm(2, 8, seed=gen)
    return x, bn.running_mean, bn.running_var, bn.weight.detach(), bn.bias.detach()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_make_fx_graph_updates_the_stats_and_matches_fp64(training):
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(functools.partial(bn_step, training=training))(*bn_args())
    args = bn_args()
    out = graph(*args)
    ref = fp64_batch_norm(*bn_args(), training)
    assert out.dtype is torch.float32
    n = args[0][:, 0].numel()
    assert_near(out, ref.out, n, what="output")
    assert_near(args[1], ref.running_mean, n, what="running mean")
    assert_near(args[2], ref.running_var, n, what="running var")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fake_tensor_mode_runs_forward_and_backward(training):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        model = conv_bn(training)
        x = torch.empty(4, 3, 16, 16)
        with autocast():
            out = model(x)
        out.float().sum().backward()
    assert isinstance(out, FakeTensor) and out.shape == (4, 8, 16, 16)
    assert out.dtype is torch.float32 and model[1].running_mean.dtype is torch.float32
    assert model[0].weight.grad.dtype is torch.float32


@pytest.mark.parametrize("tracked", [False, True], ids=["no-stats", "tracked"])
def test_torch_compile_of_an_fp32_instance_norm_under_autocast_runs_as_eager(monkeypatch, tracked):
    # The InstanceNorm door leaves an FP32 call to torch with no call of its own: the check for
    # code compiled under a policy met nothing to check and raised.
    monkeypatch.setattr(_state, "compiled_policies", set())
    torch._dynamo.reset()
    norm = nn.InstanceNorm2d(4, track_running_stats=tracked)
    x = image()[:, :, :8, :8].repeat(1, 2, 1, 1)[:, :4]
    compiled = torch.compile(copy.deepcopy(norm), backend="aot_eager")
    with autocast():
        expected, out = norm(x), compiled(x)
    assert out.dtype is expected.dtype is torch.float32 and torch.equal(out, expected)


@pytest.mark.slow
def test_torch_compile_inductor_training_matches_eager(monkeypatch):
    monkeypatch.setattr(_state, "compiled_policies", set())  # forget this compile afterwards
    torch._dynamo.reset()
    eager, compiled_model, x = conv_bn(), conv_bn(), image()
    inputs = record_inputs(eager[1])

    def step(model, x):
        with autocast():
            y = model(x)
        return y.float().square().mean(), y

    loss, y = step(eager, x)
    loss.backward()
    closs, cy = torch.compile(step, backend="inductor", fullgraph=True)(compiled_model, x)
    closs.backward()
    assert cy.dtype is y.dtype is torch.float32
    # Inductor sums the statistics in its own order: each result within the FP32 bound of the
    # exact one, so the two within twice of it.
    assert_within(cy, y, 2 * fp32_bound(y.detach().double(), x[:, 0].numel()), what="output")
    assert_stats_replayed(stats(compiled_model), inputs)
    assert_matches_eager(cy, [p.grad for p in compiled_model.parameters()], y,
                         [p.grad for p in eager.parameters()], "fp32")


class FunctionalBN(nn.Module):
    """Calls F.batch_norm itself, so FX records it as a function call rather than a leaf module."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.weight = nn.Conv2d(3, 8, 3, padding=1), nn.Parameter(torch.rand(8) + 0.5)
        self.register_buffer("running_mean", torch.zeros(8))
        self.register_buffer("running_var", torch.ones(8))

    def forward(self, x):
        return F.batch_norm(self.conv(x), self.running_mean, self.running_var, self.weight, None, self.training)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fx_symbolic_trace_copies_pickles_and_scripts(training):
    eager, x = FunctionalBN().train(training), image()
    inputs = []  # the BatchNorm's input: the convolution's output
    eager.conv.register_forward_hook(lambda module, args, out: inputs.append(out.detach().clone()))
    with autocast():
        expected = eager(x)
    graph = torch.fx.symbolic_trace(FunctionalBN().train(training))
    assert "torch.nn.functional.batch_norm(" in graph.code  # the generated code names it as torch does
    for module in (graph, copy.deepcopy(graph), pickle.loads(pickle.dumps(graph))):
        module.running_mean.zero_()
        module.running_var.fill_(1)
        with autocast():
            out = module(x)
        assert out.dtype is torch.float32
        assert_within(out, expected, same_computation_bound(expected, {torch.float32: 4}))
        assert_stats_replayed((module.running_mean, module.running_var), inputs if training else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TorchScript's note on GraphModule annotations
        torch.jit.script(graph)  # scripting the traced graph compiles, as in plain torch


def test_non_reentrant_checkpoint_updates_running_stats_as_plain_torch():
    from torch.utils.checkpoint import checkpoint

    def run():
        model, x = conv_bn(), image().requires_grad_()
        inputs = record_inputs(model[1])
        with autocast():
            out = checkpoint(model, x, use_reentrant=False)
        out.float().sum().backward()
        return stats(model), int(model[1].num_batches_tracked), inputs

    ours, calls, inputs = run()
    assert calls == plain_torch(run)[1] == len(inputs)  # the recompute updates too, as in plain torch
    assert_stats_replayed(ours, inputs)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_segment_with_batchnorm_inside_runs_as_plain_torch(reentrant):
    # The BatchNorm is followed by a convolution inside the segment, so even non-reentrant
    # checkpoint's early stop comes after the stats were written back: two updates, as plain torch.
    from torch.utils.checkpoint import checkpoint

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
        x = image().requires_grad_()
        inputs = record_inputs(model[1])
        with autocast():
            out = checkpoint(model, x, use_reentrant=reentrant)
        out.float().square().mean().backward()
        bn = model[1]
        return (out.detach(), x.grad, bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.item(),
                inputs)

    ours, expected = run(), plain_torch(run)
    assert ours[0].dtype is expected[0].dtype is BF16  # the last conv's output, under autocast
    # The next conv rounds BatchNorm's FP32 output to bfloat16, as plain torch rounds its own:
    # results an ulp (two roundings) apart where they round the other way.
    assert_within(ours[0], expected[0], same_computation_bound(expected[0], {BF16: 2}), what="output")
    assert_within(ours[1], expected[1], same_computation_bound(expected[1], {BF16: 2}), what="input gradient")
    assert ours[4] == expected[4] == len(ours[5])
    assert_stats_replayed(ours[2:4], ours[5])


# --- 6. policy scopes in interleaved contexts --------------------------------------------------


def bn_dtype():
    with autocast():
        return F.batch_norm(image().to(BF16), None, None, training=True).dtype


@pytest.fixture
def nothing_compiled(monkeypatch):
    # Code compiled by earlier tests would make a scope warn that it does not reach that code.
    monkeypatch.setattr(_state, "compiled_policies", set())


@pytest.mark.usefixtures("nothing_compiled")
def test_asyncio_tasks_each_see_their_own_scope():
    seen = []

    async def task(name):
        with amp_bn_fix.policy(name):
            for _ in range(3):
                await asyncio.sleep(0)  # the other task runs here, inside its own scope
                seen.append((name, amp_bn_fix.get_policy(), bn_dtype()))

    async def child():
        await asyncio.sleep(0)
        return amp_bn_fix.get_policy()

    async def main():
        await asyncio.gather(task("input"), task("off"))
        with amp_bn_fix.policy("autocast"):
            spawned = asyncio.ensure_future(child())  # starts with a copy of this task's context
        return amp_bn_fix.get_policy(), bn_dtype(), await spawned

    assert asyncio.run(main()) == ("fp32", torch.float32, "autocast")
    assert sorted(set(seen)) == [("input", "input", BF16), ("off", "off", BF16)]
    assert len(seen) == 6 and seen[0][0] != seen[1][0]  # they did interleave
    assert amp_bn_fix.get_policy() == "fp32" and bn_dtype() is torch.float32


@pytest.mark.usefixtures("nothing_compiled")
def test_generators_consumed_alternately_leave_nothing_behind():
    def scoped(name):
        with amp_bn_fix.policy(name):
            yield amp_bn_fix.get_policy(), bn_dtype()
            yield None

    a, b = scoped("input"), scoped("off")
    assert next(a) == ("input", BF16) and next(b) == ("off", BF16)
    for gen in (a, b):  # their blocks exit out of order: a's first, while b's is still open
        next(gen)
        with pytest.raises(StopIteration):
            next(gen)
    assert amp_bn_fix.get_policy() == "fp32" and bn_dtype() is torch.float32


@pytest.mark.usefixtures("nothing_compiled")
def test_a_decorated_coroutine_function_runs_its_body_in_the_scope():
    # Its body runs when the task awaits it, not when it is called: the scope opens there, and
    # other tasks interleaved with it keep theirs.
    seen = []

    def decorated(name):
        @amp_bn_fix.policy(name)
        async def evaluate():
            for _ in range(3):
                await asyncio.sleep(0)
                seen.append((name, amp_bn_fix.get_policy(), bn_dtype()))
            return amp_bn_fix.get_policy()

        return evaluate

    async def main():
        return await asyncio.gather(decorated("input")(), decorated("off")())

    assert asyncio.run(main()) == ["input", "off"]
    assert sorted(set(seen)) == [("input", "input", BF16), ("off", "off", BF16)]
    assert len(seen) == 6 and seen[0][0] != seen[1][0]  # they did interleave
    assert amp_bn_fix.get_policy() == "fp32"


@pytest.mark.usefixtures("nothing_compiled")
def test_a_decorated_generator_function_runs_each_step_in_the_scope():
    # Each step runs under the scope, the caller between steps under its own; values sent and
    # thrown in reach the body, and its return value the caller.
    @amp_bn_fix.policy("input")
    def steps():
        received = yield amp_bn_fix.get_policy(), bn_dtype()
        try:
            yield received, amp_bn_fix.get_policy()
        except KeyError as error:
            yield "caught", error.args[0], amp_bn_fix.get_policy()
        return "done"

    gen = steps()
    assert amp_bn_fix.get_policy() == "fp32"  # nothing runs at the call
    assert next(gen) == ("input", BF16)
    assert amp_bn_fix.get_policy() == "fp32" and bn_dtype() is torch.float32
    assert gen.send("sent") == ("sent", "input")
    assert gen.throw(KeyError("thrown")) == ("caught", "thrown", "input")
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "done"
    closed = steps()
    next(closed)
    closed.close()
    assert amp_bn_fix.get_policy() == "fp32"


@pytest.mark.usefixtures("nothing_compiled")
def test_a_decorated_generator_keeps_the_blocks_its_body_opens_and_the_caller_its_own():
    amp_bn_fix.set_policy("autocast")

    @amp_bn_fix.policy("input")
    def steps():
        with amp_bn_fix.policy("fp32"):  # the body's own block: innermost at every step
            for _ in range(3):
                yield amp_bn_fix.get_policy()

    seen = []
    for body in steps():
        seen.append((body, amp_bn_fix.get_policy()))
    assert seen == [("fp32", "autocast")] * 3
    assert amp_bn_fix.get_policy() == "autocast" and _state.scopes.get() == ()


@pytest.mark.usefixtures("nothing_compiled")
@pytest.mark.parametrize("where", ["threads", "tasks"])
def test_one_policy_object_entered_in_several_contexts_closes_each_one_s_scope(where):
    shared = amp_bn_fix.policy("input")
    after = {}

    def inside(name):
        after[name] = amp_bn_fix.get_policy()

    if where == "tasks":
        async def task(name, delay):
            with shared:
                await asyncio.sleep(delay)  # the other task enters meanwhile
            inside(name)

        async def main():
            await asyncio.gather(task("first", 0.01), task("second", 0.02))  # the first in leaves first

        asyncio.run(main())
    else:
        entered, leave = threading.Barrier(2), threading.Event()

        def thread(name, leaves_first):
            with shared:
                entered.wait()
                if not leaves_first:
                    leave.wait()
            if leaves_first:
                leave.set()
            inside(name)

        threads = [threading.Thread(target=thread, args=(n, n == "first")) for n in ("first", "second")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert after == {"first": "fp32", "second": "fp32"}


def test_a_scope_whose_warning_is_raised_as_an_error_does_not_stay_open(monkeypatch):
    monkeypatch.setattr(_config, "_warned_compiled_scope", False)
    monkeypatch.setattr(_state, "compiled_policies", {"fp32"})  # code compiled under fp32
    def with_block():
        with amp_bn_fix.policy("input"):
            pass

    for enter in (with_block, amp_bn_fix.policy("input")(lambda: None)):  # a block, a decorated call
        _config._warned_compiled_scope = False
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(RuntimeWarning, match="in force here, 'input'"):
                enter()
        assert _state.scopes.get() == () and amp_bn_fix.get_policy() == "fp32"


@pytest.mark.parametrize("kind", ["generator", "coroutine"])
def test_the_compiled_scope_warning_names_the_line_that_runs_decorated_code(monkeypatch, kind):
    monkeypatch.setattr(_config, "_warned_compiled_scope", False)
    monkeypatch.setattr(_state, "compiled_policies", {"fp32"})
    if kind == "generator":
        @amp_bn_fix.policy("input")
        def decorated():
            yield None

        run = lambda: list(decorated())  # noqa: E731
    else:
        @amp_bn_fix.policy("input")
        async def decorated():
            await asyncio.sleep(0)

        run = lambda: asyncio.run(decorated())  # noqa: E731
    with pytest.warns(RuntimeWarning, match="in force here, 'input'") as record:
        run()
    ours = [w for w in record if "amp_bn_fix: the policy in force here" in str(w.message)]
    assert [w.filename for w in ours] == [__file__]  # torch may warn too, from its own files


def test_a_partial_of_an_async_generator_function_is_refused_too():
    async def stream(n):
        yield n

    with pytest.raises(TypeError, match="async generator function"):
        amp_bn_fix.policy("input")(functools.partial(stream, 3))


def test_an_async_generator_function_is_refused_as_a_decorated_one():
    with pytest.raises(TypeError, match="async generator function .*open the scope inside it"):
        @amp_bn_fix.policy("input")
        async def stream():
            yield None


@pytest.mark.usefixtures("nothing_compiled")
def test_compiled_code_takes_the_scopes_of_the_task_that_compiles_it(monkeypatch):
    # Dynamo reads the scopes where it traces: another task's open scope is not this task's.
    monkeypatch.setattr(_config, "_warned_compiled_scope", True)  # the once-only warning is another test's
    bn = nn.BatchNorm2d(4).eval()
    x = seeded_input((2, 4, 5, 5), BF16, seed=1)

    def f(x):
        with autocast():
            return bn(x), torch.tensor(len(amp_bn_fix.get_policy()))

    async def holds_a_scope():
        with amp_bn_fix.policy("input"):
            await asyncio.sleep(0.2)

    async def compiles():
        await asyncio.sleep(0.05)  # inside the other task's scope, in time
        return torch.compile(f, backend="aot_eager", fullgraph=True)(x)

    async def main():
        return (await asyncio.gather(holds_a_scope(), compiles()))[1]

    torch._dynamo.reset()
    try:
        out, length = asyncio.run(main())
        assert out.dtype is torch.float32 and int(length) == len("fp32")
        torch._dynamo.reset()
        with amp_bn_fix.policy("input"):  # and its own scope, with fullgraph: no graph break on it
            out, length = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
        assert out.dtype is BF16 and int(length) == len("input")
    finally:
        torch._dynamo.reset()


# --- 7. meta device ----------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_meta_half_model_forward_like_torch(training):
    def run():
        model = conv_bn(training).to("meta").half()
        x = torch.empty(4, 3, 16, 16, device="meta", dtype=torch.float16)
        outs = [model(x)]
        with autocast():  # CPU autocast does not apply to meta tensors
            outs.append(model(x))
        return [(o.device.type, o.dtype, o.shape) for o in outs]

    assert run() == plain_torch(run) == [("meta", torch.float16, (4, 8, 16, 16))] * 2


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_meta_direct_call_with_fp32_stats(training):
    x = torch.empty(4, 8, 16, 16, device="meta", dtype=torch.float16)
    rm, rv = torch.zeros(8, device="meta"), torch.ones(8, device="meta")
    skips = amp_bn_fix.report()["guard_skips"]
    out = F.batch_norm(x, rm, rv, training=training)
    # Plain torch's meta kernel accepts the mixed call and returns the input's dtype.
    plain = plain_torch(lambda: F.batch_norm(x, rm, rv, training=training))
    assert (out.device.type, out.dtype, out.shape) == (plain.device.type, plain.dtype, plain.shape)
    assert out.dtype is torch.float16
    # A meta call has no values to guard: report() keeps reading what real calls did.
    assert amp_bn_fix.report()["guard_skips"] == skips


# --- 8. torch.func ensembles ---------------------------------------------------------------------


def test_vmap_ensemble_of_half_models_trains_like_plain_torch():
    from torch.func import functional_call, stack_module_state, vmap

    def run():
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).half() for _ in range(3)]
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        xs = torch.randn(3, 4, 3, 16, 16).half()
        out = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)))(params, buffers, xs)
        return models, buffers, xs, out

    models, buffers, xs, out = run()
    _, plain_buffers, _, plain_out = plain_torch(run)
    assert out.dtype is plain_out.dtype is torch.float16
    assert_within(out, plain_out, same_computation_bound(plain_out, {torch.float16: 2}), what="against plain torch")
    # A half model stays half; under vmap (no master: a transform) its update is FP32, then rounded.
    assert buffers["1.running_mean"].dtype is torch.float16
    for i, (model, x) in enumerate(zip(models, xs)):
        conv, bn = model[0], model[1]
        y = plain_torch(lambda: conv(x)).detach().double()  # what the BatchNorm was given: a half conv's output
        expected = fp64_batch_norm(y, torch.zeros(8), torch.ones(8), bn.weight, bn.bias, True, 0.1, 1e-5)
        n = y[:, 0].numel()
        # The output is plain torch's half kernel's (as ``plain_out``): a few roundings of float16.
        bound = same_computation_bound(expected.out, {torch.float16: 4})
        assert_within(out[i], expected.out, bound, what="output")
        assert_near(buffers["1.running_mean"][i], expected.running_mean, n, what="running mean")
        assert_near(buffers["1.running_var"][i], expected.running_var, n, what="running var")
        assert_near(plain_buffers["1.running_mean"][i], expected.running_mean, n, what="plain torch's running mean")


# --- 9. torch's errors, not ours -------------------------------------------------------------------


def call_cases():
    x = image().to(BF16)
    return {
        "float-weight": lambda f, t: f(x, torch.zeros(3), torch.ones(3), 1.0, None, t),
        "list-stats": lambda f, t: f(x, [0.0] * 3, [1.0] * 3, None, None, t),
        "int-bias": lambda f, t: f(x, None, None, None, 1, t),
        # Torch's message names the input's dtype ("expected scalar type BFloat16 but found Long").
        "integer-stats": lambda f, t: f(x, torch.zeros(3).long(), torch.ones(3).long(), None, None, t),
        "stats-require-grad": lambda f, t: f(
            x, torch.zeros(3, requires_grad=True), torch.ones(3, requires_grad=True), None, None, t
        ),
    }


def outcome(call):
    try:
        out = call()
    except Exception as exc:
        return type(exc), str(exc)
    return out.dtype, None


REJECTED = [
    (case, training)
    for case in ("float-weight", "list-stats", "int-bias", "integer-stats")
    for training in (True, False)
]
# Stats that require grad are refused in training only (eval never writes them).
REJECTED.append(("stats-require-grad", True))


@pytest.mark.parametrize("case, training", REJECTED)
@pytest.mark.parametrize("under_autocast", [True, False], ids=["autocast", "plain"])
def test_calls_torch_rejects_get_torchs_own_error(case, training, under_autocast):
    call = call_cases()[case]

    def run(fn):
        with torch.autocast("cpu", dtype=BF16, enabled=under_autocast):
            return outcome(lambda: call(fn, training))

    ours = run(F.batch_norm)
    assert issubclass(ours[0], (TypeError, RuntimeError)) and ours[1], ours  # an error, with a message
    assert ours == run(ORIGINAL)


@pytest.mark.parametrize("under_autocast", [True, False], ids=["autocast", "plain"])
def test_expanded_running_stats_are_updated_as_torch_does(under_autocast):
    x = image().to(BF16)

    def run(fn):
        rm, rv = torch.zeros(1).expand(3), torch.ones(1).expand(3)
        with torch.autocast("cpu", dtype=BF16, enabled=under_autocast):
            out = fn(x, rm, rv, None, None, True)
        return out, rm, rv

    ours, theirs = run(F.batch_norm), run(ORIGINAL)
    assert ours[0].dtype is theirs[0].dtype is BF16 and torch.equal(ours[0], theirs[0])
    # Every channel's update lands in the one shared element, in an order torch's threads pick, so
    # the value varies from run to run even in plain torch: torch updated it, in place, stride 0.
    for stat, start in zip(ours[1:], (0.0, 1.0)):
        assert stat.stride() == (0,) and stat.dtype is torch.float32
        assert torch.isfinite(stat).all() and stat[0] != start


# --- 10. importlib.reload -------------------------------------------------------------------------


def our_wrappers(owner, name):
    return [w for w in wrapt.wrapper_chain(getattr(owner, name)) if getattr(type(w), "_amp_bn_fix_wrapper", False)]


NORM_BASES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
NORM_HOOKED = ("_apply", "_load_from_state_dict")


def test_reload_then_enable_wraps_once_and_disable_restores_the_original():
    originals = {
        "apply": wrapt.unwrapped(nn.modules._functions.SyncBatchNorm.apply),
        **{(norm, name): wrapt.unwrapped(getattr(norm, name)) for norm in NORM_BASES for name in NORM_HOOKED},
    }
    importlib.reload(_patch)  # what IPython's autoreload does on an edit
    try:
        amp_bn_fix.enable()
        assert len(our_wrappers(F, "batch_norm")) == 1 and F.batch_norm.__wrapped__ is ORIGINAL
        assert bn_dtype() is torch.float32
        amp_bn_fix.disable()
        assert F.batch_norm is ORIGINAL
        assert nn.modules._functions.SyncBatchNorm.apply == originals["apply"]
        for norm in NORM_BASES:
            assert "_apply" not in vars(norm)
            for name in NORM_HOOKED:
                assert getattr(norm, name) is originals[norm, name]
        with autocast():
            assert F.batch_norm(image().to(BF16), None, None, training=True).dtype is BF16
    finally:
        amp_bn_fix.enable()


# --- Programs along the paths where the shim steps aside, or that take its fast paths ------------


def onnx_runtime():
    pytest.importorskip("onnx")
    return pytest.importorskip("onnxruntime")


class ConvBnReluUnderAutocast(nn.Module):
    """float16 autocast: onnxruntime has no bfloat16 convolution on CPU."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(*conv_bn(), nn.ReLU())
        with torch.no_grad():
            self.net[1].running_mean.uniform_(-1, 1)
            self.net[1].running_var.uniform_(0.5, 2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            return self.net(x)


@pytest.mark.parametrize("case", ["half-model", "fp32-model-under-autocast"])
def test_legacy_onnx_export_runs_in_onnxruntime_as_in_eager(case, tmp_path):
    ort = onnx_runtime()
    if case == "half-model":
        model, x = nn.Sequential(*conv_bn(), nn.ReLU()).eval().half(), image().half()
    else:
        model, x = ConvBnReluUnderAutocast().eval(), image()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation notes
        torch.onnx.export(model, (x,), tmp_path / "model.onnx", dynamo=False)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = model(x)
    # The graph casts as eager does (an FP32 output from the FP32 BatchNorm under autocast);
    # onnxruntime's float16 convolution rounds differently from torch's: a few float16 units in the
    # last place of BatchNorm's input, carried through the normalization.
    assert got.dtype == expected.detach().numpy().dtype
    bound = rounding_bound(expected.abs().max().item() + 1, {torch.float16: 8})
    assert_within(torch.from_numpy(got), expected.detach(), bound, what="onnxruntime")


@pytest.mark.parametrize("how", ["set_default_device", "device-context"])
def test_default_device_mode_is_plain_eager(how):
    # The mode torch.set_default_device installs only fills in a device: an eval call, a training
    # call and one backward work as without it, and the CPU fast path still runs.
    from amp_bn_fix import _kernels

    model, x = conv_bn(), image()
    calls = []
    original = _kernels.fp32_batch_norm

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def step():
        with autocast():
            model.eval()
            first = model(x)
            model.train()
            second = model(x)
        (first.float().sum() + second.float().square().sum()).backward()
        return second

    try:
        _kernels.fp32_batch_norm = counting
        if how == "set_default_device":
            torch.set_default_device("cpu")
            try:
                out = step()
            finally:
                torch.set_default_device(None)
        else:
            with torch.device("cpu"):
                out = step()
    finally:
        _kernels.fp32_batch_norm = original
    assert calls and out.dtype is torch.float32
    assert model[1].running_mean.dtype is torch.float32 and model[0].weight.grad is not None


def test_batched_gradients_through_the_fast_path_backward():
    # is_grads_batched runs the backward under vmap: the fast path's chunked backward must not
    # update plain tensors in place from batched ones.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(16, 10))
    x = torch.randn(8, 3, 48, 48, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with autocast():
        logits = net(x)
    basis = torch.eye(10)[:, None].expand(10, 8, 10)
    (batched,) = torch.autograd.grad(logits, x, grad_outputs=basis, is_grads_batched=True, retain_graph=True)
    looped = torch.stack([torch.autograd.grad(logits, x, grad_outputs=g, retain_graph=True)[0] for g in basis])
    # The same backward formula in FP32 over 8*46*46 values per channel, batched or one at a time,
    # through bfloat16 convolutions: agreement to a few bfloat16 roundings.
    assert_within(batched, looped, rounding_bound(looped.abs().max().item(), {BF16: 8}))


class Fp32IslandInsideAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = conv_bn(training=False)

    def forward(self, x):
        with autocast():
            y = self.net[0](x)
            with torch.autocast("cpu", enabled=False):
                return self.net[1](y.float())


def result_or_error(fn):
    """``fn()``'s result, or its error as (type, message)."""
    try:
        return fn()
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.skipif(TORCH < (2, 5), reason="torch 2.4's export cannot handle torch.autocast inside forward")
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_export_of_an_fp32_island_inside_autocast(strict):
    # Only the innermost autocast state counts: BatchNorm runs in an FP32 island, passed through
    # as in plain torch. (Strict export records ``y.float()`` of an FP32 tensor as nothing, so its
    # program fails on the bfloat16 it gets when run, with or without the shim.)
    x = image()

    def exported():
        model = Fp32IslandInsideAutocast().eval()
        return torch.export.export(model, (x,), strict=strict).module()(x)

    ours, plain = result_or_error(exported), plain_torch(lambda: result_or_error(exported))
    if isinstance(plain, tuple):
        assert ours[0] is plain[0]
        return
    assert ours.dtype is plain.dtype is Fp32IslandInsideAutocast().eval()(x).dtype is torch.float32
    assert torch.equal(ours, plain)  # passed through: the same kernel on the same values


@pytest.mark.skipif(TORCH < (2, 5), reason="torch 2.4's export cannot handle torch.autocast inside forward")
def test_onnx_dynamo_export_of_an_fp32_island_inside_autocast(tmp_path):
    onnx_runtime()
    pytest.importorskip("onnxscript")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Fp32IslandInsideAutocast().eval(), (image(),), tmp_path / "model.onnx", dynamo=True)
    assert (tmp_path / "model.onnx").stat().st_size > 0
