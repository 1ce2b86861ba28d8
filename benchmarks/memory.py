"""Memory of one BatchNorm2d forward+backward under CPU autocast, per policy, against native and by hand.

    python benchmarks/memory.py                  # (32, 64, 56, 56) bfloat16, about 15 s
    python benchmarks/memory.py --shape 8 64 56 56

Each variant runs in a fresh process (so that no allocator cache from another one is reused) and
reports two figures:

- held: the memory a training-mode forward allocates and keeps until backward (the tensors autograd
  saves, except the input itself, and the output), counted exactly with
  ``torch.autograd.graph.saved_tensors_hooks``;
- peak: how much the process's peak resident memory grew over the forward and the backward
  (``getrusage``), which includes the gradients and the temporaries of both. It depends on the
  allocator and the machine; compare the rows, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Dict, List

VARIANTS = ("native", "input", "fp32", "by hand")
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

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux

    before = peak()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if variant == "by hand":
            out = bn(x.float())
        else:
            with torch.autocast("cpu", dtype=dtype):
                out = bn(x)
    saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    out.backward(grad.to(out.dtype))
    mib = 2.0**20
    return {"held": sum(saved.values()) / mib, "peak": (peak() - before) / mib,
            "input": x.untyped_storage().nbytes() / mib, "out_dtype": str(out.dtype).replace("torch.", "")}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[32, 64, 56, 56], metavar=("N", "C", "H", "W"))
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measurement, as JSON
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args.variant, args.shape, args.dtype)))
        return 0
    rows = []
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--variant", variant, "--dtype", args.dtype, "--shape", *map(str, args.shape)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        rows.append((LABELS[variant], result))
    print(f"BatchNorm2d forward+backward, training, input {tuple(args.shape)} {args.dtype} "
          f"({rows[0][1]['input']:.1f} MiB); MiB")
    print(f"{'':30}  {'output':>8}  {'held':>6}  {'peak':>6}")
    for label, r in rows:
        print(f"{label:30}  {r['out_dtype']:>8}  {r['held']:6.1f}  {r['peak']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
