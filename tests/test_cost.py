"""What a handled call costs a GPU, counted on CPU: kernels launched, bytes moved, bytes kept for backward.

Counted by ``amp_bn_fix.testing.count_kernels`` (each kernel's reads and writes, CUDA's launches per
op), which changes nothing about the route a call takes, on the route a CUDA call takes and on
the host route. The budgets are the project's: on a GPU a memory-bound op's time follows its
bytes, a small call's its launches. Timings live in the benchmark, not here.
"""

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

import amp_bn_fix
from amp_bn_fix import _guard, _tuning
from amp_bn_fix.testing import count_kernels, device_route, kept_for_backward

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _traffic import NATIVE, POLICIES, count_call  # noqa: E402

# 2**20 values: the device route's FP32 path at its real threshold (``_tuning.DEVICE_MIN_VALUES``).
LARGE = (16, 64, 32, 32)
TINY = (4, 16, 4, 4)
HALF = [torch.float16, torch.bfloat16]
HALF_IDS = ["fp16", "bf16"]

# Bytes moved per call against native's, the ``fp32`` policy on the device route, large calls. The
# floors for an FP32 output from a 16-bit input: read it for the statistics, read it again and
# write FP32 (8 of native's 6 bytes a value in training), read it and write FP32 in eval (6 of 4).
# With backward: CUDA's backward kernels take the incoming gradient only in the input's dtype, so
# an FP32 gradient goes through torch's FP32 backward on an upcast input (see ``_kernels``).
FP32_BYTES = {"train": 1.40, "fwdbwd": 2.55, "eval": 1.60}
# Launches beyond native's, large calls, FP32 model / half model. The guard (a joined copy, a
# reduction, a compare, two selects: one where the stats are a master's rows) is five of them in
# training; ``fp32``'s route adds the statistics op (two on CUDA) and the per-channel scale and
# shift. A half model's master adds its check against the buffers (four: a join, a compare, a
# reduction, a select) and its rounding into them, and ``input`` its weight's and bias's casts
# (``fp32`` reads them as they are).
LAUNCHES = {
    ("fp32", "train"): (9, 13), ("fp32", "fwdbwd"): (11, 18), ("fp32", "eval"): (2, 6),
    ("input", "train"): (5, 11), ("input", "fwdbwd"): (5, 13), ("input", "eval"): (0, 6),
}
# Small calls take the reference (an FP32 copy, torch's FP32 kernel): fewer launches, more bytes.
TINY_LAUNCHES = {
    ("fp32", "train"): (6, 12), ("fp32", "fwdbwd"): (7, 15), ("fp32", "eval"): (1, 7),
    ("input", "train"): (5, 11), ("input", "fwdbwd"): (5, 13), ("input", "eval"): (0, 6),
}


def launches_budget(policy, mode, half_model, table=LAUNCHES):
    return table[("input" if policy == "autocast" else policy, mode)][half_model]


@pytest.fixture
def real_thresholds(monkeypatch):
    """The device route's size threshold as shipped (conftest lowers it to 0 for small inputs)."""
    monkeypatch.setattr(_tuning, "DEVICE_MIN_VALUES", REAL_DEVICE_MIN_VALUES)


REAL_DEVICE_MIN_VALUES = _tuning.DEVICE_MIN_VALUES


