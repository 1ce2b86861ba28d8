"""The large-call regime and the process: per-policy BatchNorm costs, whole models, compilation, start-up.

Section labels (P1 ... P5) are the ones benchmarks/README.md's goals and recorded results use.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from _harness import OFF, ON, Bench, Skip, host_timer, settings, shim, switch, timing_of
from _models import HALF, MODELS, bn_step, count_bn, grads_like, half_input, resnet18_like, sgd, small_net
from _ops import quiet_stderr

BENCHMARKS = Path(__file__).resolve().parent
SHAPES = ((32, 64, 56, 56), (32, 256, 14, 14))
QUICK_SHAPES = ((4, 64, 14, 14), (4, 256, 7, 7))


def shapes(b: Bench):
    return QUICK_SHAPES if b.quick else SHAPES


def dispatch(b: Bench) -> None:
    """P1: a small BatchNorm2d outside autocast (the shim passes it through), and one bare call.

    In a training program's state whatever rows ran before: dynamo imported, as the first
    optimizer step imports it (a call passed on asks whether it is being compiled only then).
    """
    import torch._dynamo  # noqa: F401

    print(f"[{b.current}] P1: outside autocast, shim enabled (A) vs disabled (B)")
    bn = nn.BatchNorm2d(16).to(b.device)
    x = torch.randn(8, 16, 8, 8, device=b.device)
    calls = 20 if b.quick else 200
    for mode in ("train", "eval"):
        bn.train(mode == "train")
        t = b.compare(lambda: bn(x), lambda: bn(x), 41, calls, ON, OFF)
        b.add("P1", f"BatchNorm2d(16) fwd (8,16,8,8), {mode}", "shim on", "shim off", t, target="<= 1.05")
    rm, rv = torch.zeros(16, device=b.device), torch.ones(16, device=b.device)
    w, bias = torch.ones(16, device=b.device), torch.zeros(16, device=b.device)

    def call() -> None:
        F.batch_norm(x, rm, rv, w, bias, False, 0.1, 1e-5)

    with torch.no_grad():
        t = b.compare(call, call, 41, calls * 5, ON, OFF)
    b.add("P1", "F.batch_norm call, FP32 input, eval", "shim on", "shim off", t,
          note=f"per-call overhead {t.a_us - t.b_us:+.2f} us")


def _policy_cases(b: Bench):
    layouts = [False] if b.quick else [False, True]
    for name, dtype in HALF.items():
        for shape in shapes(b):
            for channels_last in layouts:
                if channels_last and shape != shapes(b)[0]:
                    continue
                label = f"{name} {tuple(shape)}" + (" channels_last" if channels_last else "")
                bn = nn.BatchNorm2d(shape[1]).to(b.device)
                x = half_input(shape, dtype, b.device, channels_last)
                yield label, bn, x, dtype, channels_last


def input_policy(b: Bench) -> None:
    """P2: the ``input`` policy against native autocast BatchNorm, forward+backward, training."""
    print(f"[{b.current}] P2: input policy (A) vs native autocast BN, shim off (B); forward+backward, training")
    calls = 1 if b.device == "cpu" else 10
    for label, bn, x, dtype, channels_last in _policy_cases(b):
        step = bn_step(bn, x, grads_like(x), b.device, dtype)
        with settings(policy="input", guard=True):
            t = b.compare(step, step, 15, calls, ON, OFF)
        b.add("P2", f"{label} fwd+bwd", "input", "native", t, target="<= 1.05")
        if not channels_last:
            with settings(policy="input", guard=False):
                t = b.compare(step, step, 15, calls, ON, OFF)
            b.add("P2", f"{label} fwd+bwd", "input, no guard", "native", t, note="breakdown: guard off")


def fp32_policy(b: Bench) -> None:
    """P3: the ``fp32`` policy against ``bn(x.float())`` with autocast off (what users write by hand)."""
    print(f"[{b.current}] P3: fp32 policy (A) vs bn(x.float()) with autocast off, shim off (B)")
    calls = 1 if b.device == "cpu" else 10
    for label, bn, x, dtype, _ in _policy_cases(b):
        grads = grads_like(x)
        with settings(policy="fp32", guard=True):
            for backward, what in ((True, "fwd+bwd"), (False, "fwd only")):
                t = b.compare(bn_step(bn, x, grads, b.device, dtype, backward=backward),
                              bn_step(bn, x, grads, b.device, dtype, by_hand=True, backward=backward), 15, calls, ON, OFF)
                b.add("P3", f"{label} {what}", "fp32", "by hand", t, target="<= 1.0" if backward else "")


def profile(b: Bench) -> None:
    """Where the time of one P3 step goes: the top ops of the ``fp32`` policy and of the hand-written peer."""
    if b.device != "cpu":
        raise Skip("CPU profile only")
    shape = shapes(b)[0]
    bn = nn.BatchNorm2d(shape[1]).to(b.device)
    x = half_input(shape, torch.bfloat16, b.device)
    grads = grads_like(x)
    profiles = {}
    for label, enabled, by_hand in (("fp32 policy", True, False), ("by hand", False, True)):
        step = bn_step(bn, x, grads, b.device, torch.bfloat16, by_hand=by_hand)
        with shim(enabled, policy="fp32"):
            for _ in range(3):
                step()
            with quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        profiles[label] = [(e.key, e.self_cpu_time_total / 5 / 1000) for e in events]
        print(f"[{b.current}] one step, {label}, bf16 {tuple(shape)}, {torch.get_num_threads()} threads (self CPU ms):")
        for key, ms in profiles[label]:
            print(f"    {ms:7.2f}  {key}")
    b.extra.setdefault("p3_profile_ms", {"shape": list(shape), "dtype": "bf16", "top_ops": {}})
    b.extra["p3_profile_ms"]["top_ops"][str(torch.get_num_threads())] = profiles


def bandwidth_rows(b: Bench, shape_list, dtype: torch.dtype = torch.bfloat16, section: str = "bw") -> None:
    """The ``fp32`` policy's fwd+bwd against a plain copy of as many bytes as its tensors hold.

    A fwd+bwd must at least read the 16-bit input and the FP32 incoming gradient and write the FP32
    output and the 16-bit input gradient: 12 bytes per value. A copy of half that many bytes reads
    and writes as many: the device's streaming limit for this traffic.
    """
    calls = 1 if b.device == "cpu" else 10
    for shape in shape_list:
        bn = nn.BatchNorm2d(shape[1]).to(b.device)
        x = half_input(shape, dtype, b.device)
        moved = 12 * x.numel()
        src = torch.ones(moved // 2, dtype=torch.uint8, device=b.device)
        dst = torch.empty_like(src)
        with shim(True, policy="fp32", guard=True):
            t = b.compare(bn_step(bn, x, grads_like(x), b.device, dtype), lambda: dst.copy_(src), 15, calls)
        gbs = lambda us: moved / us / 1e3  # noqa: E731  bytes per microsecond / 1e3 = GB/s
        b.add(section, f"{str(dtype)[6:]} {tuple(shape)} fwd+bwd, {moved / 2**20:.0f} MiB", "fp32", "copy", t,
              note=f"{gbs(t.a_us):.1f} GB/s effective vs {gbs(t.b_us):.1f} GB/s copy", target="1.0 = the memory limit")


def bandwidth(b: Bench) -> None:
    print(f"[{b.current}] bandwidth: fp32 policy fwd+bwd (A) vs a plain copy of the same bytes (B)")
    bandwidth_rows(b, shapes(b))


def train_models(b: Bench) -> None:
    """P4: a training step of three models under bf16 autocast, ``fp32`` policy vs shim off, with a breakdown."""
    print(f"[{b.current}] P4: training step under bf16 autocast, SGD: fp32 policy (A) vs shim off (B)")
    batch, size = (2, 32) if b.quick else (8, 96)
    calls = 1 if b.device == "cpu" else 5
    # Quick mode checks that the row runs: one model is enough for that.
    for name, build in list(MODELS.items())[:1 if b.quick else None]:
        torch.manual_seed(0)
        model = build().to(b.device)
        opt = sgd(model)
        x = torch.randn(batch, 3, size, size, device=b.device)
        y = torch.randint(0, 10, (batch,), device=b.device)
        # Shim off, each BatchNorm's native 16-bit output cast to FP32: the FP32 activations the
        # ``fp32`` policy hands on, without its own cost.
        cast = [False]
        hooks = [m.register_forward_hook(lambda module, args, out: out.float() if cast[0] else None)
                 for m in model.modules() if isinstance(m, nn.BatchNorm2d)]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(b.device, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        def casting(on: bool) -> Callable[[], None]:
            def run() -> None:
                OFF()
                cast[0] = on
            return run

        label = f"{name} step, ({batch},3,{size},{size}), {count_bn(model)} BN"
        t = b.compare(step, step, 15, calls, switch(True, policy="fp32", guard=True), casting(False))
        b.add("P4", label, "fp32", "shim off", t, target="<= 1.15")
        # Where the difference goes: the guard, the FP32 activations (absent with ``input``), and those alone.
        for a_setup, a_name, note in (
            (switch(True, policy="fp32", guard=False), "fp32, no guard", "breakdown: guard off"),
            (switch(True, policy="input", guard=True), "input", "breakdown: 16-bit output"),
            (casting(True), "native BN, output cast to FP32", "breakdown: FP32 activations alone"),
        ):
            t = b.compare(step, step, 9, calls, a_setup, casting(False))
            b.add("P4", label, a_name, "shim off", t, note=note)
        cast[0] = False
        for hook in hooks:
            hook.remove()


def eval_jit(b: Bench) -> None:
    """ResNet-18-like inference under bf16 autocast, traced and frozen with the shim on and off.

    ``torch.jit.freeze`` folds each BatchNorm into the convolution before it when the BatchNorm
    runs natively (shim off); the shim's FP32 BatchNorm is no such pattern, so it stays.
    """
    print(f"[{b.current}] eval: ResNet-18-like inference under bf16 autocast, jit.freeze of a trace, shim on (A) vs off (B)")
    torch.manual_seed(0)
    model = resnet18_like().eval().to(b.device)
    size = 32 if b.quick else 96
    x = torch.randn(2 if b.quick else 8, 3, size, size, device=b.device)
    frozen = {}
    for enabled in (True, False):
        with shim(enabled, policy="fp32"), torch.no_grad(), torch.autocast(b.device, dtype=torch.bfloat16):
            frozen[enabled] = torch.jit.freeze(torch.jit.trace(model, x, check_trace=False))
    kept = [str(frozen[e].graph).count("aten::batch_norm") for e in (True, False)]

    def run(module: torch.jit.ScriptModule) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad(), torch.autocast(b.device, dtype=torch.bfloat16):
                module(x)
        return call

    t = b.compare(run(frozen[True]), run(frozen[False]), 15, 1)
    b.add("eval", f"ResNet-18-like {tuple(x.shape)}, jit.freeze", "shim on", "shim off", t,
          note=f"BatchNorms left in the frozen graph: {kept[0]} vs {kept[1]}")


# The compiled cases run one process per candidate: changing the shim's settings resets
# torch.compile, so both cannot stay compiled in one process.
COMPILED_STEPS = 30


def compiled_worker(kind: str, policy: str, steps: int, backend: str) -> List[float]:
    """Compile ``small_net`` (``kind``: a training step, or frozen inference); the times of ``steps`` calls (us)."""
    import torch._inductor.config as inductor_config

    import amp_bn_fix

    torch.manual_seed(0)
    if policy == "off":
        amp_bn_fix.disable()
    else:
        amp_bn_fix.configure(policy=policy)
        amp_bn_fix.enable()
    model = small_net()
    x = torch.randn(16, 3, 64, 64)
    if kind == "train":
        y = torch.randint(0, 10, (16,))
        opt = sgd(model)

        def loss_of(inp: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.cross_entropy(model(inp), y)

        compiled = torch.compile(loss_of, backend=backend)

        def call() -> None:
            opt.zero_grad(set_to_none=True)
            compiled(x).backward()
            opt.step()
    else:
        inductor_config.freezing = True
        model.eval()
        compiled = torch.compile(model, backend=backend)

        def call() -> None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                compiled(x)

    for _ in range(3):  # compiles, then warms up
        call()
    return [host_timer(call, 1) for _ in range(steps)]


def compiled(b: Bench) -> None:
    """Inductor, a training step and frozen inference of ``small_net``: ``fp32`` policy vs shim off."""
    if b.device != "cpu":
        raise Skip("CPU only (inductor's C++ backend)")
    # Quick: dynamo traces the shim as inductor's run would, with no compilation behind it.
    backend = "eager" if b.quick else "inductor"
    print(f"[{b.current}] compile: {backend}, small conv+BN net (16,3,64,64), bf16 autocast; fp32 policy (A) vs "
          "shim off (B), one process per sample" + (" (quick: dynamo's eager backend, no compilation)" if b.quick else ""))
    pairs, steps = (1, 3) if b.quick else (3, COMPILED_STEPS)
    # Quick: the training step alone, whose trace covers the forward, the backward and the guard.
    kinds = (("train", "training step"),) + (() if b.quick else (("eval", "inference, freezing=True"),))
    for kind, label in kinds:
        def sample(policy: str) -> float:
            cmd = [sys.executable, str(BENCHMARKS / "bench.py"), "--compiled-worker", kind, policy, backend, str(steps),
                   "--threads", str(torch.get_num_threads())]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            return statistics.median(json.loads(out.splitlines()[-1]))

        times: Dict[str, List[float]] = {"fp32": [], "off": []}
        for i in range(pairs):
            for policy in (("fp32", "off") if i % 2 == 0 else ("off", "fp32")):
                times[policy].append(sample(policy))
        t = timing_of(times["fp32"], times["off"])
        b.add("compile", f"small net, {label}, {backend}", "fp32", "shim off", t,
              note=f"median of {steps} calls per process", target="about 1.00" if kind == "train" else "")


def guard(b: Bench) -> None:
    print(f"[{b.current}] guard: fp32 policy, guard on (A) vs off (B)")
    for shape, calls in (((8, 16, 8, 8), 10 if b.quick else 50), (shapes(b)[1], 1)):
        bn = nn.BatchNorm2d(shape[1]).to(b.device)
        x = half_input(shape, torch.bfloat16, b.device)
        step = bn_step(bn, x, grads_like(x), b.device, torch.bfloat16)
        t = b.compare(step, step, 21, calls, switch(True, policy="fp32", guard=True), switch(True, policy="fp32", guard=False))
        b.add("guard", f"bf16 {tuple(shape)} fwd+bwd", "guard on", "guard off", t, note=f"{t.a_us - t.b_us:+.1f} us per call")


def memory(b: Bench) -> None:
    """Held and peak memory of one training BatchNorm2d fwd+bwd, per policy and by hand (``memory.py``)."""
    if b.device != "cpu" or not Path("/proc/self/clear_refs").exists():
        raise Skip("needs Linux's /proc/self/clear_refs, on CPU (the CUDA rows measure device memory)")
    import memory as memory_script

    shape = [4, 64, 28, 28] if b.quick else [32, 64, 56, 56]
    results = memory_script.measure_all(shape, "bfloat16")
    native = results["native"]
    print(f"[{b.current}] memory: BatchNorm2d fwd+bwd, training, bf16 {tuple(shape)}; MiB, against native autocast")
    for variant, r in results.items():
        if variant == "native":
            continue
        label = memory_script.LABELS[variant]
        b.add_figure("memory", f"{tuple(shape)} held until backward, {label}", variant, "native", r["held"],
                     native["held"], "MiB", note=f"output {r['out_dtype']}")
        b.add_figure("memory", f"{tuple(shape)} peak growth, {label}", variant, "native", r["peak"], native["peak"],
                     "MiB", target="fp32: <= 2 x native" if variant == "fp32" else "")


# --- start-up --------------------------------------------------------------------------------

_START = "import site; f = site.addpackage; site.addpackage = {}; site.main()"
_WITH_HOOK = _START.format("lambda d, n, k: f(d, n, k)")
_WITHOUT_HOOK = _START.format("lambda d, n, k: k if n == 'amp_bn_fix.pth' else f(d, n, k)")


def find_hook() -> Optional[Path]:
    import site

    for d in {sysconfig.get_paths()["purelib"], *site.getsitepackages()}:
        if (Path(d) / "amp_bn_fix.pth").is_file():
            return Path(d) / "amp_bn_fix.pth"
    return None


def startup(b: Bench) -> None:
    """P5: interpreter start-up with the start-up hook installed and ``AMP_BN_FIX`` unset, vs skipping the hook."""
    if b.device != "cpu":
        raise Skip("host only")
    print(f"[{b.current}] P5 start-up: interpreter with the hook, AMP_BN_FIX unset (A) vs skipping the hook (B)")
    if find_hook() is None:
        raise Skip("the start-up hook is not installed (no amp_bn_fix.pth in site-packages)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMP_BN_FIX")}

    def start(code: str) -> Callable[[], None]:
        cmd = [sys.executable, "-S", "-c", code]
        return lambda: subprocess.run(cmd, env=env, check=True)

    t = b.compare(start(_WITH_HOOK), start(_WITHOUT_HOOK), 101, 1, timer=host_timer)
    b.add("P5", "python -S + site.main()", "hook", "no hook", t, target="<= 1.02")
    probe = "import sys; print('torch' in sys.modules, 'wrapt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "AMP_BN_FIX": "1"},
                         check=True, capture_output=True, text=True).stdout.split()
    b.note(f"after start-up with AMP_BN_FIX=1: torch imported: {out[0]}, wrapt imported: {out[1]}")

