"""A half model stays a half model: what a program can observe is what plain torch shows.

With ``keep_fp32="master"`` (the default) a model cast to 16 bits keeps exactly the dtypes asked
for, and the running statistics' FP32 accuracy lives in a master the shim keeps (``_master``). The
inspections programs make of a model (dtypes, flat parameter vectors, state dicts, pickles,
TorchScript, the conv-BN fusers) are run on a model cast with the shim and on the same model cast
by plain torch, for every keep mode: ``master`` and ``none`` must match plain torch, ``all`` and
``stats`` keep FP32 tensors in the model by design (their trade-off is in docs/configuration.md).
"""

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import amp_bn_fix
from _bounds import assert_near
from _builders import fp64_batch_norm
from _shared import ORIGINAL, shim_disabled
from bn_probe import Watch, bn_modules
from amp_bn_fix import _master

HALF = [torch.float16, torch.bfloat16]
CASTS = {
    "half": lambda m, dtype: m.half() if dtype is torch.float16 else m.bfloat16(),
    "to-dtype": lambda m, dtype: m.to(dtype),
    "to-device-dtype": lambda m, dtype: m.to("cpu", dtype),
    "_apply": lambda m, dtype: m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t),
}
KEEPS = ["master", "none", "all", "stats"]


def conv_bn() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4))
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net


def linear_bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(20), nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 2))


def cast(make, keep, how, dtype, shim=True):
    if not shim:
        with shim_disabled():
            return CASTS[how](make(), dtype)
    amp_bn_fix.configure(keep_fp32=keep)
    return CASTS[how](make(), dtype)


def dtypes(model):
    return [(name, t.dtype) for name, t in list(model.named_parameters()) + list(model.named_buffers())]


def like_plain(keep):
    return keep in ("master", "none")


@pytest.mark.parametrize("how", list(CASTS))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("keep", KEEPS)
def test_dtypes_are_plain_torch_s(keep, how, dtype):
    ours, plain = cast(conv_bn, keep, how, dtype), cast(conv_bn, keep, how, dtype, shim=False)
    assert (dtypes(ours) == dtypes(plain)) is like_plain(keep)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("keep", KEEPS)
def test_the_first_parameters_dtype_idiom(keep, dtype):
    # dtype = next(model.parameters()).dtype, then x.to(dtype): works on plain torch.
    model = cast(linear_bn, keep, "half", dtype)
    x = torch.randn(8, 20).to(next(model.parameters()).dtype)
    if keep != "all":  # FP32 running stats alone leave parameters() as plain torch's
        assert model(x).dtype is dtype
    else:
        with pytest.raises(RuntimeError, match="dtype|type"):
            model(x)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("keep", KEEPS)
def test_a_flat_parameter_vector_round_trip(keep, dtype):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    model = cast(conv_bn, keep, "half", dtype)
    before = dtypes(model)
    vector_to_parameters(parameters_to_vector(model.parameters()), model.parameters())
    if keep != "all":
        assert dtypes(model) == before
        assert model.eval()(torch.randn(2, 3, 8, 8).to(dtype)).dtype is dtype
    else:
        assert dtypes(model) != before  # every parameter became float32


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("keep", ["master", "none"])
@pytest.mark.parametrize("program", ["state-dict", "pickle", "torchscript", "disable"])
def test_programs_that_take_the_model_elsewhere(keep, dtype, program):
    model = cast(conv_bn, keep, "half", dtype).eval()
    plain = cast(conv_bn, keep, "half", dtype, shim=False).eval()
    x = torch.randn(2, 3, 8, 8).to(dtype)
    if program == "state-dict":
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        assert [(k, v.dtype) for k, v in state.items()] == [(k, v.dtype) for k, v in plain.state_dict().items()]
        with shim_disabled():
            target = CASTS["half"](conv_bn(), dtype)
            target.load_state_dict(state, strict=True)
            out = target.eval()(x)
    elif program == "pickle":
        data = pickle.dumps(model)
        with shim_disabled():
            out = pickle.loads(data)(x)
    elif program == "torchscript":
        out = torch.jit.script(model)(x)
    else:
        with shim_disabled():
            out = model(x)
    with shim_disabled():
        expected = plain(x)
    assert out.dtype is expected.dtype is dtype
    assert torch.equal(out, expected)  # the same half computation as plain torch's


FUSERS = ["fuse_conv_bn_eval", "fuse_linear_bn_eval", "fx-fuse", "ao-fuse_modules"]


def _fuse(fuser, dtype):
    torch.manual_seed(0)
    if fuser == "fuse_linear_bn_eval":
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8))
        x = torch.randn(4, 6)
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
        x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model = model.eval().to(dtype)
    return model, x.to(dtype)


