"""The CUDA rows: per-BatchNorm cost per policy, a ResNet-50 step, bandwidth and peak memory.

Timed with CUDA events (medians of interleaved pairs). Run on CPU (``--device cpu --only 'cuda-*'``)
they are a dry run: tiny shapes, the host timer, no device memory figures; the figures mean
nothing, but every line of the code runs, so that it is known to work before a GPU is at hand.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from _harness import OFF, ON, Bench, settings, shim
from _large_rows import bandwidth_rows
from _models import HALF, bn_step, count_bn, grads_like, half_input, resnet50_like, train_step
from _traffic import BY_HAND, NATIVE, count_call, count_step

CUDA_SHAPES = ((32, 64, 56, 56), (256, 64, 56, 56), (32, 256, 14, 14))
DRY_SHAPES = ((2, 8, 6, 6), (4, 8, 6, 6), (2, 16, 3, 3))
POLICIES = ("fp32", "input", "autocast")
LAYOUTS = (("NCHW", False), ("channels_last", True))


# A dry run proves a ResNet row's plumbing with the default policy alone.
DRY_POLICIES = ("fp32",)


def dry(b: Bench) -> bool:
    return b.device != "cuda"


def cuda_shapes(b: Bench) -> Sequence[Tuple[int, ...]]:
    return DRY_SHAPES if dry(b) else CUDA_SHAPES


def announce(b: Bench, what: str) -> None:
    print(f"[{b.current}] {what}" + (f" -- dry run on {b.device}: tiny shapes, the host timer; the figures mean nothing"
                                     if dry(b) else ""))


def bn(b: Bench) -> None:
    """One BatchNorm2d forward+backward, training, under autocast: each policy against native (shim
    off), and ``fp32`` against BatchNorm written by hand in FP32; each beside what the count predicts."""
    announce(b, "per-BatchNorm fwd+bwd under autocast, each policy (A) vs native, shim off (B), and fp32 vs "
                "bn(x.float()) by hand; CUDA events; the count's prediction (bytes moved) beside each")
    calls = 1 if dry(b) else 10
    for dtype_name, dtype in HALF.items():
        for shape in cuda_shapes(b):
            for layout, channels_last in LAYOUTS:
                module = nn.BatchNorm2d(shape[1]).to(b.device)
                x = half_input(shape, dtype, b.device, channels_last)
                grads = grads_like(x)
                step = bn_step(module, x, grads, b.device, dtype)
                counted = {p: count_call(shape, dtype, p, "fwdbwd", device=b.device, channels_last=channels_last).moved
                           for p in (NATIVE, BY_HAND, *POLICIES)}
                label = f"{dtype_name} {tuple(shape)} {layout} fwd+bwd"
                for policy in POLICIES:
                    with settings(policy=policy, guard=True):
                        t = b.compare(step, step, 15, calls, ON, OFF)
                    b.add("cuda-bn", label, policy, "native", t,
                          note=f"count predicts {counted[policy] / counted[NATIVE]:.2f}")
                by_hand = bn_step(module, x, grads, b.device, dtype, by_hand=True)
                with settings(policy="fp32", guard=True):
                    t = b.compare(step, by_hand, 15, calls, ON, OFF)
                b.add("cuda-bn", label, "fp32", "by hand", t,
                      note=f"count predicts {counted['fp32'] / counted[BY_HAND]:.2f}")


def _resnet50(b: Bench, channels_last: bool) -> Tuple[nn.Module, Callable[[], None], str]:
    torch.manual_seed(0)
    batch, size = (2, 16) if dry(b) else (32, 224)
    # The dry run keeps ResNet-50's blocks but one per stage: the code is the same, the time a fraction.
    model = resnet50_like(blocks=(1, 1, 1, 1) if dry(b) else (3, 4, 6, 3)).to(b.device)
    x = torch.randn(batch, 3, size, size, device=b.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=b.device)
    label = f"ResNet-50{'-shaped (1 block per stage)' if dry(b) else ''} SGD step ({batch},3,{size},{size}), " \
            f"{count_bn(model)} BN, {'channels_last' if channels_last else 'NCHW'}"
    return model, train_step(model, x, y, b.device), label


def resnet50(b: Bench) -> None:
    """A ResNet-50 training step (bf16 autocast, SGD): the shim's default settings and ``input`` vs native."""
    announce(b, "ResNet-50 training step, bf16 autocast: shim (A) vs native, shim off (B); CUDA events")
    calls = 1 if dry(b) else 3
    # A dry run proves the row's plumbing: one layout does.
    for _, channels_last in LAYOUTS[:1] if dry(b) else LAYOUTS:
        _, step, label = _resnet50(b, channels_last)
        with shim(False):
            native_bytes, native_launches = count_step(step)
        for policy in DRY_POLICIES if dry(b) else ("fp32", "input"):
            with shim(True, policy=policy, guard=True):
                moved, launches = count_step(step)
            with settings(policy=policy, guard=True):
                t = b.compare(step, step, 9, calls, ON, OFF)
            b.add("cuda-resnet50", label, policy, "native", t,
                  note=f"count predicts {moved / native_bytes:.2f} ({launches - native_launches:+d} launches)")


def bandwidth(b: Bench) -> None:
    announce(b, "fp32 policy fwd+bwd (A) vs a device copy of the same bytes (B)")
    bandwidth_rows(b, cuda_shapes(b), section="cuda-bandwidth")


def peak_mib(b: Bench, fn: Callable[[], None]) -> Optional[float]:
    """How far one call of ``fn`` raises the allocated device memory above what was allocated before (MiB)."""
    fn()  # workspaces, lazy initialisation: not the call's own memory
    if dry(b):
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def memory(b: Bench) -> None:
    """Peak device memory (``torch.cuda.max_memory_allocated``) of the shim against native."""
    announce(b, "peak device memory of one call, shim (A) vs native (B): growth over what was allocated before, MiB")
    for shape in cuda_shapes(b):
        module = nn.BatchNorm2d(shape[1]).to(b.device)
        x = half_input(shape, torch.bfloat16, b.device)
        step = bn_step(module, x, grads_like(x), b.device, torch.bfloat16)
        with shim(False):
            native = peak_mib(b, step)
        for policy in POLICIES:
            with shim(True, policy=policy, guard=True):
                peak = peak_mib(b, step)
            b.add_figure("cuda-memory", f"bf16 {tuple(shape)} BatchNorm2d fwd+bwd, peak growth", policy, "native",
                         peak, native, "MiB", note="" if peak is not None else "no device memory on a dry run")
    _, step, label = _resnet50(b, channels_last=False)
    with shim(False):
        native = peak_mib(b, step)
    for policy in DRY_POLICIES if dry(b) else ("fp32", "input"):
        with shim(True, policy=policy, guard=True):
            peak = peak_mib(b, step)
        b.add_figure("cuda-memory", f"{label}, peak growth", policy, "native", peak, native, "MiB")

