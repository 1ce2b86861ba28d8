"""Memory of one BatchNorm2d forward+backward under CPU autocast, per policy, against native and by hand.

    python benchmarks/memory.py                  # (32, 64, 56, 56) bfloat16, about 15 s
    python benchmarks/memory.py --shape 8 64 56 56

Each variant runs in a fresh process (so that no allocator cache from another one is reused) and
reports two figures:

- held: the memory a training-mode forward allocates and keeps until backward (the tensors autograd
  saves, except the input itself, and the output), counted exactly with
  ``torch.autograd.graph.saved_tensors_hooks``;
- peak: how much the process's peak resident memory grew over the forward and the backward
  (Linux's ``VmHWM``, reset just before), which includes the gradients and the temporaries of both.
  An untimed forward+backward runs first, and glibc is told to map every large block on its own
  (``MALLOC_MMAP_THRESHOLD_``), so that the resident size follows the live tensors rather than the
  allocator's caching. Compare the rows, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

VARIANTS = ("native", "input", "fp32", "by hand")
# glibc returns a freed block to the system only above a threshold that it raises as large blocks
# are freed; fixed low, every tensor is its own mapping and the resident size follows what is live.
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
LABELS = {
    "native": "native autocast (shim off)",
    "input": "shim, input policy",
    "fp32": "shim, fp32 policy",
    "by hand": "bn(x.float()), autocast off",
}


def measure(variant: str, shape: List[int], dtype_name: str) -> Dict[str, float]:
    """Run one forward+backward of ``variant`` in this process; the figures in MiB."""
    import torch
    from torch import nn

    import amp_bn_fix

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(shape, generator=generator)
    bn = nn.BatchNorm2d(shape[1])
    if variant in ("input", "fp32"):
        amp_bn_fix.enable(variant)
    else:
        amp_bn_fix.disable()

    saved: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() != x.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    def reset_peak() -> None:
        # Linux resets the peak resident set size (VmHWM) to the current one on "5".
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def forward(x):
        if variant == "by hand":
            return bn(x.float())
        with torch.autocast("cpu", dtype=dtype):
            return bn(x)

    # One call first, not measured: torch's lazy initialisation and first-touch costs would count otherwise.
    out = forward(x)
    out.backward(grad.to(out.dtype))
    del out
    x.grad = bn.weight.grad = bn.bias.grad = None
    reset_peak()
    before = status("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    out.backward(grad.to(out.dtype))
    mib = 2.0**20
    return {"held": sum(saved.values()) / mib, "peak": (status("VmHWM") - before) / mib,
            "input": x.untyped_storage().nbytes() / mib, "out_dtype": str(out.dtype).replace("torch.", "")}


def measure_all(shape: List[int], dtype_name: str) -> Dict[str, Dict[str, float]]:
    """Every variant, each in a fresh process."""
    results = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--variant", variant, "--dtype", dtype_name, "--shape", *map(str, shape)]
        results[variant] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, env=ENV).stdout)
    return results


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[32, 64, 56, 56], metavar=("N", "C", "H", "W"))
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object, by variant")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measurement, as JSON
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args.variant, args.shape, args.dtype)))
        return 0
    results = measure_all(args.shape, args.dtype)
    if args.json:
        print(json.dumps(results))
        return 0
    rows = [(LABELS[variant], result) for variant, result in results.items()]
    print(f"BatchNorm2d forward+backward, training, input {tuple(args.shape)} {args.dtype} "
          f"({rows[0][1]['input']:.1f} MiB); MiB")
    print(f"{'':30}  {'output':>8}  {'held':>6}  {'peak':>6}")
    for label, r in rows:
        print(f"{label:30}  {r['out_dtype']:>8}  {r['held']:6.1f}  {r['peak']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
