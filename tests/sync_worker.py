"""One rank of real ``nn.SyncBatchNorm`` training over gloo, for tests/test_sync.py.

ROUTE is where the ranks run: ``cpu`` (the CPU's route through the shim), ``device-route`` (CPU
calls taking the route a CUDA call takes, under :func:`amp_bn_fix.testing.device_route`) or
``cuda`` (every rank on the one GPU, torch's own CUDA kernels, the tensors exchanged by gloo).

On CPU: SyncBatchNorm's syncing path (``torch.nn.modules._functions.SyncBatchNorm``) calls five ATen
ops that have CUDA kernels only (in torch 2.13 none of them has a CPU kernel: "Could not run
'aten::batch_norm_stats' with arguments from the 'CPU' backend"), and ``nn.SyncBatchNorm.forward``
refuses a CPU input before it gets there. In this process only, :func:`install_cpu_sync` puts CPU
stand-ins for the five ops on ``torch`` (plain torch ops computing what the CUDA kernels compute, in
the accumulation type of the dtype they are given: FP32 for FP32 and 16-bit inputs, never float64)
and lets the device check pass a CPU input. Everything else is torch's own: the module, the
autograd function with its all_gather and all_reduce over the process group, and the shim's wrapper
of ``SyncBatchNorm.apply`` (the syncing door), imported here with its default settings.

Four scenarios, on a small Conv+SyncBatchNorm model whose parameter gradients are averaged over
the ranks after each backward (what DDP would do; DDP itself refuses CPU SyncBatchNorm modules):

* ``fp32``: an FP32 model trained under bfloat16 autocast.
* ``half``: ``model.half()`` trained under float16 autocast (the stats' FP32 master).
* ``nonfinite``: one finite step, then a forward whose batch holds an inf on rank 1 only.
* ``broadcast``: a half model's BatchNorm trained on each rank's own batches, then its buffers
  broadcast from rank 0, then evaluated on one input on every rank.

Each rank sees its own batches, of different sizes (the gathered statistics weigh them by count).
Every SyncBatchNorm call is recorded (its input, parameters, output, running stats, master, and
the gradients through it, copied to the CPU), and so is what the stand-ins were given (on CPU) and
``amp_bn_fix.report()``'s change over the scenario. The float64 references are computed by the test,
not here (a float64 call in this process would count as passed through). Writes ``OUT_DIR/rank<RANK>.pt``::

    python tests/sync_worker.py STORE_FILE OUT_DIR RANK WORLD_SIZE ROUTE
"""

from __future__ import annotations

import contextlib
import datetime
import pathlib
import sys
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import batchnorm as batchnorm_module

import amp_bn_fix
from amp_bn_fix import _master
from amp_bn_fix.testing import device_route

STEPS = 3
CHANNELS = 8
BN_NAMES = ("1", "4")  # the SyncBatchNorms' paths in make_model()
ROUTES = ("cpu", "device-route", "cuda")

# Where the models and batches are: "cuda" for the route of that name (set by main).
device = "cpu"


# ---- CPU stand-ins for the CUDA-only ops of the syncing path -----------------------------------
# Each follows its CUDA kernel (aten/src/ATen/native/cuda/Normalization.cuh) in what it computes
# and in the dtypes it returns; statistics are computed in the accumulation type (FP32 for a 16-bit
# or FP32 input), so an FP32 call carries FP32 rounding, as on CUDA.

# What the stand-ins were given in the current scenario (reset by run_scenario).
seen: Dict[str, List[Any]] = {}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``(C,)`` tensor shaped to broadcast over ``like``'s channel dimension (dim 1)."""
    return t.view((1, -1) + (1,) * (like.dim() - 2))


def _reduced_dims(input: torch.Tensor) -> List[int]:
    return [0, *range(2, input.dim())]


