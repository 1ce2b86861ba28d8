"""What a handled call costs in ops: the kernel launches a GPU would pay, counted on CPU.

Counted with torch's profiler (top-level ATen ops, view ops left out), which changes nothing about
the route a call takes, on the host route and on the route a CUDA call takes (see conftest).
Timings live in the benchmark, not here.
"""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import amp_bn_fix
from amp_bn_fix import _guard, _patch

# Ops that make a view or read metadata: no kernel runs for them (``resolve_conj``/``resolve_neg``
# return their input unless it is conjugated or negated: ``Tensor.tolist`` calls them).
VIEWS = {"aten::view", "aten::_unsafe_view", "aten::unsqueeze", "aten::select", "aten::slice", "aten::as_strided",
         "aten::alias", "aten::detach", "aten::t", "aten::expand", "aten::unbind", "aten::lift_fresh",
         "aten::resolve_conj", "aten::resolve_neg"}
# Extra ops per handled call, at most: (route, policy, training), for more channels than the host
# guard reads as Python floats (``_guard.LISTED_CHANNELS``); for as few, the host guard runs no op.
BUDGET = {
    ("host", "fp32", True): 4, ("host", "input", True): 3, ("host", "autocast", True): 3,
    ("device", "fp32", True): 6, ("device", "input", True): 5, ("device", "autocast", True): 5,
    ("host", "fp32", False): 1, ("host", "input", False): 0, ("host", "autocast", False): 0,
    ("device", "fp32", False): 1, ("device", "input", False): 0, ("device", "autocast", False): 0,
}


def _ops(run):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::") and e.name not in VIEWS]


# A half model (``keep_fp32="master"``): its 16-bit weight and bias are cast to FP32 per call, and
# in training the master's update is rounded into its buffers.
HALF_MODEL_EXTRA = {True: 3, False: 2}
# And the master is checked against its buffers by value: on the host a comparison (the buffers
# joined, the master rounded, one equality read), on the device a select (two more ops, no read).
MASTER_CHECK_OPS = {"host": 3, "device": 5}


HOST_GUARD_OPS = 3


@pytest.mark.parametrize("channels", [_guard.LISTED_CHANNELS // 2, _guard.LISTED_CHANNELS, 2 * _guard.LISTED_CHANNELS])
@pytest.mark.parametrize("model", ["fp32-model", "half-model"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
def test_a_handled_call_adds_few_ops(both_routes, policy, training, model, channels):
    bn = nn.BatchNorm2d(channels).train(training)
    if model == "half-model":
        bn.bfloat16()
    x = torch.randn(4, channels, 4, 4).bfloat16()

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy(policy):
            bn(x)

    run()  # lazy set-up (a half model's master starts here) is not part of a call
    shim = _ops(run)
    with _patch.uninstalled():
        native = _ops(run)
    assert amp_bn_fix.report()["handled"].get(policy)
    extra = len(shim) - len(native)
    budget = BUDGET[both_routes, policy, training] + (HALF_MODEL_EXTRA[training] + MASTER_CHECK_OPS[both_routes] if model == "half-model" else 0)
    if both_routes == "host" and training and channels <= _guard.LISTED_CHANNELS:
        budget -= HOST_GUARD_OPS
    assert extra <= budget, (shim, native)
    if both_routes == "device":
        assert "aten::item" not in shim and "aten::_local_scalar_dense" not in shim