def _fused(fuser, model):
    if fuser == "fuse_conv_bn_eval":
        return torch.nn.utils.fusion.fuse_conv_bn_eval(model[0], model[1])
    if fuser == "fuse_linear_bn_eval":
        return torch.nn.utils.fusion.fuse_linear_bn_eval(model[0], model[1])
    if fuser == "fx-fuse":
        from torch.fx.experimental.optimization import fuse

        return fuse(model)
    from torch.ao.quantization import fuse_modules

    return fuse_modules(model, [["0", "1"]])


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("fuser", FUSERS)
def test_conv_bn_fusers_work_as_on_plain_torch(fuser, dtype):
    # RepVGG-style reparameterization and inference fusers fold BatchNorm into its neighbour.
    model, x = _fuse(fuser, dtype)
    with shim_disabled():
        plain, _ = _fuse(fuser, dtype)
        expected = _fused(fuser, plain)(x)
    out = _fused(fuser, model)(x)
    assert out.dtype is expected.dtype is dtype
    assert torch.equal(out, expected)  # the same fused model as plain torch's


def _train(model, steps, dtype, autocast):
    """``steps`` training calls; the inputs the BatchNorm saw, for a float64 replay."""
    seen = []
    handle = model[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    try:
        for step in range(steps):
            x = (torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(step)) * 0.05 + 2).to(dtype)
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                model(x)
    finally:
        handle.remove()
    return seen


def _replay(bn_inputs, dtype):
    """The running stats in float64 after the same training calls, from the same starting stats."""
    start = cast(conv_bn, "none", "half", dtype, shim=False)[1]
    mean, var = start.running_mean, start.running_var
    for x in bn_inputs:
        ref = fp64_batch_norm(x, mean, var, None, None, True, 0.1, 1e-5)
        mean, var = ref.running_mean, ref.running_var
    return mean, var


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no-autocast"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_master_keeps_the_running_stats_fp32_accurate(both_routes, dtype, autocast):
    # Small updates (a tenth of a shift of ~1e-3 a step) that 16-bit stats lose, over 200 steps.
    steps = 200
    model = cast(conv_bn, "master", "half", dtype)
    seen = _train(model, steps, dtype, autocast)
    bn = model[1]
    master = _master.peek(bn.running_mean, bn.running_var)
    assert master is not None and master.dtype is torch.float32
    mean64, var64 = _replay(seen, dtype)  # torch alone (disable() drops the masters: peeked first)
    # FP32 accuracy: each update adds a batch statistic's error (n values) and two roundings, and
    # the momentum forgets the old ones: about ten updates' worth at any time.
    n = 16 * 64
    assert_near(master[0], mean64, n, ops=30, scale=mean64.abs().max().item() + 1, what="mean")
    assert_near(master[1], var64, n, ops=30, scale=var64.abs().max().item(), what="var")
    assert torch.equal(bn.running_mean, master[0].to(dtype)) and torch.equal(bn.running_var, master[1].to(dtype))
    # The setting exists for this: 16-bit stats updated in 16 bits (plain torch) drift further.
    with shim_disabled():
        plain = CASTS["half"](conv_bn(), dtype)
        plain_mean64, plain_var64 = _replay(_train(plain, steps, dtype, autocast), dtype)
    ours = (master[1].double() - var64).abs().max()
    theirs = (plain[1].running_var.double() - plain_var64).abs().max()
    assert ours < theirs / 10


def test_master_follows_casts():
    # Writes to the buffers are test_master's matrix.
    model = cast(conv_bn, "master", "half", torch.bfloat16)
    bn = model[1]
    _train(model, 3, torch.bfloat16, True)
    master = _master.peek(bn.running_mean, bn.running_var).clone()
    # Between 16-bit dtypes the buffers hold the master's rounding to the new dtype; back to FP32,
    # the master's values, not the rounded ones.
    model.half()
    assert torch.equal(_master.peek(bn.running_mean, bn.running_var), master)
    assert torch.equal(bn.running_mean, master[0].half()) and torch.equal(bn.running_var, master[1].half())
    model.float()
    assert torch.equal(bn.running_mean, master[0]) and torch.equal(bn.running_var, master[1])
    model.bfloat16()
    assert torch.equal(_master.peek(bn.running_mean, bn.running_var), master)
    # disable() drops every master: torch owns the buffers from then on.
    with shim_disabled():
        assert _master.peek(bn.running_mean, bn.running_var) is None


