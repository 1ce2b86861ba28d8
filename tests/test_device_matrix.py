"""One matrix of handled calls, on every device: the CPU run proves the test, a GPU run checks CUDA's route.

Every norm module the shim serves (BatchNorm1d/2d/3d, channels_last, ``affine=False``,
InstanceNorm with running stats), FP32 models and half models (their FP32 master), every policy,
training and eval, float16 and bfloat16 autocast, on both routes: the output's dtype is the policy's, its values and
the running stats are FP32-accurate against float64 on the same values. The CUDA half runs where a
GPU is (``tools/gpu_check.sh``), skipped elsewhere.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _bounds import assert_near
from _shared import ORIGINAL, computed_stats
from amp_bn_fix import _master

C = 6
KINDS = {
    "bn1d": (lambda: nn.BatchNorm1d(C), (8, C, 5), None),
    "bn2d": (lambda: nn.BatchNorm2d(C), (8, C, 5, 5), None),
    "bn2d-channels_last": (lambda: nn.BatchNorm2d(C), (8, C, 5, 5), torch.channels_last),
    "bn3d": (lambda: nn.BatchNorm3d(C), (4, C, 3, 4, 4), None),
    "bn2d-affine-false": (lambda: nn.BatchNorm2d(C, affine=False), (8, C, 5, 5), None),
    "instance2d": (lambda: nn.InstanceNorm2d(C, affine=True, track_running_stats=True), (8, C, 5, 5), None),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _module(kind, dtype, half_model, device):
    make, _, _ = KINDS[kind]
    torch.manual_seed(0)
    m = make()
    with torch.no_grad():
        if m.weight is not None:
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
    return m.to(device, dtype if half_model else torch.float32)


def _reference(m, x, stats, training):
    w = None if m.weight is None else m.weight.detach().double()
    b = None if m.bias is None else m.bias.detach().double()
    if isinstance(m, nn.InstanceNorm2d):
        return F.instance_norm(x.double(), *stats, w, b, use_input_stats=training, momentum=m.momentum, eps=m.eps)
    return ORIGINAL(x.double(), *stats, w, b, training, m.momentum, m.eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
@pytest.mark.parametrize("half_model", [False, True], ids=["fp32-model", "half-model"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_norm_module_under_every_policy(both_routes, dtype, kind, half_model, policy, training, device):
    import amp_bn_fix

    m = _module(kind, dtype, half_model, device).train(training)
    _, shape, layout = KINDS[kind]
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2 + 1).to(device, dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    stats = tuple(s.double() for s in computed_stats(m))
    with torch.autocast(device, dtype=dtype), amp_bn_fix.policy(policy):
        out = m(x)
    expected = _reference(m, x, stats, training)
    assert out.dtype is (torch.float32 if policy == "fp32" else dtype)
    if layout is not None:
        assert out.is_contiguous(memory_format=layout)
    n = x.numel() // C
    assert_near(out, expected, n, what="output")
    got = tuple(s.double() for s in computed_stats(m))
    for stat, want, what in zip(got, stats, ("running mean", "running var")):
        scale = want.abs().max().item() + (1 if what == "running mean" else 0)
        # Held 16 bits wide without a master (InstanceNorm's), the stats are rounded once more.
        held = m.running_mean.dtype if _master.peek(m.running_mean, m.running_var) is None else torch.float32
        assert_near(stat.to(held), want, n, scale=scale, what=what)
