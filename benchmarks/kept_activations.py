"""Memory kept for backward in a ResNet-50 and an EfficientNet-B0 training forward, per policy.

The README's "Which policy on a GPU" quotes it. Both models are built from torch.nn after
torchvision's (ResNet-50 v1.5, EfficientNet-B0 with squeeze-excite); one 224x224 image under bf16
autocast, on the route a CUDA call takes (``device_route()``, run on CPU), with the BatchNorm calls
that a batch of ``--batch`` images would send to the large-call route sent there. A prediction
from a count of the tensors autograd keeps, not a GPU measurement. About a minute on 2 cores::

    python benchmarks/kept_activations.py [--batch 32]
"""

import argparse
import sys

import torch
from torch import nn

import amp_bn_fix
from amp_bn_fix import _tuning
from amp_bn_fix.testing import device_route, kept_for_backward


class Bottleneck(nn.Module):
    def __init__(s, cin, width, stride, down):
        super().__init__()
        cout = width * 4
        s.conv1 = nn.Conv2d(cin, width, 1, bias=False); s.bn1 = nn.BatchNorm2d(width)
        s.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False); s.bn2 = nn.BatchNorm2d(width)
        s.conv3 = nn.Conv2d(width, cout, 1, bias=False); s.bn3 = nn.BatchNorm2d(cout)
        s.relu = nn.ReLU(inplace=True)
        s.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) if down else None
    def forward(s, x):
        idt = x if s.down is None else s.down(x)
        y = s.relu(s.bn1(s.conv1(x))); y = s.relu(s.bn2(s.conv2(y))); y = s.bn3(s.conv3(y))
        return s.relu(y + idt)



def resnet50():
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1, i == 0)); cin = width * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))



class MBConv(nn.Module):
    def __init__(s, cin, cout, k, stride, expand):
        super().__init__()
        mid = cin * expand
        s.expand = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.SiLU()) if expand != 1 else nn.Identity()
        s.dw = nn.Sequential(nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.SiLU())
        sq = max(1, cin // 4)
        s.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, sq, 1), nn.SiLU(), nn.Conv2d(sq, mid, 1), nn.Sigmoid())
        s.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        s.res = stride == 1 and cin == cout
    def forward(s, x):
        y = s.dw(s.expand(x)); y = y * s.se(y); y = s.project(y)
        return y + x if s.res else y



def effnet_b0():
    layers = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU()]
    cin = 32
    for e, c, n, s, k in ((1,16,1,1,3),(6,24,2,2,3),(6,40,2,2,5),(6,80,3,2,3),(6,112,3,1,5),(6,192,4,2,5),(6,320,1,1,3)):
        for i in range(n):
            layers.append(MBConv(cin, c, k, s if i == 0 else 1, e)); cin = c
    layers += [nn.Conv2d(320, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, 1000)]
    return nn.Sequential(*layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="the batch whose BatchNorm calls' routes to take (default 32)")
    args = parser.parse_args()
    # Per image, with each call on the route it takes at --batch images: the size threshold scaled down.
    _tuning.DEVICE_MIN_VALUES //= args.batch
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224)
    for name, make in (("ResNet-50", resnet50), ("EfficientNet-B0", effnet_b0)):
        model = make()
        kept = {}
        for policy in ("off", "fp32", "input"):
            with amp_bn_fix.policy(policy), device_route(), torch.autocast("cpu", dtype=torch.bfloat16):
                kept[policy] = kept_for_backward(model(x)) / 1e6
        print(f"{name}: kept for backward per image, native {kept['off']:.1f} MB, fp32 {kept['fp32']:.1f} MB "
              f"({kept['fp32'] / kept['off']:.2f}x), input {kept['input']:.1f} MB; "
              f"at batch {args.batch}: +{(kept['fp32'] - kept['off']) * args.batch / 1e3:.2f} GB with fp32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