def test_a_deep_copy_starts_its_own_master_from_its_buffers():
    model = cast(conv_bn, "master", "half", torch.bfloat16)
    _train(model, 2, torch.bfloat16, True)
    twin = copy.deepcopy(model)
    assert _master.peek(twin[1].running_mean, twin[1].running_var) is None
    _train(twin, 1, torch.bfloat16, True)
    assert _master.peek(twin[1].running_mean, twin[1].running_var) is not None
    assert _master.peek(model[1].running_mean, model[1].running_var) is not None


@pytest.mark.parametrize("keep", KEEPS)
def test_eval_of_a_half_model_reads_the_master(keep):
    # Eval calls the shim computes use the FP32 master, not the rounded buffers.
    model = cast(conv_bn, keep, "half", torch.bfloat16)
    _train(model, 20, torch.bfloat16, True)
    model.eval()
    bn = model[1]
    x = torch.randn(4, 8, 8, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bn(x)
    if keep == "master":
        master = _master.peek(bn.running_mean, bn.running_var)
        expected = fp64_batch_norm(x, *master, bn.weight, bn.bias, False, 0.1, bn.eps)
        assert_near(out, expected.out, 4 * 8 * 8)
    assert out.dtype is torch.float32


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_lazy_model_cast_before_its_first_batch_is_cast_as_plain_torch_casts_it(dtype):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyConv2d(8, 3), nn.LazyBatchNorm2d()).to(dtype)

    ours = make()
    with shim_disabled():
        theirs = make()
    x = torch.randn(4, 3, 8, 8).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        out = ours(x)
    # Materialized 16-bit, the model gets its FP32 master at its first handled call.
    assert out.dtype is torch.float32 and _master.peek(ours[1].running_mean, ours[1].running_var) is not None
    assert [b.dtype for b in ours.buffers()] == [dtype, dtype, torch.int64]
    with shim_disabled():
        theirs(x)
    assert [b.dtype for b in theirs.buffers()] == [b.dtype for b in ours.buffers()]


BATCH_NORMS = {
    "1d": (nn.BatchNorm1d, (16, 5, 7), torch.contiguous_format),
    "2d": (nn.BatchNorm2d, (8, 5, 6, 6), torch.contiguous_format),
    "2d-channels_last": (nn.BatchNorm2d, (8, 5, 6, 6), torch.channels_last),
    "3d": (nn.BatchNorm3d, (4, 5, 3, 4, 4), torch.contiguous_format),
    "3d-channels_last": (nn.BatchNorm3d, (4, 5, 3, 4, 4), torch.channels_last_3d),
}


