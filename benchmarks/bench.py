"""Benchmark amp_bn_fix against native autocast and the FP32 batch norm users write by hand.

    python benchmarks/bench.py            # full run: prints a table, writes benchmarks/results/
    python benchmarks/bench.py --quick    # short run for iterating: prints only (unless --out)

Every figure is a ratio of two candidates measured side by side: they alternate sample by sample
(A B, B A, A B, ...), each sample timing a few calls, and the ratio reported is the median of the
per-pair ratios with its interquartile range, so a shared or noisy machine moves both sides
alike. A ratio is A's time over B's: lower is faster for A, 1.00 is a tie. Every timed case runs at
each thread count of the sweep (``--threads``; default 1, 2 and every CPU available, duplicates
dropped); the results record the CPU model, ATen's CPU capability and the load average. The run
prints figures only, and exits non-zero only on an error.

P1 dispatch  small BatchNorm2d forward outside autocast, shim enabled vs disabled, and the
             per-call overhead of the patched ``F.batch_norm`` in microseconds.
P2 input     ``input`` policy forward+backward under autocast vs native autocast BN.
P3 fp32      ``fp32`` policy forward+backward vs ``bn(x.float())`` with autocast off.
bandwidth    the ``fp32`` policy's forward+backward vs a plain copy of as many bytes as its tensors
             hold (16-bit input and input gradient, FP32 output and gradient): its distance to the
             memory limit.
P4 train     a training step of MobileNet-, EfficientNet- and ResNet-18-like models (built from
             torch.nn) under bf16 autocast, ``fp32`` policy vs shim off.
eval         the ResNet-18-like model in inference under bf16 autocast, traced and frozen
             (``torch.jit.freeze``), shim on vs off: the cost of the conv-BN folding the shim's FP32
             BatchNorm prevents.
compile      inductor on a small conv+BN net, ``fp32`` policy vs shim off: a training step, and
             inference with ``torch._inductor.config.freezing`` (the folding again).
P5 start-up  interpreter start with the start-up hook installed and AMP_BN_FIX unset vs the same
             start skipping the hook, and whether the hook imports torch.
memory       memory held from forward to backward and peak growth, per policy and by hand,
             measured by ``memory.py``.
guard        the non-finite guard on vs off; numerics: max error vs an fp64 reference per policy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import amp_bn_fix
from amp_bn_fix import _patch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((32, 64, 56, 56), (32, 256, 14, 14))
QUICK_SHAPES = ((16, 64, 28, 28), (16, 256, 14, 14))
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --- measuring -------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Two candidates measured side by side; times in microseconds per call."""

    a_us: float
    b_us: float
    ratio: float  # median of the per-pair ratios a/b
    ratio_q1: float
    ratio_q3: float
    a_iqr_us: Tuple[float, float]
    b_iqr_us: Tuple[float, float]
    samples: int


def quartiles(values: Sequence[float]) -> Tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return q1, q2, q3


def compare(a: Callable[[], None], b: Callable[[], None], rounds: int, inner: int, sync: Callable[[], None],
            setup_a: Callable[[], None] = lambda: None, setup_b: Callable[[], None] = lambda: None) -> Timing:
    """Time ``a`` against ``b``: ``rounds`` pairs in alternating order, ``inner`` calls per sample.

    ``setup_a``/``setup_b`` run untimed before each of their samples (e.g. enabling the shim).
    """

    def sample(fn: Callable[[], None], setup: Callable[[], None]) -> float:
        setup()
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        return (time.perf_counter() - start) / inner * 1e6

    for fn, setup in ((a, setup_a), (b, setup_b)):  # warm up: allocator, caches, lazy init
        sample(fn, setup)
        sample(fn, setup)
    times_a: List[float] = []
    times_b: List[float] = []
    for i in range(rounds):
        if i % 2:
            times_b.append(sample(b, setup_b))
            times_a.append(sample(a, setup_a))
        else:
            times_a.append(sample(a, setup_a))
            times_b.append(sample(b, setup_b))
    ratios = [x / y for x, y in zip(times_a, times_b)]
    qa, qb, qr = quartiles(times_a), quartiles(times_b), quartiles(ratios)
    return Timing(qa[1], qb[1], qr[1], qr[0], qr[2], (qa[0], qa[2]), (qb[0], qb[2]), rounds)


