"""Benchmark amp_bn_fix against native autocast and the FP32 batch norm users write by hand.

    python benchmarks/bench.py                        # full CPU run: prints a table, writes benchmarks/results/
    python benchmarks/bench.py --quick                # a short run of every CPU row; writes nothing
    python benchmarks/bench.py --only 'tiny-*,aten-ops' --threads 1 2
    python benchmarks/bench.py --device cuda          # the CUDA rows and the small-call rows on the GPU
    python benchmarks/bench.py --list                 # the rows, by name

Every timed figure is a ratio of two candidates measured side by side: they alternate sample by
sample (A B, B A, A B, ...), each sample timing a few calls, and the ratio reported is the median of
the per-pair ratios with its interquartile range. A ratio is A's time over B's: lower is faster for
A, 1.00 is a tie. Rows marked per-thread run at each torch thread count of the sweep (``--threads``;
default 1, 2 and every CPU available). The run prints figures only (targets are printed, never
checked); a row that fails is recorded and the others still run, and the exit code is then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import sys
from pathlib import Path
from typing import Callable, FrozenSet, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _cuda_rows  # noqa: E402
import _large_rows  # noqa: E402
import _small_rows  # noqa: E402
import _traffic  # noqa: E402
from _harness import Bench, thread_sweep  # noqa: E402
from _report import load_average, machine, payload, slug, write  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CPU, CUDA, BOTH = frozenset({"cpu"}), frozenset({"cuda"}), frozenset({"cpu", "cuda"})


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmark row: what ``--only`` selects by name."""

    name: str
    run: Callable[[Bench], None]
    home: FrozenSet[str]  # the devices whose default run includes it
    per_thread: bool  # run at each thread count of the sweep, else once at the last
    help: str
    small: bool = False  # the small-call regime: per thread even in quick mode (others there: the first count)


def small(name: str, run: Callable[[Bench], None], home: FrozenSet[str], help: str) -> Spec:
    return Spec(name, run, home, True, help, small=True)


DEVICE_PATH = " Same on the device path (CPU calls take the path a CUDA call takes)."
ROWS: List[Spec] = [
    # The small-call regime.
    small("tiny-train", _small_rows.tiny("train"), BOTH,
          "bf16 BatchNorm2d(16) (4,16,4,4), training forward per call, shim per policy vs disable()."),
    small("tiny-fwdbwd", _small_rows.tiny("fwdbwd"), BOTH, "The same, training forward+backward."),
    small("tiny-eval", _small_rows.tiny("eval"), BOTH, "The same, eval forward under no_grad."),
    small("convnet-step", _small_rows.convnet_step(), BOTH,
          "SGD step of a conv 3->32 + BN + 2 residual conv+BN blocks net, batch 16, 32x32, shim vs disable()."),
    small("aten-ops", _small_rows.aten_ops(), BOTH,
          "Top-level ATen ops of one training and one eval forward of the tiny BatchNorm, shim vs off, per policy."),
    small("half-model", _small_rows.half_model(), BOTH,
          "bf16 .bfloat16() BatchNorm2d, (4,16,4,4) and (16,64,28,28): training and eval outside autocast, "
          "training under it, shim vs disable()."),
    small("tiny-train-device-path", _small_rows.tiny("train", True), CPU, "tiny-train." + DEVICE_PATH),
    small("tiny-fwdbwd-device-path", _small_rows.tiny("fwdbwd", True), CPU, "tiny-fwdbwd." + DEVICE_PATH),
    small("tiny-eval-device-path", _small_rows.tiny("eval", True), CPU, "tiny-eval." + DEVICE_PATH),
    small("convnet-step-device-path", _small_rows.convnet_step(True), CPU, "convnet-step." + DEVICE_PATH),
    small("aten-ops-device-path", _small_rows.aten_ops(True), CPU, "aten-ops." + DEVICE_PATH),
    # The count: what a call costs a GPU (on CPU, the route a CUDA call takes), not timed.
    Spec("traffic", _traffic.traffic_rows, BOTH, False,
         "Bytes moved per value, launches and bytes kept for backward of one BatchNorm call vs native: "
         "(32,64,56,56) and (4,16,4,4) bf16, FP32 and half models, training, fwd+bwd and eval, per policy."),
    # The large-call regime (README's P1 to P5).
    Spec("dispatch", _large_rows.dispatch, CPU, True, "P1: a small BatchNorm outside autocast, shim on vs off."),
    Spec("input-policy", _large_rows.input_policy, CPU, True, "P2: input policy vs native autocast, fwd+bwd."),
    Spec("fp32-policy", _large_rows.fp32_policy, CPU, True, "P3: fp32 policy vs bn(x.float()), fwd+bwd and fwd."),
    Spec("profile", _large_rows.profile, CPU, True, "Where one P3 step's time goes (profiler)."),
    Spec("bandwidth", _large_rows.bandwidth, CPU, True, "fp32 policy fwd+bwd vs a copy of the same bytes."),
    Spec("train-models", _large_rows.train_models, CPU, True, "P4: MobileNet-, EfficientNet-, ResNet-18-like steps."),
    Spec("eval-jit", _large_rows.eval_jit, CPU, True, "ResNet-18-like inference, jit.freeze, shim on vs off."),
    Spec("compile", _large_rows.compiled, CPU, True, "inductor on a small net, training and frozen inference."),
    Spec("guard", _large_rows.guard, CPU, True, "The non-finite guard on vs off."),
    Spec("memory", _large_rows.memory, CPU, False, "Held and peak memory of one fwd+bwd, per policy (memory.py)."),
    Spec("startup", _large_rows.startup, CPU, False, "P5: interpreter start-up with the hook vs without."),
    # CUDA; on CPU a dry run.
    Spec("cuda-bn", _cuda_rows.bn, CUDA, False,
         "Per-BatchNorm fwd+bwd per policy vs native, 3 shapes, bf16 and fp16, NCHW and channels_last."),
    Spec("cuda-resnet50", _cuda_rows.resnet50, CUDA, False, "ResNet-50 training step, shim vs native."),
    Spec("cuda-bandwidth", _cuda_rows.bandwidth, CUDA, False, "fp32 policy fwd+bwd vs a device copy of the same bytes."),
    Spec("cuda-memory", _cuda_rows.memory, CUDA, False, "Peak device memory, shim vs native."),
]


