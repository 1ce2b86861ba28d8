"""One rank of the multi-rank scenarios in tests/test_distributed.py, started by torchrun (gloo, CPU).

FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``), DDP without buffer broadcast and
SyncBatchNorm, each on a small Conv+BatchNorm model for a few training steps. Like ddp_worker.py it
never imports amp_bn_fix: only the environment (``AMP_BN_FIX=1``) can enable the shim.

Every BatchNorm call is checked against float64 (``bn_probe.Watch``). A scenario whose training
raises reports the error instead. Writes ``OUT_DIR/rank<N>.json``::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_worker.py OUT_DIR [SCENARIO ...]
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bn_probe import Watch, bn_modules, shim_state

STEPS = 3


def make_model() -> nn.Sequential:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(block(3, 8), block(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


def batch(step: int, rank: int):
    data = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
    x = torch.randn(8, 3, 8, 8, generator=data) * 20 + 50
    y = (x[:, 0].mean((1, 2)) > x[:, 1].mean((1, 2))).long()
    return x, y


def stats_of(bns: List[nn.Module]) -> List[List[float]]:
    return [t.double().tolist() for m in bns for t in (m.running_mean, m.running_var)]


def sync_running_stats(bns: List[nn.Module]) -> None:
    """Average every rank's running stats in place (all-reduce), as timm's ``distribute_bn`` does."""
    world = dist.get_world_size()
    for m in bns:
        for buf in (m.running_mean, m.running_var):
            dist.all_reduce(buf)
            buf.div_(world)


def train(wrapped: nn.Module, bns: List[nn.Module], autocast: bool, report: Dict[str, Any], sync: bool) -> None:
    """A few SGD steps; the first error (from any step) is reported, not raised."""
    watch = Watch(bns)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    losses = []
    try:
        for step in range(STEPS):
            x, y = batch(step, dist.get_rank() if dist.is_initialized() else 0)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(wrapped(x).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    except Exception as exc:  # both ranks fail alike: report it and go on to the next scenario
        report["error"] = f"{type(exc).__name__}: {exc}"
    report.update(calls=watch.calls, losses=losses, stats_before_sync=stats_of(bns))
    report["stats_finite"] = all(bool(torch.isfinite(t).all()) for m in bns for t in (m.running_mean, m.running_var))
    if sync and "error" not in report:
        sync_running_stats(bns)
        report["stats_after_sync"] = stats_of(bns)


# ---- scenarios: each builds its own model and returns what it saw --------------------------------


def fsdp2(autocast: bool) -> Callable[[], Dict[str, Any]]:
    def run() -> Dict[str, Any]:
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

        model = make_model()
        bns = bn_modules(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model[:2]:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        report: Dict[str, Any] = {}
        train(model, bns, autocast, report, sync=True)
        return report

    return run


def fsdp1(autocast: bool, auto_wrap: bool = False, ignore_bn: bool = True, buffer_dtype: Optional[torch.dtype] = None):
    def run() -> Dict[str, Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = make_model()
        bns = bn_modules(model)
        kwargs: Dict[str, Any] = {"device_id": torch.device("cpu")}  # without it FSDP1 refuses CPU
        if auto_wrap:
            kwargs["auto_wrap_policy"] = ModuleWrapPolicy({nn.Conv2d, nn.Linear})
        mixed = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=buffer_dtype)
        if not ignore_bn:  # BatchNorm in the units of the auto_wrap_policy, with mixed precision
            mixed = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=buffer_dtype, _module_classes_to_ignore=())
        wrapped = FullyShardedDataParallel(model, mixed_precision=mixed, **kwargs)
        report: Dict[str, Any] = {}
        train(wrapped, bns, autocast, report, sync=True)
        return report

    return run


def fsdp1_without_device_id() -> Dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    try:
        FullyShardedDataParallel(make_model(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def ddp_no_broadcast() -> Dict[str, Any]:
    model = make_model()
    bns = bn_modules(model)
    wrapped = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    report: Dict[str, Any] = {}
    train(wrapped, bns, True, report, sync=True)
    return report


def ddp_syncbn() -> Dict[str, Any]:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    try:
        nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def syncbn_train() -> Dict[str, Any]:
    """SyncBatchNorm training with the process group up: the syncing path (no DDP needed)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    report: Dict[str, Any] = {"kinds": sorted({type(m).__name__ for m in bn_modules(model)})}
    train(model, bn_modules(model), True, report, sync=False)
    return report


def syncbn_eval() -> Dict[str, Any]:
    """SyncBatchNorm in eval mode never syncs: it calls F.batch_norm with the running stats."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    bns = bn_modules(model)
    for i, m in enumerate(bns):  # running stats of a trained model, not the initial 0 and 1
        m.running_mean.copy_(torch.linspace(-1, 1, m.num_features) * (i + 1) * 10)
        m.running_var.copy_(torch.linspace(1, 4, m.num_features) * (i + 1) * 100)
    before = stats_of(bns)
    model.eval()
    watch = Watch(bns)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch(0, dist.get_rank())[0])
    return {
        "kinds": sorted({type(m).__name__ for m in bns}),
        "calls": watch.calls,
        "model_out": str(out.dtype),
        "stats_unchanged": stats_of(bns) == before,
    }


def syncbn_no_group() -> Dict[str, Any]:
    """SyncBatchNorm training before init_process_group: the non-syncing path, F.batch_norm."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    report: Dict[str, Any] = {"kinds": sorted({type(m).__name__ for m in bn_modules(model)})}
    train(model, bn_modules(model), True, report, sync=False)
    return report


BEFORE_INIT = {"syncbn-no-group": syncbn_no_group}
SCENARIOS: Dict[str, Callable[[], Dict[str, Any]]] = {
    "fsdp2": fsdp2(autocast=False),
    "fsdp2-autocast": fsdp2(autocast=True),
    "fsdp1": fsdp1(autocast=False),
    "fsdp1-autocast": fsdp1(autocast=True),
    "fsdp1-autowrap-autocast": fsdp1(autocast=True, auto_wrap=True),
    "fsdp1-autowrap-bn-mixed-autocast": fsdp1(autocast=True, auto_wrap=True, ignore_bn=False),
    "fsdp1-buffer-bf16-autocast": fsdp1(autocast=True, buffer_dtype=torch.bfloat16),
    "fsdp1-no-device-id": fsdp1_without_device_id,
    "ddp-no-broadcast": ddp_no_broadcast,
    "ddp-syncbn": ddp_syncbn,
    "syncbn-train": syncbn_train,
    "syncbn-eval": syncbn_eval,
}


def main(out_dir: pathlib.Path, names: List[str]) -> None:
    names = names or [*BEFORE_INIT, *SCENARIOS]
    unknown = set(names) - set(BEFORE_INIT) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {sorted(unknown)}")
    torch.set_num_threads(1)
    results = {name: BEFORE_INIT[name]() for name in names if name in BEFORE_INIT}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    for name in names:
        if name in SCENARIOS:
            results[name] = SCENARIOS[name]()
            dist.barrier()  # every rank done with one scenario before the next starts
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"shim": shim_state(), "scenarios": results}))
    # Both ranks done before either tears down: gloo aborts a rank whose peer hangs up mid-exchange.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
