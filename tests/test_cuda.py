"""The bug report (pytorch#88929) verbatim on CUDA; skipped without a CUDA device."""

import pytest
import torch
from torch import nn

import amp_bn_fix

pytestmark = pytest.mark.cuda


def run_report(autocast):
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).cuda()
    o = torch.randn(2, 4).cuda()
    dtypes = []
    with autocast():
        for layer in net:
            o = layer(o)
            dtypes.append(o.dtype)
    return net, dtypes


@pytest.mark.parametrize(
    "autocast",
    [lambda: torch.cuda.amp.autocast(), lambda: torch.autocast("cuda")],
    ids=["torch.cuda.amp.autocast", "torch.autocast"],
)
def test_bug_report_on_cuda(autocast):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast is deprecated, still used
        net, dtypes = run_report(autocast)
        assert dtypes == [torch.float16, torch.float32, torch.float16]
        assert net[1].running_mean.dtype is torch.float32 and net[1].running_var.dtype is torch.float32
        amp_bn_fix.disable()
        assert run_report(autocast)[1] == [torch.float16] * 3


def test_bn_first_layer_on_cuda_stays_fp32():
    net = nn.Sequential(nn.BatchNorm1d(4)).cuda()
    with torch.autocast("cuda"):
        assert net(torch.randn(2, 4).cuda()).dtype is torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_numerics_match_fp64(dtype):
    import copy

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8).cuda()
    x = (torch.randn(16, 8, 7, 7, device="cuda") * 3 + 1).to(dtype)
    ref = copy.deepcopy(bn).double()
    expected = ref(x.double())
    with torch.autocast("cuda", dtype=dtype):
        out = bn(x)
    assert out.dtype is torch.float32
    assert (out.double() - expected).abs().max().item() < 2e-5
    torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-6, atol=1e-6)