def select(only: Optional[str], device: str, parser: argparse.ArgumentParser) -> List[Spec]:
    """The rows to run: those ``--only`` names (comma list, shell-style patterns), else the device's own."""
    if not only:
        return [spec for spec in ROWS if device in spec.home]
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(spec.name, p) for spec in ROWS)]
    if unknown or not patterns:
        parser.error(f"--only: no row named {', '.join(unknown) or repr(only)}; rows: {', '.join(s.name for s in ROWS)}")
    return [spec for spec in ROWS if any(fnmatch.fnmatchcase(spec.name, p) for p in patterns)]


def run(device: str, quick: bool, specs: Sequence[Spec], threads: Sequence[int]) -> Bench:
    b = Bench(device, quick)
    print(f"== {device} ({'quick' if quick else 'full'}), torch threads {', '.join(map(str, threads))}; "
          f"load average {load_average()}; rows: {', '.join(s.name for s in specs)}", flush=True)
    for n in threads:
        torch.set_num_threads(n)
        print(f"-- {n} torch thread{'s' if n > 1 else ''}", flush=True)
        for spec in specs:
            # Quick: the large-call rows at the first thread count only (at more threads on a busy
            # machine they take minutes); the small-call rows at every count.
            if spec.per_thread and (spec.small or not quick or n == threads[0]):
                b.run_row(spec.name, spec.run)
    once = [spec for spec in specs if not spec.per_thread]
    if once:
        torch.set_num_threads(threads[-1])
        print(f"-- once, at {threads[-1]} torch thread{'s' if threads[-1] > 1 else ''}", flush=True)
        for spec in once:
            b.run_row(spec.name, spec.run)
    return b


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="rows:\n" + "\n".join(f"  {s.name:<26} {s.help}" for s in ROWS))
    parser.add_argument("--quick", action="store_true",
                        help="a few pairs per figure and small shapes, for iterating; writes no files unless --out")
    parser.add_argument("--only", metavar="ROW[,ROW]",
                        help="run these rows only (names or shell patterns such as 'tiny-*'; see --list)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch thread counts to run (default: 1, 2 and all CPUs available; quick: 1 and 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the device the rows run on (the cuda-* rows on cpu are a dry run)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write results (default: {RESULTS} for a full run without --only)")
    parser.add_argument("--stem", default=None, help="file name of the results (default: cpu, or cuda-<gpu name>)")
    parser.add_argument("--compiled-worker", nargs=4, metavar=("KIND", "POLICY", "BACKEND", "STEPS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.list:
        for spec in ROWS:
            print(f"{spec.name:<26} {'/'.join(sorted(spec.home)):<9} {spec.help}")
        return 0
    # Quick: one and two threads, where the small-call rows' goals are set, whatever the CPU count.
    threads = thread_sweep(args.threads or ([1, 2] if args.quick else None))
    if args.compiled_worker:
        torch.set_num_threads(threads[0])
        kind, policy, backend, steps = args.compiled_worker
        print(json.dumps(_large_rows.compiled_worker(kind, policy, int(steps), backend)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    specs = select(args.only, args.device, parser)
    load_before = load_average()
    b = run(args.device, args.quick, specs, threads)
    out_dir = args.out or (None if args.quick or args.only else RESULTS)
    if out_dir is not None:
        stem = args.stem or (f"cuda-{slug(torch.cuda.get_device_name())}" if args.device == "cuda" else args.device)
        stem += "-quick" if args.quick and not args.stem else ""
        json_path, md_path = write(payload(b, machine(args.device, threads), load_before), out_dir, stem)
        print(f"wrote {json_path} and {md_path}")
    if b.errors:
        print(f"{len(b.errors)} row run(s) failed: " + ", ".join(f"{e['row']} ({e['threads']}t)" for e in b.errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
