"""Numerics of handled calls, against float64 references computed by the unpatched function."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import amp_bn_fix
from _bounds import assert_near, batch_norm_scales
from _builders import batch_norm, fp64_batch_norm, fp64_module, seeded_input
from _shared import ORIGINAL
from amp_bn_fix import _plan

LOW = [torch.float16, torch.bfloat16]
# (dimensions, input shape): BatchNorm1d takes (N, C) and (N, C, L).
KINDS = {
    "1d": (1, (16, 6)),
    "1d-seq": (1, (8, 6, 5)),
    "2d": (2, (8, 6, 5, 4)),
    "3d": (3, (4, 6, 3, 4, 3)),
}

# Every test on the CPU's route and on the route a CUDA call takes (see conftest).
pytestmark = pytest.mark.usefixtures("both_routes")


def make_bn(kind, affine=True, track=True):
    """The kind's module, with seeded stats, and an FP32 input whose mean is far from zero."""
    dims, shape = KINDS[kind]
    gen = torch.Generator().manual_seed(0)
    bn = batch_norm(dims, shape[1], affine, track, seeded_stats=True, seed=gen)
    return bn, seeded_input(shape, torch.float32, seed=gen, scale=3, shift=1.5)


def run(bn, x_low, device_dtype, grad_out=None):
    x = x_low.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=device_dtype):
        out = bn(x)
    if grad_out is not None:
        out.backward(grad_out.to(out.dtype))
    return x, out


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("track", [True, False], ids=["stats", "nostats"])
def test_fp32_policy_matches_fp64(kind, dtype, training, affine, track):
    bn, x = make_bn(kind, affine, track)
    bn.train(training)
    x_low = x.to(dtype)
    ref = fp64_module(bn, x_low)
    _, out = run(bn, x_low, dtype)
    assert out.dtype is torch.float32
    n = x.numel() // x.shape[1]
    assert_near(out, ref.out, n, what="output")
    if track:
        assert bn.running_mean.dtype is torch.float32 and bn.running_var.dtype is torch.float32
        assert_near(bn.running_mean, ref.running_mean, n, what="running mean")
        assert_near(bn.running_var, ref.running_var, n, what="running var")


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_fp32_policy_is_far_closer_than_native(dtype):
    bn, x = make_bn("2d")
    x_low = x.to(dtype)
    ref_out = fp64_module(bn, x_low).out
    _, shim_out = run(copy.deepcopy(bn), x_low, dtype)
    amp_bn_fix.disable()
    _, native_out = run(copy.deepcopy(bn), x_low, dtype)
    assert native_out.dtype is dtype
    assert max_err(shim_out, ref_out) * 100 < max_err(native_out, ref_out)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", ["input", "autocast"])
@pytest.mark.parametrize("params", ["fp32", "half"])
def test_low_precision_policies_round_once(kind, dtype, training, policy, params):
    bn, x = make_bn(kind)
    bn.train(training)
    if params == "half":  # FP32 stats with half weight/bias: native kernels reject this mix
        bn.weight.data, bn.bias.data = bn.weight.data.to(dtype), bn.bias.data.to(dtype)
    x_low = x.to(dtype)
    ref = fp64_module(bn, x_low)
    amp_bn_fix.set_policy(policy)
    _, out = run(bn, x_low, dtype)
    assert out.dtype is dtype  # input dtype and autocast dtype agree here
    # An FP32 result rounded once to ``dtype``; FP32 running stats.
    n = x.numel() // x.shape[1]
    assert_near(out, ref.out, n, what="output")
    assert_near(bn.running_mean, ref.running_mean, n, what="running mean")
    assert_near(bn.running_var, ref.running_var, n, what="running var")