@contextlib.contextmanager
def shim(enabled: bool, policy: str = "fp32", guard: bool = True) -> Iterator[None]:
    """Run the body with the shim enabled (``policy``, ``guard``) or disabled, then restore."""
    before = _patch.current_config()
    _patch.configure(before.replace(policy=policy, guard=guard))
    try:
        with _patch.installed() if enabled else _patch.uninstalled():
            yield
    finally:
        _patch.configure(before)


def set_shim(enabled: bool, policy: str = "fp32", guard: bool = True) -> None:
    _patch.configure(_patch.current_config().replace(policy=policy, guard=guard))
    (amp_bn_fix.enable if enabled else amp_bn_fix.disable)()


def shim_setup(enabled: bool, policy: str = "fp32", guard: bool = True) -> Callable[[], None]:
    return lambda: set_shim(enabled, policy, guard)


@dataclasses.dataclass
class Row:
    section: str
    name: str
    a: str
    b: str
    timing: Timing
    threads: int
    note: str = ""


class Bench:
    """Holds the settings of one run and the rows measured so far."""

    def __init__(self, device: str, quick: bool):
        self.device = device
        self.quick = quick
        self.rows: List[Row] = []
        self.extra: Dict[str, object] = {}
        self.sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def rounds(self, full: int) -> int:
        return max(5, full // 3) if self.quick else full

    def add(self, section: str, name: str, a: str, b: str, timing: Timing, note: str = "") -> None:
        row = Row(section, name, a, b, timing, torch.get_num_threads(), note)
        self.rows.append(row)
        t = row.timing
        print(f"  {row.threads:>2}t {row.section:<6} {row.name:<40} {fmt_us(t.a_us):>10} {fmt_us(t.b_us):>10}  "
              f"ratio {t.ratio:.3f} [{t.ratio_q1:.3f}, {t.ratio_q3:.3f}]"
              f"{f'  ({row.a} vs {row.b}: {row.note})' if row.note else ''}", flush=True)


def fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.2f} us"


# --- workloads -------------------------------------------------------------------------------


