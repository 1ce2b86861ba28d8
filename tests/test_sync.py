"""SyncBatchNorm's syncing path goes through the policy too.

Its kernels are CUDA-only, so on CPU the sync function is replaced by a recorder that does what it
does for one rank (batch statistics, running-stat update, normalization) and notes what it got.
"""

import pytest
import torch
import torch.nn.functional as F
import wrapt
from torch.nn.modules import _functions
from torch.nn.modules import batchnorm as batchnorm_module

import amp_bn_fix
from _bounds import assert_near, batch_norm_scales
from amp_bn_fix import _patch

EPS, MOMENTUM = 1e-5, 0.1
N = 8 * 4  # values per channel in make()'s input


class Recorder:
    """Stands in for ``SyncBatchNorm.apply`` with one rank; keeps the arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, cls, input, weight, bias, running_mean, running_var, eps, momentum, group, world_size):
        self.calls.append(
            dict(
                args=(input, weight, bias, running_mean, running_var),
                autocast=torch.is_autocast_enabled("cpu"),
                world_size=world_size,
            )
        )
        return torch.batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps, False)


@pytest.fixture
def recorder(monkeypatch):
    """The recorder in place of the real function, with the shim's wrapper on top of it."""
    record = Recorder()
    _patch.uninstall()
    monkeypatch.setattr(_functions.SyncBatchNorm, "apply", classmethod(record))
    _patch.install()
    yield record
    _patch.uninstall()  # before monkeypatch restores the real function under it


def make(dtype=torch.float32, channels=3):
    torch.manual_seed(0)
    weight = (torch.rand(channels) + 0.5).to(dtype).requires_grad_()
    bias = torch.randn(channels).to(dtype).requires_grad_()
    mean, var = torch.randn(channels).to(dtype), (torch.rand(channels) + 0.5).to(dtype)
    x = (torch.randn(8, channels, 4) * 3 + 1).to(torch.bfloat16).requires_grad_()
    return x, weight, bias, mean, var


def sync_apply(x, weight, bias, mean, var):
    # Exactly how nn.SyncBatchNorm.forward calls it (through the name batchnorm.py imported).
    return batchnorm_module.sync_batch_norm.apply(x, weight, bias, mean, var, EPS, MOMENTUM, None, 2)


def reference(x, weight, bias, mean, var):
    """float64 batch norm of the same values; returns the output and the updated running stats."""
    mean64, var64 = mean.detach().double(), var.detach().double()
    out = F.batch_norm(
        x.detach().double(), mean64, var64, weight.detach().double(), bias.detach().double(), True, MOMENTUM, EPS
    )
    return out, mean64, var64


def test_install_wraps_the_sync_function_and_uninstall_restores_it():
    assert isinstance(_functions.SyncBatchNorm.__dict__.get("apply"), wrapt.FunctionWrapper)
    amp_bn_fix.disable()
    assert "apply" not in _functions.SyncBatchNorm.__dict__  # inherited from Function again
    amp_bn_fix.enable()
    assert isinstance(_functions.SyncBatchNorm.__dict__.get("apply"), wrapt.FunctionWrapper)


@pytest.mark.parametrize(
    "policy, out_dtype", [("fp32", torch.float32), ("input", torch.bfloat16), ("autocast", torch.float16)]
)
def test_half_input_reaches_the_sync_function_in_fp32(recorder, policy, out_dtype):
    x, weight, bias, mean, var = make()
    expected, expected_mean, expected_var = reference(x, weight, bias, mean, var)
    autocast_dtype = torch.float16 if policy == "autocast" else torch.bfloat16
    with torch.autocast("cpu", dtype=autocast_dtype), amp_bn_fix.policy(policy):
        out = sync_apply(x, weight, bias, mean, var)
    (call,) = recorder.calls
    assert [t.dtype for t in call["args"]] == [torch.float32] * 5
    assert call["autocast"] is False
    assert call["world_size"] == 2
    assert torch.equal(call["args"][0], x.detach().float())
    assert call["args"][1] is weight and call["args"][2] is bias  # FP32 params go in as they are
    assert out.dtype == out_dtype
    assert_near(out, expected, N, what="output")
    assert mean.dtype == var.dtype == torch.float32
    assert_near(mean, expected_mean, N, what="running mean")
    assert_near(var, expected_var, N, what="running var")


