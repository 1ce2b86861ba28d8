"""DDP training of a BatchNorm CNN under CPU autocast, with amp_bn_fix turned on by the environment alone.

The training code below never imports amp_bn_fix. Installing the package puts a start-up hook in the
environment; with ``AMP_BN_FIX=1`` it enables the shim in every Python process, torchrun's workers
included, as soon as they import torch::

    AMP_BN_FIX=1 torchrun --nproc-per-node 2 examples/torchrun_ddp.py

Run directly, the script starts those two CPU workers (gloo backend) itself through torchrun, with
``AMP_BN_FIX=1`` unless the variable is already set::

    python examples/torchrun_ddp.py              # shim on in both workers
    AMP_BN_FIX=0 python examples/torchrun_ddp.py # torch's native behaviour, for comparison

Rank 0 prints, for every rank, whether the shim is active, the BatchNorm output dtype under autocast,
and the dtype and finiteness of the running statistics after training (DDP broadcasts rank 0's
buffers to the others at every step; they stay float32).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def launch(argv: List[str]) -> int:
    """Start two CPU workers with torchrun, the shim enabled by the environment; their exit code."""
    env = dict(os.environ)
    env.setdefault("AMP_BN_FIX", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # two workers share the CPU cores
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), *argv]
    shown = " ".join(["torchrun --standalone --nproc-per-node 2", sys.argv[0], *argv])
    print(f"AMP_BN_FIX={env['AMP_BN_FIX']} {shown}", flush=True)
    return subprocess.run(command, env=env).returncode


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2),
    )


def shim_state() -> str:
    """What amp_bn_fix does in this process, found without importing it."""
    shim = sys.modules.get("amp_bn_fix")
    if shim is None:
        return "not loaded"
    return f"on, policy {shim.get_policy()}" if shim.is_enabled() else "loaded, disabled"


def worker(steps: int) -> Dict[str, object]:
    """Train a few steps on this rank's share of seeded synthetic data; report what BatchNorm did."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bn = model.module[1]
    out_dtypes: List[torch.dtype] = []
    bn.register_forward_hook(lambda module, args, out: out_dtypes.append(out.dtype))

    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 3, 12, 12, generator=data) * 30 + 100
        y = (x[:, 0].mean((1, 2)) > x[:, 1].mean((1, 2))).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    stats = [t for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             for t in (m.running_mean, m.running_var)]
    return {
        "rank": rank,
        "amp_bn_fix": shim_state(),
        "BN output": str(out_dtypes[-1]).replace("torch.", ""),
        "running stats": ",".join(sorted({str(t.dtype).replace("torch.", "") for t in stats})),
        "stats finite": "yes" if all(bool(torch.isfinite(t).all()) for t in stats) else "NO",
        "loss first->last": f"{losses[0]:.3f} -> {losses[-1]:.3f}",
    }


def print_report(reports: List[Dict[str, object]]) -> None:
    header = list(reports[0])
    rows = [[str(r[k]) for k in header] for r in reports]
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    if os.environ.get("AMP_BN_FIX", "").strip().lower() in ("1", "true", "yes", "on") and any(
        not str(r["amp_bn_fix"]).startswith("on") for r in reports
    ):
        print("\nAMP_BN_FIX=1 but the shim is not on: the start-up hook is missing from this environment; "
              "install the package with pip, or start the job with `amp-bn-fix run -- torchrun ...`.")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return launch(sys.argv[1:] if argv is None else argv)

    dist.init_process_group("gloo")
    try:
        report = worker(args.steps)
        reports: List[Optional[Dict[str, object]]] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if dist.get_rank() == 0:
            print_report(reports)  # type: ignore[arg-type]
        dist.barrier()  # let every rank finish talking before the connections close
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
