"""Benchmark amp_bn_fix against native autocast and the FP32 batch norm users write by hand.

    python benchmarks/bench.py            # full run: prints a table, writes benchmarks/results/
    python benchmarks/bench.py --quick    # short run for iterating: prints only (unless --out)

Every figure is a ratio of two candidates measured side by side: they alternate sample by sample
(A B, B A, A B, ...), each sample timing a few calls, and the ratio reported is the median of the
per-pair ratios with its interquartile range, so a shared or noisy machine moves both sides
alike. Torch threads are pinned (``--threads``, recorded). The run exits non-zero only on an
error, never on a missed target.

P1 dispatch  small BatchNorm2d forward outside autocast, shim enabled vs disabled (target <= 1.05),
             and the per-call overhead of the patched ``F.batch_norm`` in microseconds.
P2 input     ``input`` policy forward+backward under autocast vs native autocast BN (<= 1.10).
P3 fp32      ``fp32`` policy forward+backward vs ``bn(x.float())`` with autocast off (<= 0.6).
P4 train     a training step of MobileNet-, EfficientNet- and ResNet-18-like models (built from
             torch.nn) under bf16 autocast, ``fp32`` policy vs shim off (<= 1.15).
P5 start-up  interpreter start with the start-up hook installed and AMP_BN_FIX unset vs the same
             start skipping the hook (<= 1.02), and whether the hook imports torch.
memory       memory held from forward to backward and peak growth, per policy and by hand (fp32
             policy's peak <= 2x native autocast's), measured by ``memory.py``.
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
    before, was_enabled = _patch.current_config(), amp_bn_fix.is_enabled()
    set_shim(enabled, policy, guard)
    try:
        yield
    finally:
        _patch.configure(before)
        (amp_bn_fix.enable if was_enabled else amp_bn_fix.disable)()


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
    target: Optional[float] = None  # the ratio must be <= target
    note: str = ""

    @property
    def met(self) -> Optional[bool]:
        return None if self.target is None else self.timing.ratio <= self.target


class Bench:
    """Holds the settings of one run and the rows measured so far."""

    def __init__(self, device: str, quick: bool, threads: int):
        self.device = device
        self.quick = quick
        self.threads = threads
        self.rows: List[Row] = []
        self.extra: Dict[str, object] = {}
        self.sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def rounds(self, full: int) -> int:
        return max(5, full // 3) if self.quick else full

    def add(self, row: Row) -> None:
        self.rows.append(row)
        t = row.timing
        verdict = "" if row.met is None else ("  met" if row.met else "  MISSED")
        target = "" if row.target is None else f" (target <= {row.target:.2f})"
        print(f"  {row.section:<6} {row.name:<40} {fmt_us(t.a_us):>10} {fmt_us(t.b_us):>10}  "
              f"ratio {t.ratio:.3f} [{t.ratio_q1:.3f}, {t.ratio_q3:.3f}]{target}{verdict}"
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
        b.add(Row("P1", f"BatchNorm2d(16) fwd (8,16,8,8), {mode}", "shim on", "shim off", t, 1.05))
    rm, rv = torch.zeros(16, device=b.device), torch.ones(16, device=b.device)
    w, bias = torch.ones(16, device=b.device), torch.zeros(16, device=b.device)

    def call() -> None:
        F.batch_norm(x, rm, rv, w, bias, False, 0.1, 1e-5)

    with torch.no_grad():
        t = compare(call, call, b.rounds(41), inner * 5, b.sync, on, off)
    b.add(Row("P1", "F.batch_norm call, FP32 input, eval", "shim on", "shim off", t,
              note=f"per-call overhead {t.a_us - t.b_us:+.2f} us"))
    b.extra["p1_overhead_us"] = t.a_us - t.b_us
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
                # The targets are for the NCHW activations of the issue; channels_last is extra.
                p2_target, p3_target, note = (None, None, "channels_last: no target") if cl else (1.10, 0.6, "")
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
                b.add(Row("P2", f"{label} fwd+bwd", "input", "native", t, p2_target, note))
                t = compare(bn_step(bn, x, g32, b.device, dtype), bn_step(bn, x, g32, b.device, dtype, by_hand=True),
                            rounds, inner, b.sync, shim_setup(True, "fp32"), shim_setup(False))
                b.add(Row("P3", f"{label} fwd+bwd", "fp32", "by hand", t, p3_target, note))
                t = compare(bn_step(bn, x, g32, b.device, dtype, backward=False),
                            bn_step(bn, x, g32, b.device, dtype, by_hand=True, backward=False),
                            rounds, inner, b.sync, shim_setup(True, "fp32"), shim_setup(False))
                b.add(Row("P3", f"{label} fwd only", "fp32", "by hand", t, note="forward alone (no target)"))


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
        print(f"  profile of one step, {label}, bf16 {tuple(shape)} (self CPU ms per step):")
        for key, ms in profiles[label]:
            print(f"    {ms:7.2f}  {key}")
    b.extra["p3_profile_ms"] = {"shape": list(shape), "dtype": "bf16", "top_ops": profiles}


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
        b.add(Row("P4", label, "fp32", "shim off", t, 1.15))
        # Where the difference goes: the guard, the FP32 activations (absent with ``input``), and
        # those activations alone.
        for a_setup, a_name, note in (
            (setup(True, "fp32", False), "fp32, no guard", "breakdown: guard off"),
            (setup(True, "input"), "input", "breakdown: 16-bit output"),
            (setup(False, cast_output=True), "native BN, output cast to FP32", "breakdown: FP32 activations alone"),
        ):
            t = compare(step, step, b.rounds(9), inner, b.sync, a_setup, setup(False))
            b.add(Row("P4", label, a_name, "shim off", t, note=note))
        cast[0] = False


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
    b.extra["memory"] = {"shape": shape, "dtype": "bfloat16", "target_peak_ratio_fp32": 2.0, "variants": results}


def guard_cost(b: Bench) -> None:
    print("guard: fp32 policy, guard on (A) vs off (B)")
    cases = [((8, 16, 8, 8), 50 if not b.quick else 10), ((QUICK_SHAPES if b.quick else SHAPES)[1], 1)]
    for shape, inner in cases:
        bn = nn.BatchNorm2d(shape[1]).to(b.device)
        x = half_input(shape, torch.bfloat16, b.device)
        g32 = torch.randn(shape, device=b.device)
        step = bn_step(bn, x, g32, b.device, torch.bfloat16)
        t = compare(step, step, b.rounds(21), inner, b.sync, shim_setup(True, guard=True), shim_setup(True, guard=False))
        b.add(Row("guard", f"bf16 {tuple(shape)} fwd+bwd", "guard on", "guard off", t,
                  note=f"{t.a_us - t.b_us:+.1f} us per call"))


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
    b.add(Row("P5", "python -S + site.main()", "hook", "no hook", t, 1.02))
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


def machine(device: str, threads: int) -> Dict[str, object]:
    info: Dict[str, object] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": threads,
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


def markdown(b: Bench, info: Dict[str, object]) -> str:
    lines = [f"# amp_bn_fix benchmark ({b.device}{', quick' if b.quick else ''})", ""]
    lines += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in info.items()] + [""]
    lines += ["Ratio: median of paired A/B ratios, [interquartile range]; times are medians.", "",
              "| | case | A | B | A time | B time | ratio A/B | target | |", "|---|---|---|---|---|---|---|---|---|"]
    for r in b.rows:
        t = r.timing
        verdict = "" if r.met is None else ("met" if r.met else "**missed**")
        target = "" if r.target is None else f"<= {r.target:.2f}"
        case = r.name + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.section} | {case} | {r.a} | {r.b} | {fmt_us(t.a_us)} | {fmt_us(t.b_us)} | "
                     f"{t.ratio:.3f} [{t.ratio_q1:.3f}, {t.ratio_q3:.3f}] | {target} | {verdict} |")
    if "p5" in b.extra:
        lines += ["", f"P5: {b.extra['p5']}"]
    if "p5_after_startup_with_AMP_BN_FIX_1" in b.extra:
        lines += ["", f"After start-up with AMP_BN_FIX=1: {b.extra['p5_after_startup_with_AMP_BN_FIX_1']}"]
    if "memory" in b.extra:
        mem = b.extra["memory"]
        lines += ["", f"## Memory: BatchNorm2d fwd+bwd, training, {mem['dtype']} {tuple(mem['shape'])} (MiB; ratio to native autocast)",
                  "", "held: allocated by forward and kept until backward; peak: growth of the peak resident size over "
                  "forward and backward (target for the fp32 policy: <= 2x native)", "",
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
        for label, ops in prof["top_ops"].items():
            lines += [f"{label}: " + ", ".join(f"{k} {ms:.2f}" for k, ms in ops)]
    return "\n".join(lines) + "\n"


def run_device(device: str, args: argparse.Namespace, threads: int) -> Bench:
    b = Bench(device, args.quick, threads)
    print(f"== {device} ({'quick' if args.quick else 'full'}), torch threads {threads}")
    print(f"  {'':<6} {'case':<40} {'A':>10} {'B':>10}")
    with shim(True):
        p1_dispatch(b)
        p2_p3_policies(b)
        if device == "cpu":
            profile_p3(b)
        p4_train_step(b)
        memory_rows(b)
        guard_cost(b)
        if device == "cpu":
            p5_startup(b)
        numerics(b)
    return b


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller shapes; writes no files unless --out")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs available)")
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="cpu, cuda, or all (cpu, then cuda when available)")
    parser.add_argument("--out", type=Path, default=None, help=f"where to write results (default: {RESULTS} for full runs)")
    args = parser.parse_args(argv)

    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(args.threads or available)
    threads = torch.get_num_threads()
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
        payload = {"machine": info, "quick": args.quick,
                   "rows": [{**dataclasses.asdict(r), "met": r.met} for r in b.rows], **b.extra}
        (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out_dir / f"{stem}.md").write_text(markdown(b, info))
        print(f"wrote {out_dir / (stem + '.json')} and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