def test_gradients_flow_back_in_the_input_dtype(recorder):
    x, weight, bias, mean, var = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sync_apply(x, weight, bias, mean, var)
    out.pow(2).sum().backward()
    x64 = x.detach().double().requires_grad_()
    w64, b64 = weight.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    F.batch_norm(x64, None, None, w64, b64, True, MOMENTUM, EPS).pow(2).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    # The loss's gradient 2 * out cancels in the input gradient (to about 0): its error is relative
    # to the magnitude of what the backward sums.
    _, input_scale, param_scale = batch_norm_scales(x, weight, 2 * out, EPS)
    assert_near(x.grad, x64.grad, N, scale=input_scale, what="input gradient")
    assert_near(weight.grad, w64.grad, N, scale=param_scale, what="weight gradient")


def test_half_parameters_and_stats_are_computed_in_fp32_and_written_back(recorder):
    x, weight, bias, mean, var = make(torch.bfloat16)
    _, expected_mean, expected_var = reference(x, weight, bias, mean, var)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sync_apply(x, weight, bias, mean, var)
    (call,) = recorder.calls
    assert [t.dtype for t in call["args"]] == [torch.float32] * 5
    assert mean.dtype == torch.bfloat16  # the caller's tensors keep their dtype, updated in place
    # The FP32 update, rounded once to bfloat16.
    assert_near(mean, expected_mean, N, what="running mean")
    assert_near(var, expected_var, N, what="running var")


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")  # tests/test_record.py checks it
def test_guard_keeps_running_stats_when_the_batch_is_not_finite(recorder):
    x, weight, bias, mean, var = make()
    x = x.detach().clone()
    x[0, 0, 0] = float("inf")
    before = mean.clone(), var.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sync_apply(x, weight, bias, mean, var)
    assert torch.equal(mean, before[0]) and torch.equal(var, before[1])


@pytest.mark.parametrize("case", ["fp32 input", "policy off", "device not selected", "no autocast", "re-entered"])
def test_calls_it_does_not_handle_pass_through_untouched(recorder, case):
    x, weight, bias, mean, var = make()
    if case == "fp32 input":
        x = x.detach().float()
    elif case == "policy off":
        amp_bn_fix.set_policy("off")
    elif case == "device not selected":
        amp_bn_fix.configure(devices=["cuda"])
    elif case == "no autocast":  # all in bfloat16: the caller chose it, as F.batch_norm leaves it
        weight, bias, mean, var = (t.detach().to(torch.bfloat16) for t in (weight, bias, mean, var))
    _patch._thread.inside = case == "re-entered"
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "no autocast"):
            out = sync_apply(x, weight, bias, mean, var)
    finally:
        _patch._thread.inside = False
    (call,) = recorder.calls
    assert all(got is given for got, given in zip(call["args"], (x, weight, bias, mean, var)))
    assert out.dtype == x.dtype
    # Control: without the condition, the same call is handled.
    amp_bn_fix.configure(policy="fp32", devices=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sync_apply(x.detach().to(torch.bfloat16), weight, bias, mean, var)
    assert recorder.calls[1]["args"][0].dtype == torch.float32


@pytest.mark.cuda
def test_real_sync_function_on_cuda(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        x = (torch.randn(16, 4, 6, device="cuda") * 3 + 1).half().requires_grad_()
        weight = (torch.rand(4, device="cuda") + 0.5).requires_grad_()
        bias = torch.randn(4, device="cuda").requires_grad_()
        mean, var = torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")
        expected, expected_mean, expected_var = reference(x, weight, bias, mean, var)
        with torch.autocast("cuda", dtype=torch.float16):
            out = _functions.SyncBatchNorm.apply(x, weight, bias, mean, var, EPS, MOMENTUM, dist.group.WORLD, 1)
        assert out.dtype == torch.float32 and mean.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mean.double(), expected_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(var.double(), expected_var, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()
    finally:
        dist.destroy_process_group()
