"""BatchNorm model patterns and what the multi-process tests record about BatchNorm (not a test module).

Imported by tests/test_clients.py and by the worker scripts tests/dist_worker.py and
tests/client_worker.py, which never import amp_bn_fix: only the environment (``AMP_BN_FIX=1``) can
enable the shim in them.

The models rebuild, from ``torch.nn`` alone, the BatchNorm patterns of torchvision and timm (whose
wheels on the package index need the CUDA build of torch): a ResNet basic block, a MobileNet-style
depthwise-separable block, and timm's ``BatchNormAct2d``, a BatchNorm2d subclass that calls
``F.batch_norm`` itself and applies its activation in the same forward.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from _bounds import fp32_bound


def excess(got: torch.Tensor, want: torch.Tensor, n: int) -> float:
    """How far ``got`` is from the float64 ``want`` beyond ``_bounds.fp32_bound`` for sums of ``n``
    terms: <= 0 within it, inf when not finite."""
    err = (got.detach().double() - want).abs()
    if not err.numel():
        return 0.0
    return (err - fp32_bound(want, n, got.dtype)).max().item() if torch.isfinite(err).all() else math.inf


def bn_modules(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class Watch:
    """Hooks on BatchNorm modules: the dtypes of each call and its errors against float64.

    The pre-hook keeps the running stats before the call; the forward hook recomputes the call
    with ``F.batch_norm`` on float64 copies of the input BatchNorm received, its weight, bias and
    those stats (float64 calls pass through the shim untouched), and compares the module's output
    and its updated running stats with the result (``excess``: <= 0 at FP32 accuracy, the output
    rounded once to its dtype). Registered after a wrapper (FSDP, DDP) is
    built, the hooks run after the wrapper's own and see what the module really returns.
    """

    def __init__(self, modules: List[nn.Module]):
        self.calls: List[Dict[str, Any]] = []
        self._before: Dict[int, tuple] = {}
        for m in modules:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    @staticmethod
    def _computed(m: nn.Module) -> tuple:
        """The running stats the shim computes with: a half model's FP32 master where it keeps one."""
        try:
            from amp_bn_fix import _master
        except ImportError:  # a run without the shim
            return m.running_mean, m.running_var
        master = _master.peek(m.running_mean, m.running_var)
        return (m.running_mean, m.running_var) if master is None else (master[0], master[1])

    def _pre(self, m: nn.Module, args: tuple) -> None:
        self._before[id(m)] = tuple(t.detach().clone() for t in self._computed(m))

    def _post(self, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        x = args[0].detach()
        mean0, var0 = self._before.pop(id(m))
        mean64, var64 = mean0.double(), var0.double()
        weight = None if m.weight is None else m.weight.detach().double()
        bias = None if m.bias is None else m.bias.detach().double()
        with torch.autocast(x.device.type, enabled=False):
            ref = F.batch_norm(x.double(), mean64, var64, weight, bias, m.training, m.momentum, m.eps)
        mean, var = self._computed(m)
        n = x.numel() // x.shape[1]
        self.calls.append(
            {
                "module": type(m).__name__,
                "input": str(x.dtype),
                "weight": str(m.weight.dtype) if m.weight is not None else None,
                "stats": str(m.running_mean.dtype),
                "out": str(out.dtype),
                "out_excess": excess(out, ref, n),
                "stats_excess": max(excess(mean, mean64, n), excess(var, var64, n)),
                "autocast": torch.is_autocast_enabled(x.device.type),
                "training": m.training,
            }
        )


def shim_state() -> Dict[str, Any]:
    """Whether the start-up hook loaded and enabled amp_bn_fix here, found without importing it."""
    shim = sys.modules.get("amp_bn_fix")
    return {
        "loaded": shim is not None,
        "enabled": bool(shim is not None and shim.is_enabled()),
        "policy": shim.get_policy() if shim is not None else None,
    }


# ---- model patterns -----------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: conv-bn-relu-conv-bn, a downsampling shortcut, add, relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet(num_classes: int = 4) -> nn.Sequential:
    """A small ResNet: stem (conv-bn-relu-maxpool), two basic blocks, pooling, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        BasicBlock(8, 8), BasicBlock(8, 16, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes),
    )


class DepthwiseSeparable(nn.Module):
    """MobileNet(V1/V2)-style: depthwise 3x3 conv-bn-relu6, pointwise 1x1 conv-bn (linear bottleneck)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.bn_dw = nn.BatchNorm2d(cin)
        self.act = nn.ReLU6(inplace=True)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn_pw = nn.BatchNorm2d(cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn_pw(self.pw(self.act(self.bn_dw(self.dw(x)))))
        return x + out if self.residual else out


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: its own forward calls ``F.batch_norm``, then a fused activation."""

    def __init__(self, num_features: int, **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            self.training or self.running_mean is None,
            0.0 if self.momentum is None else self.momentum,
            self.eps,
        )
        return self.act(x)


def mobilenet(num_classes: int = 4) -> nn.Sequential:
    """A small MobileNet-style net with a timm-style BatchNormAct2d stem."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1, bias=False), BatchNormAct2d(8),
        DepthwiseSeparable(8, 8), DepthwiseSeparable(8, 16, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes),
    )