@pytest.mark.parametrize("mode", ["train", "fwdbwd", "eval"])
@pytest.mark.parametrize("half_model", [False, True], ids=["fp32-model", "half-model"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_large_calls_on_the_device_route_hold_their_budgets(real_thresholds, dtype, policy, half_model, mode):
    assert torch.Size(LARGE).numel() >= _tuning.DEVICE_MIN_VALUES
    native = count_call(LARGE, dtype, NATIVE, mode, half_model)
    count = count_call(LARGE, dtype, policy, mode, half_model)
    budget = FP32_BYTES[mode] if policy == "fp32" else 1.01  # per-channel tensors: a few bytes a call
    assert count.moved <= budget * native.moved, (count.moved, native.moved, count.names())
    assert count.kept <= 1.1 * native.kept + 1e-3, (count.kept, native.kept)
    assert count.launches - native.launches <= launches_budget(policy, mode, half_model), (count.names(), native.names())
    assert "_local_scalar_dense" not in count.names()  # no read on the host: no wait for the GPU


@pytest.mark.parametrize("layout", ["NCHW", "channels_last"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_fp32_policy_makes_no_fp32_copy_of_the_input(real_thresholds, dtype, mode, layout):
    # The one FP32 tensor of the input's size a forward writes is its output.
    count = count_call(LARGE, dtype, "fp32", mode, channels_last=layout == "channels_last")
    values = torch.Size(LARGE).numel()
    assert [k.name for k in count.kernels if k.written >= 4 * values] == ["addcmul"], count.names()


@pytest.mark.parametrize("mode", ["train", "fwdbwd", "eval"])
@pytest.mark.parametrize("half_model", [False, True], ids=["fp32-model", "half-model"])
@pytest.mark.parametrize("policy", POLICIES)
def test_small_calls_keep_the_launches_of_the_reference(real_thresholds, policy, half_model, mode):
    assert torch.Size(TINY).numel() < _tuning.DEVICE_MIN_VALUES
    native = count_call(TINY, torch.bfloat16, NATIVE, mode, half_model)
    count = count_call(TINY, torch.bfloat16, policy, mode, half_model)
    budget = launches_budget(policy, mode, half_model, TINY_LAUNCHES)
    assert count.launches - native.launches <= budget, (count.names(), native.names())
    assert "_local_scalar_dense" not in count.names()


# Kernels beyond native's on the host route (CPU), by (policy, training, few channels). Up to
# LISTED_CHANNELS channels the guard reads the stats as Python floats (no kernel); beyond, a joined
# copy, a dot product and its read. ``fp32`` adds the reference's FP32 input copy.
HOST_LAUNCHES = {
    ("fp32", True, True): 1, ("input", True, True): 0, ("fp32", True, False): 4, ("input", True, False): 3,
    ("fp32", False, True): 1, ("input", False, True): 0, ("fp32", False, False): 1, ("input", False, False): 0,
}


@pytest.mark.parametrize("channels", [_guard.LISTED_CHANNELS // 2, _guard.LISTED_CHANNELS, 2 * _guard.LISTED_CHANNELS])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_small_call_on_the_host_route_adds_few_kernels(policy, mode, channels):
    native = count_call((4, channels, 4, 4), torch.bfloat16, NATIVE, mode, device="host")
    count = count_call((4, channels, 4, 4), torch.bfloat16, policy, mode, device="host")
    few = channels <= _guard.LISTED_CHANNELS
    budget = HOST_LAUNCHES[("input" if policy == "autocast" else policy, mode == "train", few)]
    assert count.launches - native.launches <= budget, (count.names(), native.names())


def test_the_counter_leaves_the_route_as_it_is():
    # Under a TorchDispatchMode the shim computes the traced form; its own counter is no tracer.
    bn = torch.nn.BatchNorm2d(4)
    x = torch.randn(2, 4, 8, 8).bfloat16()
    x[0, 0, 0, 0] = float("inf")
    before = bn.running_mean.clone()
    with device_route(), count_kernels() as traffic, torch.autocast("cpu", dtype=torch.bfloat16):
        bn(x)
    assert torch.equal(bn.running_mean, before)  # guarded
    # CUDA's statistics op (its CPU stand-in here), two kernels with running stats; no FP32 copy.
    assert "batch_norm_stats" in traffic.names() and "_to_copy" not in traffic.names()
    assert traffic.moved > 0 and traffic.launches == len(traffic.kernels) + 1


def test_the_count_follows_cuda_kernels_rules():
    # Native training: statistics, update, normalization (3 launches), the input read twice.
    x = torch.randn(8, 4, 16, 16).bfloat16()
    weight, bias, mean, var = torch.ones(4), torch.zeros(4), torch.zeros(4), torch.ones(4)
    with count_kernels() as traffic:
        torch.batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5, False)
    (kernel,) = traffic.kernels
    assert traffic.launches == 3 and kernel.read == 2 * x.numel() * 2 + 4 * 4 * 4 and kernel.written == x.numel() * 2 + 2 * 16
    # A view runs no kernel; an addcmul reads each operand once (a broadcast one by its distinct values).
    shift, scale = torch.zeros(4, 1, 1), torch.ones(4, 1, 1)
    with count_kernels() as traffic:
        y = torch.addcmul(shift, x.view(8, 4, 256).view(8, 4, 16, 16), scale)
    assert traffic.names() == ["addcmul"] and y.dtype is torch.float32
    assert traffic.kernels[0].read == x.numel() * 2 + 2 * 16 and traffic.kernels[0].written == x.numel() * 4


def test_the_counter_changes_nothing_autograd_does():
    # It saves nothing and hooks nothing: in-place checks, memory and torch.func work as without it.
    x = torch.ones(3, requires_grad=True)
    a = x * 1
    with count_kernels():
        b = a.sin()
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    with count_kernels():
        y = torch.relu(torch.randn(100, requires_grad=True))
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None
    with count_kernels() as traffic:
        grad = torch.func.grad(lambda w: w.sin().sum())(torch.zeros(5))
    assert torch.equal(grad, torch.ones(5)) and traffic.kernels


def test_kept_for_backward_counts_each_saved_tensor_once():
    bn = torch.nn.BatchNorm2d(4)
    x = torch.randn(8, 4, 16, 16).bfloat16().requires_grad_()
    amp_bn_fix.disable()
    try:
        native = kept_for_backward(bn(x))
        by_hand = kept_for_backward(bn(x.float()))
    finally:
        amp_bn_fix.enable()
    # The input (2 bytes a value), or its FP32 copy (4), and a few per-channel tensors.
    assert 2 * x.numel() <= native < 2 * x.numel() + 256 and 4 * x.numel() <= by_hand < 4 * x.numel() + 256


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_inference_mode_counts_what_no_grad_counts(fresh_record, training):
    # Under inference_mode the composite ops (``to``, ``reshape``, ``batch_norm``) reach the counter
    # whole, where autograd has not decomposed them: they count as their ops do elsewhere.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).train(training)
    x = torch.randn(4, 3, 16, 16)
    counted = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), device_route(), count_kernels() as traffic, torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
            x.reshape(4, 3, 256).transpose(1, 2).contiguous()
        counted.append([(k.name, k.read, k.written, k.launches) for k in traffic.kernels])
    assert counted[0] == counted[1]
    assert "_to_copy" in counted[0][0][0] and "clone" in [k[0] for k in counted[0]]


def test_aten_batch_norm_stats_counts_one_kernel():
    # SyncBatchNorm's statistics op, ``aten::batch_norm_stats(input, eps)``, is one kernel on CUDA:
    # its second argument is eps, not running stats (the route's own statistics op takes those).
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::batch_norm_stats", "CPU"):
        pytest.skip("this build has a CPU kernel of its own")
    library = torch.library.Library("aten", "IMPL")  # a CPU stand-in, for this test only

    def stand_in(x, eps):
        var, mean = torch.var_mean(x, [0, 2, 3], correction=0)
        return mean, torch.rsqrt(var + eps)

    library.impl("batch_norm_stats", stand_in, "CPU")
    try:
        with count_kernels() as traffic:
            torch.batch_norm_stats(torch.randn(8, 4, 4, 4), 1e-5)
    finally:
        library._destroy()
    assert [(k.name, k.launches) for k in traffic.kernels if k.name == "batch_norm_stats"] == [("batch_norm_stats", 1)]


class _SavesNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a, None)
        return a * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.skipif(not hasattr(torch._C._autograd.SavedTensor, "unpack_hook"),
                    reason="this torch's SavedTensor does not show what saved-tensor hooks packed")
@pytest.mark.parametrize("tail", ["linear", "indexed", "function-saving-none"])
def test_kept_for_backward_unpacks_no_checkpoint(tail):
    # Reading what a checkpointed region saved must not run it again: its BatchNorm's running
    # stats would take a second update per saved tensor read. Nodes whose saved lists hold an
    # undefined entry too (an index op's optional indices, a None saved by a Function) included.
    from torch.utils.checkpoint import checkpoint

    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    last = {"linear": lambda y: y, "indexed": lambda y: y[:, torch.tensor([0, 2])],
            "function-saving-none": _SavesNone.apply}[tail]
    x = torch.randn(8, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(lambda a: last(block(a)), x, use_reentrant=False)
    stats = block[1].running_mean.clone(), int(block[1].num_batches_tracked)
    kept = kept_for_backward(y)
    assert torch.equal(block[1].running_mean, stats[0]) and int(block[1].num_batches_tracked) == stats[1]
    assert kept < x.numel() * 4  # a checkpoint keeps holders, no activations
    y.float().sum().backward()  # the one recompute, in the backward
    assert int(block[1].num_batches_tracked) == stats[1] + 1


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_operands_count_their_indices_and_values(layout):
    # A graph network's adjacency matmul in a counted step: a sparse tensor has no strides and
    # no data pointer; it moves its indices and values.
    dense = torch.zeros(64, 64)
    dense[torch.arange(64), (torch.arange(64) * 7) % 64] = 1.0
    adjacency = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    parts = ((adjacency._indices(), adjacency._values()) if layout == "coo"
             else (adjacency.crow_indices(), adjacency.col_indices(), adjacency.values()))
    sparse_bytes = sum(p.numel() * p.element_size() for p in parts)
    x = torch.randn(64, 8, requires_grad=True)
    with count_kernels() as traffic:
        y = adjacency @ x
    assert traffic.kernels and traffic.kernels[0].read == sparse_bytes + x.numel() * 4
    kept = kept_for_backward(y)
    assert sparse_bytes <= kept <= sparse_bytes + x.numel() * 4
