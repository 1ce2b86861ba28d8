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
from _builders import batch_norm, fp64_batch_norm, seeded_input
from _shared import computed_stats
from amp_bn_fix import _master

C = 6


def _instance_norm():
    """InstanceNorm2d with running stats and seeded parameters and stats (not a BatchNorm: no shared builder)."""
    gen = torch.Generator().manual_seed(0)
    m = nn.InstanceNorm2d(C, affine=True, track_running_stats=True)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5, generator=gen)
        m.bias.uniform_(-0.5, 0.5, generator=gen)
        m.running_mean.uniform_(-1, 1, generator=gen)
        m.running_var.uniform_(0.5, 2, generator=gen)
    return m


KINDS = {
    "bn1d": (lambda: batch_norm(1, C, seeded_stats=True), (8, C, 5), "contiguous"),
    "bn2d": (lambda: batch_norm(2, C, seeded_stats=True), (8, C, 5, 5), "contiguous"),
    "bn2d-channels_last": (lambda: batch_norm(2, C, seeded_stats=True), (8, C, 5, 5), "channels_last"),
    "bn3d": (lambda: batch_norm(3, C, seeded_stats=True), (4, C, 3, 4, 4), "contiguous"),
    "bn2d-affine-false": (lambda: batch_norm(2, C, affine=False, seeded_stats=True), (8, C, 5, 5), "contiguous"),
    "instance2d": (_instance_norm, (8, C, 5, 5), "contiguous"),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _reference(m, x, stats, training):
    """The float64 output of ``m(x)`` computed with ``stats``, and the stats after the call."""
    if isinstance(m, nn.InstanceNorm2d):
        w, b = m.weight.detach().double(), m.bias.detach().double()
        out = F.instance_norm(x.double(), *stats, w, b, use_input_stats=training, momentum=m.momentum, eps=m.eps)
        return out, stats  # updated in place
    ref = fp64_batch_norm(x, *stats, m.weight, m.bias, training, m.momentum, m.eps)
    return ref.out, (ref.running_mean, ref.running_var)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", ["fp32", "input", "autocast"])
@pytest.mark.parametrize("half_model", [False, True], ids=["fp32-model", "half-model"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_norm_module_under_every_policy(both_routes, dtype, kind, half_model, policy, training, device):
    import amp_bn_fix

    make, shape, layout = KINDS[kind]
    m = make().to(device, dtype if half_model else torch.float32).train(training)
    x = seeded_input(shape, dtype, scale=2, shift=1, layout=layout).to(device)
    stats = tuple(s.double() for s in computed_stats(m))
    with torch.autocast(device, dtype=dtype), amp_bn_fix.policy(policy):
        out = m(x)
    expected, stats = _reference(m, x, stats, training)
    assert out.dtype is (torch.float32 if policy == "fp32" else dtype)
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
    n = x.numel() // C
    assert_near(out, expected, n, what="output")
    got = tuple(s.double() for s in computed_stats(m))
    for stat, want, what in zip(got, stats, ("running mean", "running var")):
        scale = want.abs().max().item() + (1 if what == "running mean" else 0)
        # Held 16 bits wide without a master (InstanceNorm's), the stats are rounded once more.
        held = m.running_mean.dtype if _master.peek(m.running_mean, m.running_var) is None else torch.float32
        assert_near(stat.to(held), want, n, scale=scale, what=what)
