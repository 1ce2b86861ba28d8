"""Prototype, not shipped: the ``fp32`` policy's training BatchNorm as two inductor-compiled kernels.

    python benchmarks/fused_prototype.py          # needs a C++ compiler (inductor's CPU backend)

P3 asks for the ``fp32`` policy at <= 0.6 of ``bn(x.float())``. Eager ATen ops cannot get there on
CPU: both are memory-bound, and every op that mixes a 16-bit and an FP32 tensor first copies the
16-bit one to FP32. Two fused kernels can: a forward that reads the 16-bit input once for the
statistics and once to write the FP32 output, and a backward that reads the 16-bit input and the
FP32 gradient and writes the 16-bit input gradient directly. This script builds them with
``torch.compile`` (dynamic shapes, so one compilation per dtype and rank), checks them against
float64 and times them side by side with ``bn(x.float())``, one torch thread. What shipping it would
take is in benchmarks/README.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import compare, shim  # noqa: E402
from _large_rows import SHAPES  # noqa: E402
from _models import bn_step, half_input  # noqa: E402

EPS = 1e-5


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    xf = x.float()
    var, mean = torch.var_mean(xf, dim=(0, 2, 3), correction=0)
    invstd = torch.rsqrt(var + EPS)
    out = (xf - mean[:, None, None]) * (invstd * weight)[:, None, None] + bias[:, None, None]
    return out, mean, invstd


def _backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor):
    count = grad.numel() // grad.shape[1]
    xhat = (x.float() - mean[:, None, None]) * invstd[:, None, None]
    grad_bias = grad.sum((0, 2, 3))
    grad_weight = (grad * xhat).sum((0, 2, 3))
    scale = (weight * invstd)[:, None, None]
    grad_input = scale * (grad - (grad_bias / count)[:, None, None] - xhat * (grad_weight / count)[:, None, None])
    return grad_input.to(x.dtype), grad_weight, grad_bias


forward_kernel = torch.compile(_forward, dynamic=True)
backward_kernel = torch.compile(_backward, dynamic=True)


class FusedBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        out, mean, invstd = forward_kernel(x, weight, bias)
        ctx.save_for_backward(x, weight, mean, invstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        return backward_kernel(grad.contiguous(), *ctx.saved_tensors)


def relative_errors(shape) -> dict:
    """Max error relative to the largest float64 value: output, input and weight gradients."""
    generator = torch.Generator().manual_seed(0)
    x = half_input(shape, torch.bfloat16, "cpu").detach()
    grad = torch.randn(shape, generator=generator)
    weight, bias = torch.rand(shape[1], generator=generator) + 0.5, torch.randn(shape[1], generator=generator)
    leaves64 = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = F.batch_norm(leaves64[0], None, None, leaves64[1], leaves64[2], True, eps=EPS)
    ref.backward(grad.double())
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = FusedBatchNorm.apply(*leaves)
    out.backward(grad)

    def rel(a: torch.Tensor, r: torch.Tensor) -> float:
        return ((a.double() - r).abs().max() / r.abs().max()).item()

    return {"out": rel(out, ref), "grad_x": rel(leaves[0].grad, leaves64[0].grad),
            "grad_w": rel(leaves[1].grad, leaves64[1].grad)}


def main() -> int:
    torch.set_num_threads(1)
    for shape in SHAPES:
        bn = nn.BatchNorm2d(shape[1])
        x = half_input(shape, torch.bfloat16, "cpu")
        grad = torch.randn(shape)

        def fused() -> None:
            FusedBatchNorm.apply(x, bn.weight, bn.bias).backward(grad)
            x.grad = bn.weight.grad = bn.bias.grad = None

        start = time.perf_counter()
        fused()
        compiled_s = time.perf_counter() - start
        errors = relative_errors(shape)
        with shim(False):
            t = compare(fused, bn_step(bn, x, {torch.float32: grad}, "cpu", torch.bfloat16, by_hand=True), 15, 1)
        print(f"bf16 {shape} fwd+bwd: fused {t.a_us / 1000:.2f} ms, bn(x.float()) {t.b_us / 1000:.2f} ms, "
              f"ratio {t.ratio:.3f} [{t.ratio_q1:.3f}, {t.ratio_q3:.3f}]; first call (compiling) {compiled_s:.1f} s; "
              + ", ".join(f"{k} error {v:.1e}" for k, v in errors.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
