"""The two snippets of the bug report pytorch#88929, without and with amp_bn_fix.

Snippet 1 puts BatchNorm first: it receives the FP32 input, so its output is float32 either way.
Snippet 2 puts it after a Linear: under autocast it receives float16/bfloat16 and, natively,
returns float16/bfloat16; the report expects float32. With amp_bn_fix it is float32.

Runs on CUDA (float16, as in the report) when a GPU is present, and on CPU autocast with float16
and bfloat16 always::

    python examples/bug_report.py
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch
from torch import nn

import amp_bn_fix
from amp_bn_fix._demo import cases, report_network  # the demo's and the self-test's network and devices
from amp_bn_fix._patch import uninstalled


def snippets() -> Iterator[Tuple[str, nn.Sequential]]:
    """The report's two networks, freshly seeded."""
    yield "1: BatchNorm1d first", nn.Sequential(nn.BatchNorm1d(4))
    yield "2: Linear -> BatchNorm1d -> Linear", report_network()


def layer_dtypes(net: nn.Sequential, device: str, dtype: torch.dtype) -> List[torch.dtype]:
    """The report's loop: run the layers one by one under autocast and collect output dtypes."""
    o = torch.randn(2, 4, device=device)
    dtypes = []
    with torch.autocast(device, dtype=dtype):
        for layer in net:
            o = layer(o)
            dtypes.append(o.dtype)
    return dtypes


def expected(net: nn.Sequential, dtype: torch.dtype) -> List[torch.dtype]:
    """What the report expects: BatchNorm in float32, the layers autocast handles in ``dtype``."""
    return [torch.float32 if isinstance(layer, nn.modules.batchnorm._BatchNorm) else dtype for layer in net]


def short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def main() -> int:
    rows = []
    for device, dtype in cases():
        for title, net in snippets():
            net = net.to(device)
            with uninstalled():
                without = layer_dtypes(net, device, dtype)
            with_shim = layer_dtypes(net, device, dtype)
            for layer, want, a, b in zip(net, expected(net, dtype), without, with_shim):
                rows.append((title, device, short(dtype), type(layer).__name__, short(a), short(b), short(want)))

    header = ("snippet", "device", "autocast", "layer", "without shim", "with shim", "expected")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    print(f"amp_bn_fix {amp_bn_fix.__version__}, torch {torch.__version__}, policy {amp_bn_fix.get_policy()}")
    for line in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    ok = all(row[5] == row[6] for row in rows)
    print("\nwith the shim every layer has the expected dtype" if ok else "\nMISMATCH: see the table")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