@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
def test_output_dtype_follows_policy_when_input_and_autocast_dtypes_differ(policy):
    bn, x = make_bn("2d")
    amp_bn_fix.set_policy(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bn(x.half())
    expected = {"fp32": torch.float32, "input": torch.float16, "autocast": torch.bfloat16}[policy]
    assert out.dtype is expected


@pytest.mark.parametrize("kind", ["1d", "2d", "3d"])
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", ["fp32", "input"])
def test_gradients_match_fp64(kind, dtype, training, policy):
    bn, x = make_bn(kind)
    bn.train(training)
    x_low = x.to(dtype)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref = fp64_module(bn, x_low, grad_out.to(dtype) if policy == "input" else grad_out)
    amp_bn_fix.set_policy(policy)
    x_in, _ = run(bn, x_low, dtype, grad_out)
    assert x_in.grad.dtype is dtype and bn.weight.grad.dtype is torch.float32
    # The input gradient is stored in ``dtype``: one rounding of it. Parameter gradients are FP32
    # reductions (the reference gets the same incoming gradient, low precision under ``input``).
    n = x.numel() // x.shape[1]
    assert_near(x_in.grad, ref.grad_input, n, what="input gradient")
    assert_near(bn.weight.grad, ref.grad_weight, n, what="weight gradient")
    assert_near(bn.bias.grad, ref.grad_bias, n, what="bias gradient")


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_half_weight_and_bias_compute_in_fp32_and_get_their_gradients(dtype):
    bn, x = make_bn("2d")
    x_low = x.to(dtype)
    weight = bn.weight.detach().to(dtype).requires_grad_()
    bias = bn.bias.detach().to(dtype).requires_grad_()
    running_mean, running_var = bn.running_mean.clone(), bn.running_var.clone()
    with torch.autocast("cpu", dtype=dtype):
        out = F.batch_norm(x_low, running_mean, running_var, weight, bias, training=True)
    out.sum().backward()
    assert out.dtype is torch.float32
    assert weight.grad.dtype is dtype and bias.grad.dtype is dtype
    ref = fp64_batch_norm(x_low, bn.running_mean, bn.running_var, weight, bias, training=True,
                          grad_out=torch.ones_like(out))
    n = x_low.numel() // x_low.shape[1]
    assert_near(out, ref.out, n, what="output")
    assert_near(running_mean, ref.running_mean, n, what="running mean")
    assert_near(running_var, ref.running_var, n, what="running var")
    # FP32 reductions rounded once to the parameters' dtype; sum(x_hat) cancels to about 0, so the
    # weight gradient's error is relative to the magnitude of what it sums.
    _, _, param_scale = batch_norm_scales(x_low, weight, torch.ones_like(out))
    assert_near(weight.grad, ref.grad_weight, n, scale=param_scale, what="weight gradient")
    assert_near(bias.grad, ref.grad_bias, n, what="bias gradient")


def test_running_stats_are_the_same_objects_and_stay_fp32():
    bn, x = make_bn("2d")
    mean, var = bn.running_mean, bn.running_var
    before, var_before = mean.clone(), var.clone()
    for dtype in LOW:
        with torch.autocast("cpu", dtype=dtype):
            bn(x.to(dtype))
    assert bn.running_mean is mean and bn.running_var is var
    assert mean.dtype is torch.float32 and var.dtype is torch.float32
    # Both updates arrived, in FP32, as the float64 reference makes them.
    mean64, var64 = before, var_before
    for dtype in LOW:
        ref = fp64_batch_norm(x.to(dtype), mean64, var64, momentum=bn.momentum)
        mean64, var64 = ref.running_mean, ref.running_var
    n = x.numel() // x.shape[1]
    assert_near(mean, mean64, n, what="running mean")
    assert_near(var, var64, n, what="running var")


def test_half_running_stats_are_updated_in_place_with_fp32_arithmetic():
    """Stats that arrive in half precision (a model cast by hand) get the FP32 update, rounded once."""
    bn, x = make_bn("2d")
    x_low = x.to(torch.bfloat16)
    mean = bn.running_mean.to(torch.bfloat16)
    var = bn.running_var.to(torch.bfloat16)
    ref = fp64_batch_norm(x_low, mean, var)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.batch_norm(x_low, mean, var, bn.weight, bn.bias, training=True)
    assert mean.dtype is torch.bfloat16
    # The FP32 update rounded once to bfloat16 (an FP32 and a float64 value near a rounding
    # boundary may round apart: the bound allows one rounding of either).
    n = x_low.numel() // x_low.shape[1]
    assert_near(mean, ref.running_mean, n, what="running mean")
    assert_near(var, ref.running_var, n, what="running var")


def test_shim_and_its_fp64_reference_agree_with_numpy():
    """Training-mode batch norm written out in numpy: the float64 reference the tests use, and the
    shim's own result under autocast."""
    bn, x = make_bn("2d")
    shimmed = copy.deepcopy(bn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = shimmed(x.to(torch.bfloat16))
    ref = fp64_module(bn, x.to(torch.bfloat16))
    a = x.to(torch.bfloat16).double().numpy()
    mean = a.mean(axis=(0, 2, 3), keepdims=True)
    var = a.var(axis=(0, 2, 3), keepdims=True)
    w = bn.weight.detach().double().numpy().reshape(1, -1, 1, 1)
    b = bn.bias.detach().double().numpy().reshape(1, -1, 1, 1)
    expected = (a - mean) / np.sqrt(var + bn.eps) * w + b
    n = a.size // a.shape[1]
    # The reference is a float64 computation of the same sums.
    assert_near(ref.out, torch.from_numpy(expected), n, computed_in=torch.float64, what="reference output")
    running_var = 0.9 * bn.running_var.double().numpy() + 0.1 * var.ravel() * n / (n - 1)
    assert_near(ref.running_var, torch.from_numpy(running_var), n, computed_in=torch.float64, what="reference var")
    assert ours.dtype is torch.float32
    assert_near(ours, torch.from_numpy(expected), n, what="output")
    assert_near(shimmed.running_var, torch.from_numpy(running_var), n, what="running var")


def test_bind_has_the_signature_of_f_batch_norm():
    import inspect

    ours = inspect.signature(_plan.bind)
    theirs = inspect.signature(ORIGINAL)
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
        (p.name, p.default, p.kind) for p in theirs.parameters.values()
    ]


def test_policy_logic_is_stateless_and_device_agnostic():
    """``plan`` depends only on its arguments, the policy and the autocast state of the input's device."""
    call = _plan.bind(torch.zeros(2, 3, dtype=torch.bfloat16), None, None)

    def out_dtype(policy, call):
        with amp_bn_fix.policy(policy):
            plan = _plan.plan(call)
        return None if plan is None else plan.out_dtype

    assert out_dtype("fp32", call) is None  # no autocast, nothing mixed
    with torch.autocast("cpu", dtype=torch.float16):
        assert out_dtype("fp32", call) is torch.float32
        assert out_dtype("input", call) is torch.bfloat16
        assert out_dtype("autocast", call) is torch.float16
        assert out_dtype("off", call) is None
    meta = _plan.bind(torch.zeros(2, 3, dtype=torch.bfloat16, device="meta"), None, None)
    with torch.autocast("cpu", dtype=torch.float16):
        assert out_dtype("fp32", meta) is None  # autocast is on for cpu, not meta
    assert amp_bn_fix.get_policy() == "fp32"