def batch_norm_stats(input: torch.Tensor, eps: float):
    """This rank's mean and ``1 / sqrt(biased var + eps)`` per channel (two passes)."""
    seen["stats"].append(dict(
        dtype=str(input.dtype),
        # Whether autocast would recast ops here (mm is on its lower-precision list): the shim
        # excludes autocast around the call it computes.
        autocast=(torch.ones(1, 1) @ torch.ones(1, 1)).dtype is not torch.float32,
    ))
    x = input.to(_acc(input.dtype))
    dims = _reduced_dims(x)
    mean = x.mean(dims)
    var = (x - _per_channel(mean, x)).square().mean(dims)
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats_with_counts(input, mean_all, invstd_all, running_mean, running_var, momentum, eps,
                                        counts):
    """Every rank's statistics (one row each) combined by count; the running stats updated in place
    (the unbiased variance), as the CUDA kernel's Welford merge does."""
    seen["gathered_rows"].append(mean_all.shape[0])
    acc = _acc(mean_all.dtype)
    n = counts.to(acc).view(-1, 1)
    total = n.sum()
    mean_all, invstd_all = mean_all.to(acc), invstd_all.to(acc)
    mean = (n * mean_all).sum(0) / total
    var_all = 1.0 / (invstd_all * invstd_all) - eps  # each rank's biased variance, back from its invstd
    m2 = (n * (var_all + (mean_all - mean).square())).sum(0)
    invstd = (m2 / total + eps).rsqrt()
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean.to(acc) + momentum * mean)
    if running_var is not None:
        running_var.copy_((1 - momentum) * running_var.to(acc) + momentum * (m2 / (total - 1)))
    return mean.to(mean_all.dtype), invstd.to(mean_all.dtype)


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    """``(x - mean) * invstd * weight + bias`` in the accumulation type, returned in the input's dtype."""
    x = input.to(_acc(input.dtype))
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight.to(x.dtype), x)
    if bias is not None:
        out = out + _per_channel(bias.to(x.dtype), x)
    return out.to(input.dtype)


def batch_norm_backward_reduce(grad_output, input, mean, invstd, weight, input_g, weight_g, bias_g):
    """This rank's ``sum(dy)`` and ``sum(dy * (x - mean))`` per channel, and the parameter gradients;
    undefined (None) where not asked for."""
    acc = _acc(input.dtype)
    dims = _reduced_dims(input)
    dy, x = grad_output.to(acc), input.to(acc)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(dims)
    param_dtype = weight.dtype if weight is not None else mean.dtype
    grad_weight = (sum_dy_xmu * invstd).to(param_dtype) if weight_g else None
    grad_bias = sum_dy.to(param_dtype) if bias_g else None
    if not input_g:
        sum_dy = sum_dy_xmu = None
    return (None if sum_dy is None else sum_dy.to(mean.dtype),
            None if sum_dy_xmu is None else sum_dy_xmu.to(mean.dtype), grad_weight, grad_bias)


def batch_norm_backward_elemt(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """The input gradient from the all-reduced sums over every rank's ``count`` values."""
    acc = _acc(input.dtype)
    dy, x = grad_output.to(acc), input.to(acc)
    norm = 1.0 / count.sum().to(acc)
    grad_mean = sum_dy.to(acc) * norm
    projection = invstd * invstd * sum_dy_xmu.to(acc) * norm
    scale = invstd if weight is None else invstd * weight.to(acc)
    grad_input = (dy - _per_channel(grad_mean, x) - (x - _per_channel(mean, x)) * _per_channel(projection, x))
    return (grad_input * _per_channel(scale, x)).to(input.dtype)


STAND_INS = {f.__name__: f for f in (batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt,
                                     batch_norm_backward_reduce, batch_norm_backward_elemt)}


class _Delegate:
    """An object that answers as ``target`` does, but for the attributes given."""

    def __init__(self, target: Any, **overrides: Any) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def install_cpu_sync() -> None:
    """The stand-ins on ``torch`` (where ``_functions.SyncBatchNorm`` looks them up at each call),
    and ``nn.SyncBatchNorm.forward``'s device check passed for CPU inputs."""
    for name, stand_in in STAND_INS.items():
        setattr(torch, name, stand_in)
    # nn.SyncBatchNorm.forward syncs only for ``input.device.type in ["cuda", "hpu", "xpu",
    # torch._C._get_privateuse1_backend_name()]`` and raises "SyncBatchNorm expected input tensor to
    # be on GPU or XPU or privateuseone" otherwise. The check reads ``torch`` from batchnorm.py's
    # globals: that module alone gets a stand-in ``torch`` whose ``_C._get_privateuse1_backend_name()``
    # says "cpu" (everything else is the real torch's), so a CPU input passes that one check and
    # nothing else in torch (or in the shim) sees a changed backend name.
    batchnorm_module.torch = _Delegate(torch, _C=_Delegate(torch._C, _get_privateuse1_backend_name=lambda: "cpu"))


# ---- the model, its data and what is recorded ------------------------------------------------


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Conv2d(3, CHANNELS, 3, padding=1), nn.SyncBatchNorm(CHANNELS), nn.ReLU(),
        nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.SyncBatchNorm(CHANNELS), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 2),
    ).to(device)