def half_input(shape, dtype, device, channels_last=False, seed=0) -> torch.Tensor:
    """A conv-like half activation (non-zero mean) that requires grad."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def bn_forward(bn: nn.Module, x: torch.Tensor, device: str, dtype: torch.dtype, by_hand: bool = False) -> torch.Tensor:
    """BatchNorm under autocast; ``by_hand``: the FP32 peer users write today."""
    with torch.autocast(device, dtype=dtype):
        if by_hand:
            with torch.autocast(device, enabled=False):
                return bn(x.float())
        return bn(x)


def bn_step(bn: nn.Module, x: torch.Tensor, grad: torch.Tensor, device: str, dtype: torch.dtype,
            by_hand: bool = False, backward: bool = True) -> Callable[[], None]:
    """One BatchNorm forward (+ backward) under autocast; ``by_hand``: the FP32 peer users write."""

    def step() -> None:
        y = bn_forward(bn, x, device, dtype, by_hand)
        if backward:
            y.backward(grad)
            x.grad = bn.weight.grad = bn.bias.grad = None

    if backward:
        return step

    def forward_only() -> None:
        with torch.no_grad():
            step()

    return forward_only


def p1_dispatch(b: Bench) -> None:
    print("P1 dispatch: outside autocast, shim enabled (A) vs disabled (B)")
    bn = nn.BatchNorm2d(16).to(b.device)
    x = torch.randn(8, 16, 8, 8, device=b.device)
    inner = 20 if b.quick else 200
    on, off = shim_setup(True), shim_setup(False)
    for mode in ("train", "eval"):
        bn.train(mode == "train")
        t = compare(lambda: bn(x), lambda: bn(x), b.rounds(41), inner, b.sync, on, off)
        b.add("P1", f"BatchNorm2d(16) fwd (8,16,8,8), {mode}", "shim on", "shim off", t)
    rm, rv = torch.zeros(16, device=b.device), torch.ones(16, device=b.device)
    w, bias = torch.ones(16, device=b.device), torch.zeros(16, device=b.device)

    def call() -> None:
        F.batch_norm(x, rm, rv, w, bias, False, 0.1, 1e-5)

    with torch.no_grad():
        t = compare(call, call, b.rounds(41), inner * 5, b.sync, on, off)
    b.add("P1", "F.batch_norm call, FP32 input, eval", "shim on", "shim off", t,
          note=f"per-call overhead {t.a_us - t.b_us:+.2f} us")
    b.extra.setdefault("p1_overhead_us", {})[torch.get_num_threads()] = t.a_us - t.b_us  # type: ignore[index]
    print(f"         per-call overhead of the patched F.batch_norm: {t.a_us - t.b_us:+.2f} us")


def p2_p3_policies(b: Bench) -> None:
    shapes = QUICK_SHAPES if b.quick else SHAPES
    layouts = [False] if b.quick else [False, True]
    print("P2 input policy (A) vs native autocast BN, shim off (B); forward+backward, training")
    print("P3 fp32 policy (A) vs bn(x.float()) with autocast off, shim off (B)")
    for name, dtype in HALF.items():
        for shape in shapes:
            for cl in layouts:
                if cl and shape != shapes[0]:
                    continue
                label = f"{name} {tuple(shape)}" + (" channels_last" if cl else "")
                bn = nn.BatchNorm2d(shape[1]).to(b.device)
                if cl:
                    bn = bn.to(memory_format=torch.channels_last)
                x = half_input(shape, dtype, b.device, cl)
                g_half = torch.randn_like(x, dtype=dtype)
                g32 = g_half.float()
                inner = 1 if b.device == "cpu" else 10
                rounds = b.rounds(15)
                t = compare(bn_step(bn, x, g_half, b.device, dtype), bn_step(bn, x, g_half, b.device, dtype),
                            rounds, inner, b.sync, shim_setup(True, "input"), shim_setup(False))
                b.add("P2", f"{label} fwd+bwd", "input", "native", t)
                if not cl:
                    t = compare(bn_step(bn, x, g_half, b.device, dtype), bn_step(bn, x, g_half, b.device, dtype),
                                rounds, inner, b.sync, shim_setup(True, "input", guard=False), shim_setup(False))
                    b.add("P2", f"{label} fwd+bwd", "input, no guard", "native", t, note="breakdown: guard off")
                t = compare(bn_step(bn, x, g32, b.device, dtype), bn_step(bn, x, g32, b.device, dtype, by_hand=True),
                            rounds, inner, b.sync, shim_setup(True, "fp32"), shim_setup(False))
                b.add("P3", f"{label} fwd+bwd", "fp32", "by hand", t)
                t = compare(bn_step(bn, x, g32, b.device, dtype, backward=False),
                            bn_step(bn, x, g32, b.device, dtype, by_hand=True, backward=False),
                            rounds, inner, b.sync, shim_setup(True, "fp32"), shim_setup(False))
                b.add("P3", f"{label} fwd only", "fp32", "by hand", t)


def profile_p3(b: Bench) -> None:
    """Where the time of one P3 step goes: the top ops of ours and of the peer."""
    shape = (QUICK_SHAPES if b.quick else SHAPES)[0]
    bn = nn.BatchNorm2d(shape[1]).to(b.device)
    x = half_input(shape, torch.bfloat16, b.device)
    g32 = torch.randn(shape, device=b.device)
    profiles = {}
    for label, enabled, by_hand in (("fp32 policy", True, False), ("by hand", False, True)):
        step = bn_step(bn, x, g32, b.device, torch.bfloat16, by_hand=by_hand)
        with shim(enabled, "fp32"):
            for _ in range(3):
                step()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        profiles[label] = [(e.key, e.self_cpu_time_total / 5 / 1000) for e in events]
        print(f"  profile of one step, {label}, bf16 {tuple(shape)}, {torch.get_num_threads()} threads "
              "(self CPU ms per step):")
        for key, ms in profiles[label]:
            print(f"    {ms:7.2f}  {key}")
    b.extra.setdefault("p3_profile_ms", {"shape": list(shape), "dtype": "bf16", "top_ops": {}})
    b.extra["p3_profile_ms"]["top_ops"][torch.get_num_threads()] = profiles  # type: ignore[index]


def bandwidth(b: Bench) -> None:
    """The ``fp32`` policy's fwd+bwd against a plain copy of as many bytes as its tensors hold.

    The tensors a fwd+bwd must at least read or write once: the 16-bit input and input gradient,
    the FP32 output and incoming gradient (12 bytes per value). A copy of half that many bytes
    reads and writes as many: the machine's streaming limit for this traffic.
    """
    print("bandwidth: fp32 policy fwd+bwd (A) vs a plain copy of the same bytes (B)")
    for shape in (QUICK_SHAPES if b.quick else SHAPES):
        bn = nn.BatchNorm2d(shape[1]).to(b.device)
        x = half_input(shape, torch.bfloat16, b.device)
        g32 = torch.randn(shape, device=b.device)
        moved = 12 * x.numel()
        src = torch.empty(moved // 2, dtype=torch.uint8, device=b.device).fill_(1)
        dst = torch.empty_like(src)
        with shim(True, "fp32"):
            t = compare(bn_step(bn, x, g32, b.device, torch.bfloat16), lambda: dst.copy_(src),
                        b.rounds(15), 1, b.sync)
        gbs = lambda us: moved / us / 1e3  # noqa: E731  bytes per microsecond / 1e3 = GB/s
        b.add("bw", f"bf16 {tuple(shape)} fwd+bwd, {moved / 2**20:.0f} MiB", "fp32", "copy", t,
              note=f"{gbs(t.a_us):.1f} GB/s effective vs {gbs(t.b_us):.1f} GB/s copy")


def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: Optional[nn.Module] = None) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act] if act is not None else []))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions, each followed by a BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, cout, 3, stride, act=nn.ReLU()), conv_bn(cout, cout, 3))
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


def mobilenet_like(classes: int = 10) -> nn.Module:
    """MobileNetV3-Small's layout: depthwise blocks (expansion, kernel, stride, SE), Hardswish, 52 BatchNorms."""
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


