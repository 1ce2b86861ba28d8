"""Mixed-dtype calls: half input with FP32 running stats (what ``model.half()`` leaves with the shim)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_bn_fix
from _bounds import assert_near, assert_within, same_computation_bound
from _builders import batch_norm, fp64_batch_norm, seeded_input
from _shared import shim_disabled

HALF = [torch.float16, torch.bfloat16]
C = 6
N = 32 * 5  # values per channel in _tensors' input


def _tensors(dtype, affine_dtype):
    """A ``dtype`` input far from zero mean, FP32 running stats, ``affine_dtype`` weight and bias."""
    gen = torch.Generator().manual_seed(0)
    x = seeded_input((32, C, 5), dtype, seed=gen, scale=2, shift=3)
    bn = batch_norm(1, C, seeded_stats=True, seed=gen)
    weight, bias = (p.detach().to(affine_dtype) for p in (bn.weight, bn.bias))
    return x, bn.running_mean, bn.running_var, weight, bias


@pytest.mark.parametrize("autocast", [False, True])
def test_torch_natively_rejects_half_input_fp32_stats_half_affine(autocast):
    """What the shim makes work: torch's own kernels raise for the call model.half() leaves."""
    amp_bn_fix.disable()
    x, mean, var, weight, bias = _tensors(torch.float16, torch.float16)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        with pytest.raises(RuntimeError):
            F.batch_norm(x, mean, var, weight, bias, True)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", HALF)
def test_mixed_call_outside_autocast_keeps_input_dtype_with_fp32_numerics(dtype, training):
    x, mean, var, weight, bias = _tensors(dtype, dtype)
    ref = fp64_batch_norm(x, mean, var, weight, bias, training)
    out = F.batch_norm(x, mean, var, weight, bias, training)
    assert out.dtype == dtype
    # FP32 arithmetic, one rounding to the input's dtype; the FP32 running stats updated in FP32.
    assert_near(out, ref.out, N, what="output")
    assert mean.dtype == torch.float32
    assert_near(mean, ref.running_mean, N, what="running mean")
    assert_near(var, ref.running_var, N, what="running var")


@pytest.mark.parametrize(
    "policy, expected",
    [("fp32", torch.float32), ("input", torch.bfloat16), ("autocast", torch.float16)],
)
def test_mixed_call_under_autocast_follows_the_policy(policy, expected):
    # A bfloat16 input under float16 autocast tells "input" and "autocast" apart.
    x, mean, var, weight, bias = _tensors(torch.bfloat16, torch.bfloat16)
    ref = fp64_batch_norm(x, mean, var, weight, bias, True)
    with torch.autocast("cpu", dtype=torch.float16), amp_bn_fix.policy(policy):
        out = F.batch_norm(x, mean, var, weight, bias, True)
    assert out.dtype == expected
    assert_near(out, ref.out, N, what="output")
    assert_near(mean, ref.running_mean, N, what="running mean")


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_half_weight_gradients_reach_the_half_parameters(dtype, autocast):
    x, mean, var, weight, bias = _tensors(dtype, dtype)
    x.requires_grad_()
    weight.requires_grad_()
    bias.requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = F.batch_norm(x, mean, var, weight, bias, True)
    # The gradient as the output receives it: a half output rounds it to half.
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(upstream)
    ref = fp64_batch_norm(x, mean, var, weight, bias, True, grad_out=upstream)
    for tensor, exact in zip((x, weight, bias), (ref.grad_input, ref.grad_weight, ref.grad_bias)):
        assert tensor.grad.dtype == dtype
        assert_near(tensor.grad, exact, N, what="gradient")