def batch(step: int, rank: int):
    """Rank ``rank``'s batch at ``step``: its own values, and its own size (8, 6, ...)."""
    data = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8 - 2 * rank, 3, 6, 6, generator=data) * 20 + 50  # a mean far from zero
    y = (x[:, 0].mean((1, 2)) > x[:, 1].mean((1, 2))).long()
    return x.to(device), y.to(device)


def kept(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the CPU, as it is now."""
    return t.detach().to("cpu", copy=True)


def sync_bns(model: nn.Module) -> List[nn.Module]:
    return [model.get_submodule(name) for name in BN_NAMES]


def stats_of(m: nn.Module) -> Dict[str, torch.Tensor]:
    master = _master.peek(m.running_mean, m.running_var)
    return dict(mean=kept(m.running_mean), var=kept(m.running_var), master=None if master is None else kept(master))


class Record:
    """Every call of the SyncBatchNorms: what went in and out, the stats after it, the gradients."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: List[Dict[str, Any]] = []
        for index, m in enumerate(sync_bns(model)):
            m.register_forward_pre_hook(lambda m, args, index=index: self._pre(index, m, args[0]))
            m.register_forward_hook(lambda m, args, out: self._post(out))

    def _pre(self, index: int, m: nn.Module, x: torch.Tensor) -> None:
        call = dict(bn=index, x=kept(x), weight=kept(m.weight), bias=kept(m.bias))
        self.calls.append(call)
        if x.requires_grad:
            x.register_hook(lambda g: call.__setitem__("grad_in", kept(g)))

    def _post(self, out: torch.Tensor) -> None:
        call = self.calls[-1]
        call["out"] = kept(out)
        if out.requires_grad:
            out.register_hook(lambda g: call.__setitem__("grad_out", kept(g)))

    def stats_after(self, model: nn.Module) -> None:
        for call in self.calls[-len(BN_NAMES):]:
            call.update(stats_of(sync_bns(model)[call["bn"]]))


def average_gradients(model: nn.Module) -> None:
    """What DDP does after backward (in FP32, whatever the parameters' dtype)."""
    world = dist.get_world_size()
    for p in model.parameters():
        grad = p.grad.float()
        dist.all_reduce(grad)
        p.grad.copy_(grad / world)


def step(model: nn.Module, record: Record, x: torch.Tensor, y: torch.Tensor, autocast_dtype: torch.dtype,
         optimizer: Optional[torch.optim.Optimizer]) -> None:
    with torch.autocast(device, dtype=autocast_dtype):
        loss = F.cross_entropy(model(x).float(), y)
    record.stats_after(model)
    if optimizer is not None:
        optimizer.zero_grad()
        loss.backward()
        average_gradients(model)
        optimizer.step()


# ---- scenarios --------------------------------------------------------------------------------


def fp32_model(rank: int) -> Dict[str, Any]:
    model = make_model()
    record = Record(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(STEPS):
        step(model, record, *batch(i, rank), torch.bfloat16, optimizer)
    return dict(calls=record.calls)


def half_model(rank: int) -> Dict[str, Any]:
    model = make_model().half()  # 16-bit buffers; the shim keeps their FP32 master (keep_fp32="master")
    record = Record(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(STEPS):
        x, y = batch(i, rank)
        step(model, record, x.half(), y, torch.float16, optimizer)
    final = [stats_of(m) for m in sync_bns(model)]
    model.float()
    as_float = [stats_of(m) for m in sync_bns(model)]
    return dict(calls=record.calls, final=final, as_float=as_float)


def nonfinite_batch(rank: int) -> Dict[str, Any]:
    model = make_model()
    record = Record(model)
    step(model, record, *batch(0, rank), torch.bfloat16, None)
    before = [stats_of(m) for m in sync_bns(model)]
    x, y = batch(1, rank)
    if rank == 1:
        x[0, 0, 0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, record, x, y, torch.bfloat16, None)
    return dict(calls=record.calls, before=before, after=[stats_of(m) for m in sync_bns(model)],
                guard_skips=amp_bn_fix.report(model)["guard_skips"],
                warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])


def broadcast_buffers(rank: int) -> Dict[str, Any]:
    """A half model's BatchNorm buffers broadcast from rank 0 (what DDP's ``broadcast_buffers`` does
    before each forward): a collective write no version counter sees."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3).bfloat16().to(device)
    for i in range(STEPS):  # each rank's own batches: the masters differ
        with torch.autocast(device, dtype=torch.bfloat16):
            bn(batch(i, rank)[0].bfloat16())
    dist.broadcast(bn.running_mean, 0)
    dist.broadcast(bn.running_var, 0)
    x = batch(0, 0)[0].bfloat16()  # one input on every rank
    bn.eval()
    eval_plain = bn(x)
    with torch.autocast(device, dtype=torch.bfloat16):
        eval_autocast = bn(x)
    return dict(buffers=stats_of(bn), eval_plain=kept(eval_plain), eval_autocast=kept(eval_autocast),
                master=kept(_master.peek(bn.running_mean, bn.running_var)))


SCENARIOS = {"fp32": fp32_model, "half": half_model, "nonfinite": nonfinite_batch, "broadcast": broadcast_buffers}


def run_scenario(name: str, rank: int) -> Dict[str, Any]:
    seen.clear()
    seen.update(stats=[], gathered_rows=[])
    before = amp_bn_fix.report()
    result = SCENARIOS[name](rank)
    after = amp_bn_fix.report()
    result["handled"] = {k: v - before["handled"].get(k, 0) for k, v in after["handled"].items()
                         if v != before["handled"].get(k, 0)}
    result["passed_through"] = after["passed_through"] - before["passed_through"]
    result["seen"] = dict(seen)
    dist.barrier()  # every rank done with one scenario before the next starts
    return result


def main(store: str, out_dir: pathlib.Path, rank: int, world_size: int, route: str) -> None:
    global device
    if route not in ROUTES:
        raise SystemExit(f"ROUTE must be one of {ROUTES}, not {route!r}")
    torch.set_num_threads(1)
    if route == "cuda":
        device = "cuda"
        torch.cuda.set_device(0)  # every rank on the one GPU
    else:
        install_cpu_sync()
    config = amp_bn_fix.get_config()
    results: Dict[str, Any] = dict(
        rank=rank,
        route=route,
        shim=dict(enabled=amp_bn_fix.is_enabled(), policy=config.policy, keep_fp32=config.keep_fp32,
                  guard=config.guard),
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with device_route() if route == "device-route" else contextlib.nullcontext():
            for name in SCENARIOS:
                results[name] = run_scenario(name, rank)
        torch.save(results, out_dir / f"rank{rank}.pt")
        # Both ranks done before either tears down: gloo aborts a rank whose peer hangs up mid-exchange.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
