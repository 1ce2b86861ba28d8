"""One rank of tests/test_distributed.py, started by torchrun: a few DDP steps under CPU autocast.

It does not import amp_bn_fix: only the environment (``AMP_BN_FIX=1``) can enable the shim. Writes
what it saw to ``OUT_DIR/rank<N>.json``.
"""

import json
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import nn


def main(out_dir: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    bn = model[1]
    seen = {"bn_out": [], "stats_at_forward": []}
    # What BatchNorm finds right after DDP's buffer broadcast, and what it returns.
    bn.register_forward_pre_hook(lambda m, args: seen["stats_at_forward"].append(m.running_mean.tolist()))
    bn.register_forward_hook(lambda m, args, out: seen["bn_out"].append(str(out.dtype)))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(32, 8, generator=data) * 2 + rank
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(x).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    amp_bn_fix = sys.modules.get("amp_bn_fix")
    report = {
        "patch_active": amp_bn_fix is not None and amp_bn_fix.is_enabled(),
        "policy": amp_bn_fix.get_policy() if amp_bn_fix else None,
        "stats_dtype": [str(bn.running_mean.dtype), str(bn.running_var.dtype)],
        "stats_finite": bool(torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()),
        "weight_grad_dtype": str(bn.weight.grad.dtype),
        **seen,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    # Both ranks done before either tears down: gloo aborts a rank whose peer hangs up mid-exchange.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