@pytest.mark.parametrize("keep", ["stats", "all"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_model_trains_and_evaluates_outside_autocast(dtype, keep):
    """A whole ``model.half()`` network: BN calls are mixed, everything else is plain half."""
    amp_bn_fix.configure(keep_fp32=keep)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, C, 3), nn.BatchNorm1d(C), nn.ReLU(), nn.Flatten(), nn.Linear(C * 6, 2))
    stats64 = [s.double() for s in (model[1].running_mean, model[1].running_var)]
    model.to(dtype)
    bn = model[1]
    assert bn.running_mean.dtype == torch.float32
    calls = []  # BatchNorm's input (the half conv output) and output, per call
    bn.register_forward_hook(lambda module, args, out: calls.append((args[0].detach(), out.detach())))
    x = torch.randn(16, 3, 8).to(dtype)
    out = model(x)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert model[0].weight.grad.dtype == dtype and bn.weight.grad is not None
    model.eval()
    assert model(x).dtype == dtype
    (train_in, train_out), (eval_in, eval_out) = calls
    n = train_in.numel() // C
    # Each call against float64 on the very same half input; the running stats FP32-accurate (ones
    # rounded through 16 bits would be off by 18 to 125 times the bound).
    train = fp64_batch_norm(train_in, *stats64, bn.weight, bn.bias, True, bn.momentum, bn.eps)
    assert_near(train_out, train.out, n)
    assert_near(bn.running_mean, train.running_mean, n, what="running mean")
    assert_near(bn.running_var, train.running_var, n, what="running var")
    stats64 = train.running_mean, train.running_var
    assert_near(eval_out, fp64_batch_norm(eval_in, *stats64, bn.weight, bn.bias, False, bn.momentum, bn.eps).out, n)


# --- an FP32 input next to 16-bit weights or stats -------------------------------------------------

# A half model whose BatchNorm receives an FP32 input under autocast: under the ``fp32`` policy an
# earlier BatchNorm's FP32 output reaches a later one through a pooling (DenseNet's transitions)
# or a concatenation with a 16-bit branch (which autocast promotes to FP32).
def _pooled(channels):
    return nn.Sequential(nn.Conv2d(3, channels, 3), nn.BatchNorm2d(channels), nn.AvgPool2d(2), nn.BatchNorm2d(channels))


class _Concatenated(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(3, channels, 3), nn.BatchNorm2d(channels), nn.BatchNorm2d(2 * channels)

    def forward(self, x):
        y = self.conv(x)
        return self.bn2(torch.cat((self.bn1(y), y), 1))


@pytest.mark.usefixtures("both_routes")
@pytest.mark.parametrize("make", [_pooled, _Concatenated], ids=["pooled", "concatenated"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_fp32_input_next_to_a_half_models_weights_is_computed_under_autocast(make, dtype, training):
    torch.manual_seed(0)
    net = make(4).to(dtype).train(training)
    last = net[-1] if isinstance(net, nn.Sequential) else net.bn2
    seen = []
    last.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    before = (last.running_mean.double(), last.running_var.double())
    x = torch.randn(8, 3, 10, 10).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        out = net(x)
    (bn_input,) = seen
    assert bn_input.dtype is torch.float32  # what the fp32 policy handed on
    assert out.dtype is torch.float32
    # float64 reference on the very input, with the module's 16-bit weight and stats as values.
    expected = fp64_batch_norm(bn_input, *before, last.weight, last.bias, training, last.momentum, last.eps)
    n = bn_input.numel() // bn_input.shape[1]
    assert_near(out, expected.out, n, what="output")
    if training:
        from amp_bn_fix import _master

        master = _master.peek(last.running_mean, last.running_var)
        assert master is not None and last.running_mean.dtype is dtype
        assert_near(master[0], expected.running_mean, n, what="running mean (master)")
        assert_near(master[1], expected.running_var, n, what="running var (master)")


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_outside_autocast_an_fp32_input_next_to_half_weights_keeps_torchs_error(dtype):
    bn = nn.BatchNorm2d(4).to(dtype)
    x = torch.randn(2, 4, 3, 3)
    with pytest.raises(RuntimeError) as ours:
        bn(x)
    with shim_disabled(), pytest.raises(RuntimeError) as theirs:
        bn(x)
    assert str(ours.value) == str(theirs.value)


# --- torch.func.vmap: a 16-bit input gets the policy there too --------------------------------

def _ensemble_under_vmap(policy, installed=True):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 3)).half() for _ in range(3)]
    params, buffers = torch.func.stack_module_state(models)
    x = torch.randn(2, 3, 8, 8).half()

    def run(p, b):
        return torch.func.functional_call(models[0], (p, b), (x,))

    with (contextlib.nullcontext() if installed else shim_disabled()), amp_bn_fix.policy(policy):
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.func.vmap(run)(params, buffers)


