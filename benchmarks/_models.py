"""Inputs, BatchNorm calls and the models the benchmark times, built from ``torch.nn`` only."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def half_input(shape: Sequence[int], dtype: torch.dtype, device: str, channels_last: bool = False,
               seed: int = 0) -> torch.Tensor:
    """A conv-like 16-bit activation (non-zero mean) that requires grad."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tuple(shape), generator=g) * 2 + 0.5).to(device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def grads_like(x: torch.Tensor) -> Dict[torch.dtype, torch.Tensor]:
    """An incoming gradient in each dtype a BatchNorm output can have (16-bit or FP32), laid out as ``x``."""
    g = torch.randn_like(x, dtype=torch.float32)
    return {torch.float32: g, x.dtype: g.to(x.dtype)}


def bn_forward(bn: nn.Module, x: torch.Tensor, device: str, dtype: torch.dtype, by_hand: bool = False) -> torch.Tensor:
    """BatchNorm under autocast; ``by_hand``: the FP32 peer users write today (autocast off, ``x.float()``)."""
    with torch.autocast(device, dtype=dtype):
        if by_hand:
            with torch.autocast(device, enabled=False):
                return bn(x.float())
        return bn(x)


def bn_step(bn: nn.Module, x: torch.Tensor, grads: Dict[torch.dtype, torch.Tensor], device: str,
            dtype: torch.dtype, by_hand: bool = False, backward: bool = True) -> Callable[[], None]:
    """One BatchNorm forward (and backward) under autocast, given the incoming gradient per output dtype."""

    def step() -> None:
        y = bn_forward(bn, x, device, dtype, by_hand)
        y.backward(grads[y.dtype])
        x.grad = bn.weight.grad = bn.bias.grad = None

    def forward_only() -> None:
        with torch.no_grad():
            bn_forward(bn, x, device, dtype, by_hand)

    return step if backward else forward_only


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum and a learning rate of 0: every op of a step runs, and the weights stay put.

    A benchmark repeats a step on one batch thousands of times; a model that learns from it can
    diverge, and non-finite values take other paths (the guard's skip, slow float ops).
    """
    return torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str,
               dtype: torch.dtype = torch.bfloat16) -> Callable[[], None]:
    """One SGD step of ``model`` under autocast, with a cross-entropy loss."""
    opt = sgd(model)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: Optional[nn.Module] = None) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act] if act is not None else []))


class ByHandFP32(nn.Module):
    """A BatchNorm computed as users write it today: autocast off, ``bn(x.float())``."""

    def __init__(self, bn: nn.Module):
        super().__init__()
        self.bn = bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return self.bn(x.float())


def by_hand_fp32(model: nn.Module) -> nn.Module:
    """``model`` with each BatchNorm (the same module, shared) computed by hand in FP32."""
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, ByHandFP32(child))
        else:
            by_hand_fp32(child)
    return model


def count_bn(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class ConvBNResidual(nn.Module):
    """``relu(x + bn(conv(x)))``: the small-call regime's residual block."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = conv_bn(channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


def tiny_convnet(classes: int = 10) -> nn.Module:
    """Conv 3->32 + BN + ReLU, two residual blocks of conv+BN, pooling and a classifier: 3 BatchNorms."""
    return nn.Sequential(conv_bn(3, 32, 3, act=nn.ReLU()), ConvBNResidual(32), ConvBNResidual(32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions, each followed by a BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, cout, 3, stride, act=nn.ReLU()), conv_bn(cout, cout, 3))
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


class Bottleneck(nn.Module):
    """ResNet-50's block (torchvision's v1.5 layout: the stride on the 3x3 convolution)."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(conv_bn(cin, width, 1, act=nn.ReLU()), conv_bn(width, width, 3, stride, act=nn.ReLU()),
                                  conv_bn(width, cout, 1))
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


class InvertedResidual(nn.Module):
    """MobileNet/EfficientNet block: 1x1 expansion, depthwise kxk, optional squeeze-excitation, 1x1 projection."""

    def __init__(self, cin: int, cout: int, expand: int, k: int, stride: int, act: type, se: bool):
        super().__init__()
        mid = cin * expand
        layers: List[nn.Module] = [conv_bn(cin, mid, 1, act=act())] if expand != 1 else []
        layers.append(conv_bn(mid, mid, k, stride, groups=mid, act=act()))
        self.body = nn.Sequential(*layers)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, max(8, mid // 4), 1), act(),
                                nn.Conv2d(max(8, mid // 4), mid, 1), nn.Sigmoid()) if se else None
        self.project = conv_bn(mid, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.se is not None:
            out = out * self.se(out)
        out = self.project(out)
        return out + x if self.residual else out


def resnet18_like(classes: int = 10) -> nn.Module:
    """ResNet-18's layout: 7x7 stem and max-pool, four stages of two basic blocks (64 to 512 channels)."""
    layers: List[nn.Module] = [conv_bn(3, 64, 7, 2, act=nn.ReLU()), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        layers += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def resnet50_like(classes: int = 1000, blocks: Sequence[int] = (3, 4, 6, 3)) -> nn.Module:
    """ResNet-50's layout (torchvision's ``resnet50``: 25.6 M parameters with 1000 classes, 53 BatchNorms)."""
    layers: List[nn.Module] = [conv_bn(3, 64, 7, 2, act=nn.ReLU()), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, (width, repeats) in enumerate(zip((64, 128, 256, 512), blocks)):
        for i in range(repeats):
            layers.append(Bottleneck(cin, width, 2 if stage > 0 and i == 0 else 1))
            cin = width * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def mobilenet_like(classes: int = 10) -> nn.Module:
    """MobileNetV3-Small's layout: depthwise blocks (expansion, kernel, stride, SE), Hardswish."""
    hs, relu = nn.Hardswish, nn.ReLU
    # (out channels, expansion, kernel, stride, activation, squeeze-excitation)
    spec = [(16, 1, 3, 2, relu, True), (24, 4, 3, 2, relu, False), (24, 4, 3, 1, relu, False),
            (40, 4, 5, 2, hs, True), (40, 6, 5, 1, hs, True), (40, 6, 5, 1, hs, True), (48, 3, 5, 1, hs, True),
            (48, 3, 5, 1, hs, True), (96, 6, 5, 2, hs, True), (96, 6, 5, 1, hs, True), (96, 6, 5, 1, hs, True)]
    layers: List[nn.Module] = [conv_bn(3, 16, 3, 2, act=hs())]
    cin = 16
    for cout, expand, k, stride, act, se in spec:
        layers.append(InvertedResidual(cin, cout, expand, k, stride, act, se))
        cin = cout
    layers += [conv_bn(cin, 576, 1, act=hs()), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(576, classes)]
    return nn.Sequential(*layers)


def efficientnet_like(classes: int = 10) -> nn.Module:
    """EfficientNet-B0's layout: MBConv blocks with SiLU and squeeze-excitation, expansion 6."""
    # (out channels, expansion, kernel, stride, repeats)
    spec = [(16, 1, 3, 1, 1), (24, 6, 3, 2, 2), (40, 6, 5, 2, 2), (80, 6, 3, 2, 3), (112, 6, 5, 1, 3),
            (192, 6, 5, 2, 4), (320, 6, 3, 1, 1)]
    layers: List[nn.Module] = [conv_bn(3, 32, 3, 2, act=nn.SiLU())]
    cin = 32
    for cout, expand, k, stride, repeats in spec:
        for i in range(repeats):
            layers.append(InvertedResidual(cin, cout, expand, k, stride if i == 0 else 1, nn.SiLU, True))
            cin = cout
    layers += [conv_bn(cin, 1280, 1, act=nn.SiLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


MODELS = {"mobilenet-like": mobilenet_like, "efficientnet-like": efficientnet_like, "resnet18-like": resnet18_like}


def small_net() -> nn.Module:
    """Three conv+BN+ReLU blocks and a classifier: quick to compile on a small machine."""
    return nn.Sequential(conv_bn(3, 32, 3, 2, act=nn.ReLU()), conv_bn(32, 64, 3, 2, act=nn.ReLU()),
                         conv_bn(64, 64, 3, act=nn.ReLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
