"""Mixed-dtype calls: half input with FP32 running stats (what ``model.half()`` leaves with the shim)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_bn_fix
from amp_bn_fix import _patch

HALF = [torch.float16, torch.bfloat16]
# One rounding of an FP32 result to the output dtype, plus a little for the FP32 arithmetic.
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
C = 6


def _tensors(dtype, affine_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 + 2 * torch.randn(32, C, 5, generator=g)).to(dtype)
    mean, var = torch.randn(C, generator=g), 1 + torch.rand(C, generator=g)
    weight, bias = (1 + torch.rand(C, generator=g)).to(affine_dtype), torch.randn(C, generator=g).to(affine_dtype)
    return x, mean, var, weight, bias


def _fp64_reference(x, mean, var, weight, bias, training, momentum=0.1, eps=1e-5):
    """F.batch_norm in float64 on the very same values (a float64 call is not handled by the shim)."""
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    mean64, var64 = mean.double(), var.double()
    out = F.batch_norm(x64, mean64, var64, w64, b64, training, momentum, eps)
    return out, mean64, var64, (x64, w64, b64)


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=RTOL[dtype], atol=RTOL[dtype])


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
    ref, ref_mean, ref_var, _ = _fp64_reference(x, mean, var, weight, bias, training)
    out = F.batch_norm(x, mean, var, weight, bias, training)
    assert out.dtype == dtype
    _close(out, ref, dtype)
    assert mean.dtype == torch.float32
    # The FP32 running stats are updated in FP32: float64 agreement to FP32 rounding.
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "policy, expected",
    [("fp32", torch.float32), ("input", torch.bfloat16), ("autocast", torch.float16)],
)
def test_mixed_call_under_autocast_follows_the_policy(policy, expected):
    # A bfloat16 input under float16 autocast tells "input" and "autocast" apart.
    x, mean, var, weight, bias = _tensors(torch.bfloat16, torch.bfloat16)
    ref, ref_mean, _, _ = _fp64_reference(x, mean, var, weight, bias, True)
    with torch.autocast("cpu", dtype=torch.float16), amp_bn_fix.policy(policy):
        out = F.batch_norm(x, mean, var, weight, bias, True)
    assert out.dtype == expected
    _close(out, ref, expected)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_half_weight_gradients_reach_the_half_parameters(dtype, autocast):
    x, mean, var, weight, bias = _tensors(dtype, dtype)
    x.requires_grad_()
    weight.requires_grad_()
    bias.requires_grad_()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref, _, _, leaves = _fp64_reference(x, mean, var, weight, bias, True)
    (ref * upstream.double()).sum().backward()
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = F.batch_norm(x, mean, var, weight, bias, True)
    (out.float() * upstream).sum().backward()
    for tensor, leaf in zip((x, weight, bias), leaves):
        assert tensor.grad.dtype == dtype
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, rtol=RTOL[dtype], atol=RTOL[dtype] * 4)


@pytest.mark.parametrize("keep", ["stats", "all"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_model_trains_and_evaluates_outside_autocast(dtype, keep):
    """A whole ``model.half()`` network: BN calls are mixed, everything else is plain half."""
    _patch.configure(_patch.current_config().replace(keep_fp32=keep))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, C, 3), nn.BatchNorm1d(C), nn.ReLU(), nn.Flatten(), nn.Linear(C * 6, 2))
    reference = copy.deepcopy(model).double()
    model.to(dtype)
    assert model[1].running_mean.dtype == torch.float32
    x = torch.randn(16, 3, 8).to(dtype)
    out = model(x)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert model[0].weight.grad.dtype == dtype and model[1].weight.grad is not None
    ref = reference(x.double())
    _close(out, ref.detach(), dtype)
    torch.testing.assert_close(model[1].running_mean.double(), reference[1].running_mean, rtol=1e-2, atol=1e-2)
    model.eval()
    reference.eval()
    _close(model(x), reference(x.double()).detach(), dtype)