@pytest.mark.parametrize("keep", ["master", "none"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", list(BATCH_NORMS))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_outside_autocast_a_half_model_computes_plain_torch_s_outputs(both_routes, dtype, kind, training, keep):
    # Bit for bit: the output and every gradient, in every memory format (the master, or with
    # ``none`` the stats themselves, take only the running-stat update, which no output shows).
    amp_bn_fix.configure(keep_fp32=keep)
    module, shape, layout = BATCH_NORMS[kind]
    torch.manual_seed(0)
    bn = module(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    bn = bn.to(dtype).train(training)
    x = (torch.randn(shape) * 2 + 1).to(dtype).contiguous(memory_format=layout).requires_grad_()
    stats = bn.running_mean.clone(), bn.running_var.clone()
    weight, bias = bn.weight.detach().clone().requires_grad_(), bn.bias.detach().clone().requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    expected = ORIGINAL(x_plain, *stats, weight, bias, training, 0.1, bn.eps)
    handled = amp_bn_fix.report()["handled"].get("input", 0)
    out = bn(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert out.dtype is dtype and torch.equal(out, expected)
    assert torch.equal(x.grad, x_plain.grad)
    assert torch.equal(bn.weight.grad, weight.grad) and torch.equal(bn.bias.grad, bias.grad)
    if training:  # the update is FP32: the master's, or the stats' own, rounded
        assert (_master.peek(bn.running_mean, bn.running_var) is not None) is (keep == "master")
        assert amp_bn_fix.report()["handled"].get("input", 0) == handled + 1


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no-autocast"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_without_a_master_the_16_bit_stats_take_the_fp32_update_rounded_and_guarded(both_routes, dtype, autocast):
    # keep_fp32="none": each update computed in FP32 from the 16-bit stats, rounded into them;
    # a non-finite batch leaves them bit for bit, outside autocast as under it.
    model = cast(conv_bn, "none", "half", dtype)
    bn = model[1]
    mean, var = bn.running_mean.double(), bn.running_var.double()
    for x in _train(model, 20, dtype, autocast):
        ref = fp64_batch_norm(x, mean, var, None, None, True, 0.1, 1e-5)
        mean, var = ref.running_mean.to(dtype).double(), ref.running_var.to(dtype).double()
    assert _master.peek(bn.running_mean, bn.running_var) is None and bn.running_mean.dtype is dtype
    # The FP32 update rounds as the float64 one does, but at a rounding tie: one 16-bit step at most.
    step = torch.finfo(dtype).eps
    assert ((bn.running_mean.double() - mean).abs() <= step * mean.abs()).all()
    assert ((bn.running_var.double() - var).abs() <= step * var.abs()).all()
    before = bn.running_mean.clone(), bn.running_var.clone()
    poisoned = torch.randn(4, 8, 8, 8).to(dtype)
    poisoned[0, 0, 0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the guard's first skip
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            bn(poisoned)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


def test_outside_autocast_a_float16_model_whose_variance_overflowed_evaluates_with_its_master(both_routes):
    # Features of variance ~1e6: the float16 buffer holds inf, the master holds the variance.
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3).half()
    bn.momentum = 1.0
    x = (torch.randn(16, 3, 4, 4) * 1000).half()
    bn(x)
    assert torch.isinf(bn.running_var).all()
    master = _master.peek(bn.running_mean, bn.running_var).clone()
    bn.eval()
    out = bn(x)
    if both_routes == "host":
        assert_near(out, fp64_batch_norm(x, *master, bn.weight, bn.bias, False, 0.1, bn.eps).out, 1)
    else:  # no host read there: the buffers, as plain torch reads them
        expected = ORIGINAL(x, bn.running_mean.clone(), bn.running_var.clone(), bn.weight, bn.bias, False, 0.1, bn.eps)
        assert torch.equal(out, expected)


# --- half models of real shapes under every policy -------------------------------------------------

class _DenseBlock(nn.Module):
    """DenseNet's pattern: each layer's BN-ReLU-conv output is concatenated to its input (so the
    ``fp32`` policy's FP32 outputs meet 16-bit ones), then a transition BN-conv-pool."""

    def __init__(self, channels=4, growth=4, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(channels + i * growth), nn.ReLU(), nn.Conv2d(channels + i * growth, growth, 3,
                                                                                        padding=1))
            for i in range(layers))
        width = channels + layers * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, channels, 1), nn.AvgPool2d(2))
        self.head = nn.Sequential(nn.BatchNorm2d(channels), nn.Flatten(), nn.LazyLinear(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.cat((x, layer(x)), 1)
        return self.head(self.transition(x))


class _ResidualBlock(nn.Module):
    """ResNet's basic block: conv-BN-ReLU-conv-BN plus the identity (a 16-bit input added to the
    ``fp32`` policy's FP32 output), and a BNNeck-style BatchNorm1d on the pooled features."""

    def __init__(self, channels=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.neck = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(channels), nn.Linear(channels, 3))

    def forward(self, x):
        x = self.stem(x)
        return self.neck(torch.relu(x + self.body(x)))


def _dense():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _DenseBlock())


def _residual():
    torch.manual_seed(0)
    return _ResidualBlock()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast", "off"])
@pytest.mark.parametrize("make", [_dense, _residual], ids=["densenet", "resnet"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_half_models_of_real_shapes_run_under_every_policy(dtype, make, policy, training):
    x = (torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 + 1).to(dtype)

    def run(model):
        with torch.autocast("cpu", dtype=dtype), amp_bn_fix.policy(policy):
            out = model(x)
        if training:
            out.float().sum().backward()
        return out

    model = make()
    model(x.float())  # materialize the lazy layer in FP32, then cast, as a user would
    model = model.to(dtype).train(training)
    watch = Watch(bn_modules(model))
    out = run(model)
    assert out.dtype is dtype and torch.isfinite(out).all()  # the linear head under autocast
    if training:
        assert all(p.grad is not None and p.grad.dtype is dtype for p in model.parameters())
    if policy == "off":  # plain torch's model, computation and all
        with shim_disabled():
            plain = make()
            plain(x.float())
            plain = plain.to(dtype).train(training)
            assert torch.equal(run(plain), out)
        return
    want = {"fp32": torch.float32, "autocast": dtype}.get(policy)
    for call in watch.calls:
        # The policy's output dtype (``input``: the input's, FP32 where an FP32 output came in),
        # FP32 arithmetic rounded once, and the master's FP32 update, against float64.
        assert call["out"] == str(want or getattr(torch, call["input"].split(".")[1])), call
        assert call["out_excess"] <= 0 and call["stats_excess"] <= 0, call