@pytest.mark.parametrize("policy", ["input", "autocast"])
def test_an_ensemble_of_half_models_under_vmap_gets_the_policy(policy):
    """Under vmap a half model's BatchNorm gets its 16-bit input with autocast enabled: FP32
    arithmetic, here a float16 output, which the next (batched, uncast) convolution takes."""
    before = amp_bn_fix.report()["handled"].get(policy, 0)
    ours = _ensemble_under_vmap(policy)
    assert amp_bn_fix.report()["handled"][policy] == before + 1  # computed by the shim, under the policy
    theirs = _ensemble_under_vmap(policy, installed=False)
    assert ours.dtype is theirs.dtype is torch.float16
    # FP32 arithmetic against torch's float16 kernel (FP32 inside too): a rounding or two of the
    # BatchNorm output apart, summed by the next convolution.
    assert_within(ours, theirs, same_computation_bound(theirs, {torch.float16: 4}))


def test_an_ensemble_of_half_models_under_vmap_hands_the_fp32_output_on():
    """The ``fp32`` policy's output reaches the next convolution uncast: autocast does not cast a
    batched convolution's input under vmap, and torch rejects the FP32 input next to its float16
    weights (docs/compatibility.md: the ``input`` policy for such ensembles)."""
    with pytest.raises(RuntimeError, match="Input type"):
        _ensemble_under_vmap("fp32")


# --- torch.func transforms crossed with policies --------------------------------------------------

def _in_transform(transform, bn, x):
    """``bn``'s eval output for ``x``, computed inside ``transform`` (returned as a plain tensor)."""
    from torch.func import functional_call, grad, jacrev, vmap

    state = {**dict(bn.named_parameters()), **dict(bn.named_buffers())}

    def run(weight, inputs):
        return functional_call(bn, {**state, "weight": weight}, (inputs,))

    def loss(weight):
        out = run(weight, x)
        return out.float().sum(), out.detach()

    if transform == "functional_call":
        return run(bn.weight, x).detach()
    if transform == "grad":
        return grad(loss, has_aux=True)(bn.weight)[1]
    if transform == "jacrev":
        return jacrev(loss, has_aux=True)(bn.weight)[1]
    return vmap(lambda xi: run(bn.weight, xi))(x.unsqueeze(0).expand(2, *x.shape))[0]


@pytest.mark.parametrize("half_model", [False, True], ids=["fp32-model", "half-model"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast", "off"])
@pytest.mark.parametrize("transform", ["functional_call", "grad", "jacrev", "vmap"])
def test_transforms_decide_autocast_as_autocast_does(transform, policy, half_model):
    """Under every transform, ``vmap`` included, a 16-bit input with CPU autocast enabled gets the
    policy; under the policy ``off`` the result is plain torch's."""
    dtype = torch.bfloat16
    bn = batch_norm(2, C, seeded_stats=True).eval()
    stats = bn.running_mean.double(), bn.running_var.double()
    if half_model:
        bn = bn.to(dtype)  # its master holds the FP32 stats
    x = seeded_input((4, C, 3, 3), dtype, scale=2, shift=1)
    if half_model and transform in ("grad", "jacrev", "vmap"):
        # Traced by a transform, the computation reads the buffers, not the master (docs/configuration.md).
        stats = bn.running_mean.double(), bn.running_var.double()
    if transform == "vmap" and not half_model and policy == "off":
        # torch's own call: a 16-bit input next to FP32 weight and stats, which it rejects under vmap.
        with torch.autocast("cpu", dtype=dtype), amp_bn_fix.policy(policy), pytest.raises(RuntimeError):
            _in_transform(transform, bn, x)
        return
    with torch.autocast("cpu", dtype=dtype), amp_bn_fix.policy(policy):
        out = _in_transform(transform, bn, x)
    reference = fp64_batch_norm(x, *stats, bn.weight, bn.bias, False, 0.1, bn.eps).out
    if policy == "off":
        with shim_disabled(), torch.autocast("cpu", dtype=dtype):
            expected = _in_transform(transform, bn, x)
        assert out.dtype is expected.dtype and torch.equal(out, expected)
        return
    assert out.dtype is (torch.float32 if policy == "fp32" else dtype)
    assert_near(out, reference, x.numel() // C)