def p4_train_step(b: Bench) -> None:
    print("P4 train step under bf16 autocast, SGD: fp32 policy (A) vs shim off (B)")
    batch, size = (4, 64) if b.quick else (8, 96)
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = build().to(b.device)
        count = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, 3, size, size, device=b.device)
        y = torch.randint(0, 10, (batch,), device=b.device)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(b.device, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        # Shim off, each BatchNorm's native 16-bit output cast to FP32: the FP32 activations the
        # ``fp32`` policy hands on, without its own cost.
        cast = [False]
        for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.register_forward_hook(lambda module, args, out: out.float() if cast[0] else None)

        def setup(enabled: bool, policy: str = "fp32", guard: bool = True, cast_output: bool = False):
            def run() -> None:
                set_shim(enabled, policy, guard)
                cast[0] = cast_output
            return run

        label = f"{name} step, ({batch},3,{size},{size}), {count} BN"
        inner = 1 if b.device == "cpu" else 5
        t = compare(step, step, b.rounds(15), inner, b.sync, setup(True), setup(False))
        b.add("P4", label, "fp32", "shim off", t)
        # Where the difference goes: the guard, the FP32 activations (absent with ``input``), and
        # those activations alone.
        for a_setup, a_name, note in (
            (setup(True, "fp32", False), "fp32, no guard", "breakdown: guard off"),
            (setup(True, "input"), "input", "breakdown: 16-bit output"),
            (setup(False, cast_output=True), "native BN, output cast to FP32", "breakdown: FP32 activations alone"),
        ):
            t = compare(step, step, b.rounds(9), inner, b.sync, a_setup, setup(False))
            b.add("P4", label, a_name, "shim off", t, note=note)
        cast[0] = False


def small_net() -> nn.Module:
    """Three conv+BN+ReLU blocks and a classifier: quick to compile on a small machine."""
    return nn.Sequential(conv_bn(3, 32, 3, 2, act=nn.ReLU()), conv_bn(32, 64, 3, 2, act=nn.ReLU()),
                         conv_bn(64, 64, 3, act=nn.ReLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def eval_frozen_jit(b: Bench) -> None:
    """ResNet-18-like inference under bf16 autocast, traced and frozen with the shim on and off.

    ``torch.jit.freeze`` folds each BatchNorm into the convolution before it when the BatchNorm
    runs natively (shim off); the shim's FP32 BatchNorm (``x.float()`` and the FP32 kernel in a
    trace) is no such pattern, so it stays. Both traces are fixed graphs: they run side by side.
    """
    print("eval: ResNet-18-like inference under bf16 autocast, jit.freeze of a trace, shim on (A) vs off (B)")
    torch.manual_seed(0)
    model = resnet18_like().eval().to(b.device)
    x = torch.randn(8, 3, 96, 96, device=b.device)
    frozen = {}
    for enabled in (True, False):
        with shim(enabled, "fp32"), torch.no_grad(), torch.autocast(b.device, dtype=torch.bfloat16):
            frozen[enabled] = torch.jit.freeze(torch.jit.trace(model, x, check_trace=False))
    kept = str(frozen[True].graph).count("aten::batch_norm"), str(frozen[False].graph).count("aten::batch_norm")

    def run(module: torch.jit.ScriptModule) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad(), torch.autocast(b.device, dtype=torch.bfloat16):
                module(x)
        return call

    t = compare(run(frozen[True]), run(frozen[False]), b.rounds(15), 1, b.sync)
    b.add("eval", "ResNet-18-like (8,3,96,96), jit.freeze", "shim on", "shim off", t,
          note=f"BatchNorms left in the frozen graph: {kept[0]} vs {kept[1]}")


# The compiled cases run one process per candidate: changing the shim's settings resets
# torch.compile (see ``_patch._settings_changed``), so both cannot stay compiled in one process.
COMPILED_STEPS = 30


def compiled_worker(kind: str, policy: str, steps: int) -> List[float]:
    """Compile ``small_net`` (``kind``: a training step, or frozen inference) and time ``steps`` calls (us)."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    set_shim(policy != "off", policy if policy != "off" else "fp32")
    model = small_net()
    x = torch.randn(16, 3, 64, 64)
    if kind == "train":
        y = torch.randint(0, 10, (16,))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def loss_of(inp: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.cross_entropy(model(inp), y)

        compiled = torch.compile(loss_of)

        def call() -> None:
            opt.zero_grad(set_to_none=True)
            compiled(x).backward()
            opt.step()
    else:
        inductor_config.freezing = True
        model.eval()
        compiled = torch.compile(model)

        def call() -> None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                compiled(x)

    for _ in range(3):  # compiles, then warms up
        call()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def compiled_rows(b: Bench) -> None:
    """Inductor, a training step and frozen inference of ``small_net``: ``fp32`` policy vs shim off."""
    if b.device != "cpu":
        return
    print("compile: inductor, small conv+BN net (16,3,64,64), bf16 autocast; fp32 policy (A) vs shim off (B), "
          "one process per sample")
    pairs = 1 if b.quick else 3
    for kind, label in (("train", "training step"), ("eval", "inference, freezing=True")):
        def sample(policy: str) -> float:
            cmd = [sys.executable, __file__, "--compiled-worker", kind, policy,
                   "--threads", str(torch.get_num_threads())]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            return statistics.median(json.loads(out.splitlines()[-1]))

        times_a: List[float] = []
        times_b: List[float] = []
        order = (("fp32", times_a), ("off", times_b))
        for i in range(pairs):
            for policy, times in order if i % 2 == 0 else order[::-1]:
                times.append(sample(policy))
        ratios = [x / y for x, y in zip(times_a, times_b)]
        qa, qb, qr = quartiles(times_a), quartiles(times_b), quartiles(ratios)
        t = Timing(qa[1], qb[1], qr[1], qr[0], qr[2], (qa[0], qa[2]), (qb[0], qb[2]), pairs)
        b.add("compile", f"small net, {label}", "fp32", "shim off", t,
              note=f"median of {COMPILED_STEPS} calls per process")


def memory_rows(b: Bench) -> None:
    """Held and peak memory of one training BatchNorm2d fwd+bwd, per policy and by hand (``memory.py``)."""
    if b.device != "cpu" or not Path("/proc/self/clear_refs").exists():
        return
    import memory

    shape = [16, 64, 28, 28] if b.quick else [32, 64, 56, 56]
    results = memory.measure_all(shape, "bfloat16")
    native = results["native"]
    print(f"memory: BatchNorm2d fwd+bwd, training, bf16 {tuple(shape)}; MiB, and the ratio to native autocast")
    for variant, r in results.items():
        r["held_ratio"], r["peak_ratio"] = r["held"] / native["held"], r["peak"] / native["peak"]
        print(f"  {memory.LABELS[variant]:<30} {r['out_dtype']:>8}  held {r['held']:6.1f} ({r['held_ratio']:.2f}x)"
              f"  peak growth {r['peak']:6.1f} ({r['peak_ratio']:.2f}x)")
    b.extra["memory"] = {"shape": shape, "dtype": "bfloat16", "variants": results}


def guard_cost(b: Bench) -> None:
    print("guard: fp32 policy, guard on (A) vs off (B)")
    cases = [((8, 16, 8, 8), 50 if not b.quick else 10), ((QUICK_SHAPES if b.quick else SHAPES)[1], 1)]
    for shape, inner in cases:
        bn = nn.BatchNorm2d(shape[1]).to(b.device)
        x = half_input(shape, torch.bfloat16, b.device)
        g32 = torch.randn(shape, device=b.device)
        step = bn_step(bn, x, g32, b.device, torch.bfloat16)
        t = compare(step, step, b.rounds(21), inner, b.sync, shim_setup(True, guard=True), shim_setup(True, guard=False))
        b.add("guard", f"bf16 {tuple(shape)} fwd+bwd", "guard on", "guard off", t,
              note=f"{t.a_us - t.b_us:+.1f} us per call")


# --- start-up --------------------------------------------------------------------------------

_START = "import site; f = site.addpackage; site.addpackage = {}; site.main()"
_WITH_HOOK = _START.format("lambda d, n, k: f(d, n, k)")
_WITHOUT_HOOK = _START.format("lambda d, n, k: k if n == 'amp_bn_fix.pth' else f(d, n, k)")


def find_hook() -> Optional[Path]:
    import site

    dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    for d in dirs:
        if (Path(d) / "amp_bn_fix.pth").is_file():
            return Path(d) / "amp_bn_fix.pth"
    return None


def p5_startup(b: Bench) -> None:
    print("P5 start-up: interpreter with the hook, AMP_BN_FIX unset (A) vs skipping the hook (B)")
    if find_hook() is None:
        print("  hook not installed (no amp_bn_fix.pth in site-packages): skipped")
        b.extra["p5"] = "hook not installed"
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMP_BN_FIX")}

    def start(code: str) -> Callable[[], None]:
        cmd = [sys.executable, "-S", "-c", code]
        return lambda: subprocess.run(cmd, env=env, check=True)

    t = compare(start(_WITH_HOOK), start(_WITHOUT_HOOK), b.rounds(101), 1, lambda: None)
    b.add("P5", "python -S + site.main()", "hook", "no hook", t)
    probe = "import sys; print('torch' in sys.modules, 'wrapt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "AMP_BN_FIX": "1"},
                         check=True, capture_output=True, text=True).stdout.split()
    b.extra["p5_after_startup_with_AMP_BN_FIX_1"] = {"torch_imported": out[0] == "True", "wrapt_imported": out[1] == "True"}
    print(f"  after start-up with AMP_BN_FIX=1: torch imported: {out[0]}, wrapt imported: {out[1]}")


# --- numerics --------------------------------------------------------------------------------


def numerics(b: Bench) -> None:
    """Max abs and relative error vs fp64 of output, running var and the three gradients."""
    print("numerics: max |error| vs an fp64 reference (relative: to the largest reference value)")
    shape = (16, 64, 28, 28) if b.quick else (32, 64, 56, 56)
    variants = [("shim fp32", True, "fp32", False), ("shim input", True, "input", False),
                ("shim autocast", True, "autocast", False), ("native autocast", False, "fp32", False),
                ("by hand (x.float())", False, "fp32", True)]
    table = {}
    for name, dtype in HALF.items():
        g = torch.Generator().manual_seed(5)
        x0 = (torch.randn(shape, generator=g) * 2 + 3).to(dtype)
        grad_half = torch.randn(shape, generator=g).to(dtype)
        ref = run_bn(x0.double(), grad_half.double(), b.device, None, by_hand=False)
        for label, enabled, policy, by_hand in variants:
            with shim(enabled, policy):
                got = run_bn(x0, grad_half, b.device, dtype, by_hand)
            errs = {}
            for key in ref:
                r, v = ref[key], got[key].double().cpu()
                err = (v - r).abs().max().item()
                errs[key] = {"abs": err, "rel": err / r.abs().max().item(), "dtype": str(got[key].dtype)[6:]}
            table[f"{name} {label}"] = errs
            print(f"  {name} {label:<20} out {errs['out']['dtype']:<8} "
                  + "  ".join(f"{k} {e['rel']:.1e}" for k, e in errs.items()))
    b.extra["numerics"] = {"shape": list(shape), "errors": table}


def run_bn(x0: torch.Tensor, grad: torch.Tensor, device: str, dtype: Optional[torch.dtype], by_hand: bool):
    torch.manual_seed(1)
    bn = nn.BatchNorm2d(x0.shape[1]).to(device)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    if dtype is None:
        bn = bn.double()
    x = x0.to(device, copy=True).requires_grad_()
    y = bn(x) if dtype is None else bn_forward(bn, x, device, dtype, by_hand)
    y.backward(grad.to(device=device, dtype=y.dtype))
    return {"out": y.detach(), "running_var": bn.running_var, "grad_x": x.grad,
            "grad_w": bn.weight.grad, "grad_b": bn.bias.grad}


# --- report ----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str, threads: Sequence[int]) -> Dict[str, object]:
    info: Dict[str, object] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": available_cpus(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": ", ".join(map(str, threads)),
        "load_average_at_end": ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        "os": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "amp_bn_fix": amp_bn_fix.__version__,
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def markdown(b: Bench, info: Dict[str, object], threads: Sequence[int], load_before: str) -> str:
    lines = [f"# amp_bn_fix benchmark ({b.device}{', quick' if b.quick else ''})", ""]
    lines += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in info.items()]
    lines += [f"| load_average_at_start | {load_before} |", ""]
    lines += ["Ratio A/B: A's time over B's, lower is faster for A (1.00: a tie); the median of paired "
              "ratios, [interquartile range]; times (A / B) are medians. One column per torch thread count.", ""]
    lines += ["| | case | A | B | " + " | ".join(f"{n} thread{'s' if n > 1 else ''}" for n in threads) + " |",
              "|---|---|---|---|" + "---|" * len(threads)]
    cells: Dict[Tuple[str, str, str, str], Dict[int, Row]] = {}
    for r in b.rows:
        cells.setdefault((r.section, r.name, r.a, r.b), {})[r.threads] = r
    for (section, name, a, b_name), by_threads in cells.items():
        distinct = {r.note for r in by_threads.values() if r.note}
        notes = distinct.pop() if len(distinct) == 1 else "; ".join(
            f"{n}t: {r.note}" for n, r in by_threads.items() if r.note)
        row = [section, name + (f" ({notes})" if notes else ""), a, b_name]
        for n in threads:
            r = by_threads.get(n)
            t = r.timing if r else None
            row.append("" if t is None else f"{t.ratio:.3f} [{t.ratio_q1:.3f}, {t.ratio_q3:.3f}] "
                       f"({fmt_us(t.a_us)} / {fmt_us(t.b_us)})")
        lines.append("| " + " | ".join(row) + " |")
    if "p5" in b.extra:
        lines += ["", f"P5: {b.extra['p5']}"]
    if "p5_after_startup_with_AMP_BN_FIX_1" in b.extra:
        lines += ["", f"After start-up with AMP_BN_FIX=1: {b.extra['p5_after_startup_with_AMP_BN_FIX_1']}"]
    if "memory" in b.extra:
        mem = b.extra["memory"]
        lines += ["", f"## Memory: BatchNorm2d fwd+bwd, training, {mem['dtype']} {tuple(mem['shape'])} (MiB; ratio to native autocast)",
                  "", "held: allocated by forward and kept until backward; peak: growth of the peak resident size over "
                  "forward and backward", "",
                  "| variant | output | held | peak growth |", "|---|---|---|---|"]
        for variant, r in mem["variants"].items():
            lines.append(f"| {variant} | {r['out_dtype']} | {r['held']:.1f} ({r['held_ratio']:.2f}x) | "
                         f"{r['peak']:.1f} ({r['peak_ratio']:.2f}x) |")
    if "numerics" in b.extra:
        num = b.extra["numerics"]
        lines += ["", f"## Numerics: max error relative to the largest fp64 value, shape {tuple(num['shape'])}", "",
                  "| variant | out dtype | out | running_var | grad_x | grad_w | grad_b |", "|---|---|---|---|---|---|---|"]
        for name, errs in num["errors"].items():
            lines.append(f"| {name} | {errs['out']['dtype']} | "
                         + " | ".join(f"{errs[k]['rel']:.1e}" for k in ("out", "running_var", "grad_x", "grad_w", "grad_b"))
                         + " |")
    if "p3_profile_ms" in b.extra:
        prof = b.extra["p3_profile_ms"]
        lines += ["", f"## Where a P3 step goes (bf16 {tuple(prof['shape'])}, self CPU ms per step)", ""]
        for n, profiles in prof["top_ops"].items():
            for label, ops in profiles.items():
                lines += [f"{n} thread{'s' if n > 1 else ''}, {label}: " + ", ".join(f"{k} {ms:.2f}" for k, ms in ops), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_sweep(requested: Optional[Sequence[int]]) -> List[int]:
    """The torch thread counts to run: ``requested``, or 1, 2 and every CPU available (no duplicates)."""
    counts = requested or [n for n in (1, 2, available_cpus()) if n <= available_cpus()]
    return sorted(set(counts))


def run_device(device: str, args: argparse.Namespace, threads: Sequence[int]) -> Bench:
    b = Bench(device, args.quick)
    print(f"== {device} ({'quick' if args.quick else 'full'}), {cpu_model()}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, torch threads {', '.join(map(str, threads))}; "
          f"load average {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"  {'':<10} {'case':<40} {'A':>10} {'B':>10}")
    with shim(True):
        for n in threads:
            torch.set_num_threads(n)
            print(f"-- {n} torch thread{'s' if n > 1 else ''}")
            p1_dispatch(b)
            p2_p3_policies(b)
            if device == "cpu":
                profile_p3(b)
            bandwidth(b)
            p4_train_step(b)
            eval_frozen_jit(b)
            compiled_rows(b)
            guard_cost(b)
        torch.set_num_threads(threads[-1])
        memory_rows(b)
        if device == "cpu":
            p5_startup(b)
        numerics(b)
    return b


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller shapes; writes no files unless --out")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch thread counts to run (default: 1, 2 and all CPUs available)")
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="cpu, cuda, or all (cpu, then cuda when available)")
    parser.add_argument("--out", type=Path, default=None, help=f"where to write results (default: {RESULTS} for full runs)")
    parser.add_argument("--compiled-worker", nargs=2, metavar=("KIND", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    threads = thread_sweep(args.threads)
    if args.compiled_worker:
        torch.set_num_threads(threads[0])
        print(json.dumps(compiled_worker(*args.compiled_worker, COMPILED_STEPS)))
        return 0
    load_before = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        if args.device == "cuda":
            parser.error("--device cuda: no CUDA device is available")
        devices.remove("cuda")
    out_dir = args.out or (None if args.quick else RESULTS)
    for device in devices:
        b = run_device(device, args, threads)
        if out_dir is None:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        info = machine(device, threads)
        stem = device + ("-quick" if args.quick else "")
        payload = {"machine": {**info, "load_average_at_start": load_before}, "quick": args.quick,
                   "rows": [dataclasses.asdict(r) for r in b.rows], **b.extra}
        (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out_dir / f"{stem}.md").write_text(markdown(b, info, threads, load_before))
        print(f"wrote {out_dir / (stem + '.json')} and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
