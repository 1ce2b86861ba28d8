"""The fast paths compute what the simple FP32 reference computes.

Every handled call is checked against an fp64 computation and against the simple reference
``F.batch_norm(x.float(), ...)`` run on the unpatched original: forward output, running stats and
the gradients of input, weight and bias, over module kinds, memory layouts, train/eval, affine or
not, tracked stats or not, half weights, float16/bfloat16 and every policy. A half-precision
result may differ from the reference only by the one rounding of an FP32 value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F

import amp_bn_fix
from amp_bn_fix import _kernels, _tuning
from amp_bn_fix.testing import count_kernels

from _bounds import (assert_near, assert_no_less_accurate, assert_within, batch_norm_scales, fp32_bound,
                     rounding_bound)
from _builders import channels_last, fp64_batch_norm
from _shared import ORIGINAL, compare_outcomes, outcome

HALF = [torch.float16, torch.bfloat16]
HALF_IDS = ["fp16", "bf16"]
POLICIES = ["fp32", "input", "autocast"]
CHANNELS = 6


@dataclasses.dataclass
class Case:
    """One ``F.batch_norm`` call: its tensors and flags."""

    x: torch.Tensor
    running_mean: Optional[torch.Tensor]
    running_var: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    training: bool
    momentum: float = 0.1
    eps: float = 1e-5
    # How the output's gradient is laid out (see ``output_gradient``).
    grad_layout: str = "contiguous"

    def leaves(self) -> List[torch.Tensor]:
        return [t for t in (self.x, self.weight, self.bias) if t is not None]


def make_input(shape, dtype: torch.dtype, layout: str, seed: int = 0) -> torch.Tensor:
    """A half input with a non-zero mean (so the statistics' precision matters) in ``layout``."""
    g = torch.Generator().manual_seed(seed)
    if layout == "permuted":
        # Dense with its dimensions reversed: an (N, L, C) batch transposed for a BatchNorm1d, say.
        reversed_dims = tuple(reversed(range(len(shape))))
        return (torch.randn(tuple(reversed(shape)), generator=g) * 3 + 5).to(dtype).permute(*reversed_dims)
    if layout == "noncontiguous":
        # Every other element of the last dim: strided, neither contiguous nor channels_last.
        wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3 + 5
        return wide.to(dtype)[..., ::2]
    x = (torch.randn(*shape, generator=g) * 3 + 5).to(dtype)
    return channels_last(x) if layout == "channels_last" else x


def make_case(shape, dtype, layout, training, affine, stats, param_dtype=torch.float32) -> Case:
    g = torch.Generator().manual_seed(1)
    x = make_input(shape, dtype, layout).requires_grad_()
    channels = shape[1]
    weight = bias = running_mean = running_var = None
    if affine:
        weight = (torch.rand(channels, generator=g) + 0.5).to(param_dtype).requires_grad_()
        bias = torch.randn(channels, generator=g).to(param_dtype).requires_grad_()
    if stats:
        running_mean = torch.randn(channels, generator=g) + 5
        running_var = torch.rand(channels, generator=g) * 9 + 1
    return Case(x, running_mean, running_var, weight, bias, training)


def run(case: Case, fn: Callable, cast: Callable[[torch.Tensor], torch.Tensor], grad_dtype: torch.dtype):
    """Forward and backward of ``fn`` on ``cast`` of the case's tensors.

    The output gradient holds values of ``grad_dtype`` (the shim's output dtype), so every run
    differentiates the same function at the same point. Returns the output, the updated running
    stats and the gradients of input/weight/bias.
    """
    def prep(t):
        return None if t is None else cast(t.detach()).requires_grad_(t.requires_grad)

    x, weight, bias = prep(case.x), prep(case.weight), prep(case.bias)
    stats = [None if s is None else cast(s.clone()) for s in (case.running_mean, case.running_var)]
    out = fn(x, stats[0], stats[1], weight, bias, case.training, case.momentum, case.eps)
    grad_out = output_gradient(out.shape, case.grad_layout, grad_dtype)
    leaves = [t for t in (x, weight, bias) if t is not None]
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype)) if out.numel() else [None] * len(leaves)
    return out, stats, list(grads)


def output_gradient(shape, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A seeded gradient for an output of ``shape``, laid out as the op after a BatchNorm leaves it:
    ``contiguous``; ``channels_last``; ``permuted`` (a transpose after it, as in Conv1d -> BatchNorm1d
    -> transpose -> Linear); ``expanded`` (a mean or sum over the batch after it: stride 0)."""
    g = torch.Generator().manual_seed(2)
    if layout == "expanded":
        return torch.randn((1, *shape[1:]), generator=g).to(dtype).expand(shape)
    if layout == "permuted":
        return torch.randn(tuple(reversed(shape)), generator=g).to(dtype).permute(*reversed(range(len(shape))))
    grad = torch.randn(shape, generator=g).to(dtype)
    return channels_last(grad) if layout == "channels_last" else grad


def shim(case: Case, autocast_dtype: Optional[torch.dtype]):
    """The patched ``F.batch_norm`` on the case's own tensors (running stats updated in place)."""
    def fn(*args):
        if autocast_dtype is None:
            return F.batch_norm(*args)
        with torch.autocast("cpu", dtype=autocast_dtype):
            return F.batch_norm(*args)

    return fn


def fp64(t: torch.Tensor) -> torch.Tensor:
    return t.double()


def fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def expected_dtype(policy: str, input_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype]) -> torch.dtype:
    if autocast_dtype is None or policy == "input":
        return input_dtype
    return torch.float32 if policy == "fp32" else autocast_dtype


def check_case(case: Case, policy: str, autocast_dtype: Optional[torch.dtype], route: str = "host") -> None:
    """Run ``case`` through the shim and check it against the fp64 and the simple FP32 references.

    On the ``device`` route an FP32 output is computed from the 16-bit input, never by torch's
    FP32 kernel on a copy of it (checked by the kernels that ran).

    Each result is the float64 one computed in FP32 over a channel's values, then rounded once to
    its dtype (``_bounds.assert_near``; its bound is relative to the result's magnitude, which
    statistics rounded to 16 bits exceed, even for a mean far from zero relative to the spread).
    The simple reference meets that bound too, so the two are within twice the bound of each other.
    """
    amp_bn_fix.set_policy(policy)
    out_dtype = expected_dtype(policy, case.x.dtype, autocast_dtype)
    with count_kernels() as traffic:
        out, stats, grads = run(case, shim(case, autocast_dtype), cast=lambda t: t, grad_dtype=out_dtype)
    if route == "device" and out_dtype is torch.float32:
        assert not {"native_batch_norm", "_native_batch_norm_legit"} & set(traffic.names()), traffic.names()
    ref_out, ref_stats, ref_grads = run(case, ORIGINAL, cast=fp64, grad_dtype=out_dtype)
    # The simple reference, what a careful user writes: everything FP32, result cast to the policy's dtype.

    def simple_fn(*args):
        return ORIGINAL(*args).to(out_dtype)

    simple = run(case, simple_fn, cast=fp32, grad_dtype=out_dtype)
    n = max(case.x.numel() // case.x.shape[1], 1)

    def check(actual, simple_actual, exact, what):
        assert actual.dtype is simple_actual.dtype
        assert_near(actual, exact, n, what=what)
        assert_within(actual, simple_actual, 2 * fp32_bound(exact, n, actual.dtype), what=f"{what} (simple)")

    assert out.dtype is out_dtype
    # Laid out as torch's kernel lays out its own, the strides of size-1 dimensions included (a
    # convolution after it reads them; a ``.view()`` after it works as there).
    assert out.stride() == simple[0].stride(), (out.stride(), simple[0].stride())
    check(out, simple[0], ref_out, "output")

    for stat, ref, simple_stat, given in zip(stats, ref_stats, simple[1], (case.running_mean, case.running_var)):
        if given is None:
            continue
        assert stat.dtype is torch.float32
        check(stat, simple_stat, ref, "running stat")

    for grad, ref, simple_grad, leaf in zip(grads, ref_grads, simple[2], case.leaves()):
        assert grad.dtype is leaf.dtype
        if not grad.numel():
            continue
        check(grad, simple_grad.to(leaf.dtype), ref, "gradient")


SHAPES = {
    "bn1d-2d": (32, CHANNELS),
    "bn1d-3d": (8, CHANNELS, 7),
    "bn2d": (4, CHANNELS, 16, 16),  # rows of 256 values: the FP32 training fast path
    "bn2d-short-rows": (4, CHANNELS, 3, 3),  # rows of 9 values: the reference path
    "bn2d-1x1": (16, CHANNELS, 1, 1),  # contiguous and channels_last at once
    "bn3d": (2, CHANNELS, 3, 4, 4),
}


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
# Evaluation without running stats is an error (see the error tests).
@pytest.mark.parametrize("training, stats", [(True, True), (True, False), (False, True)],
                         ids=["train-stats", "train-nostats", "eval-stats"])
def test_every_shape_policy_and_flag_matches_the_references(both_routes, dtype, policy, shape, affine, training, stats):
    check_case(make_case(shape, dtype, "contiguous", training, affine, stats), policy, dtype, both_routes)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", ["channels_last", "noncontiguous", "permuted"])
@pytest.mark.parametrize("shape", [SHAPES["bn1d-3d"], SHAPES["bn2d"], SHAPES["bn3d"]], ids=["bn1d-3d", "bn2d", "bn3d"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_memory_layouts_match_the_references(both_routes, dtype, policy, layout, shape, training):
    case = make_case(shape, dtype, layout, training, affine=True, stats=True)
    check_case(case, policy, dtype, both_routes)


# Torch's CPU mixed-dtype backward sums in the input's dtype when the gradient suggests another
# memory format than the input: each kind of gradient an op after BatchNorm leaves, against each
# input layout, and the shapes where contiguous and channels_last strides differ only in size-1
# dimensions (a flatten after AdaptiveAvgPool2d(1) in a channels_last net; one channel).
GRADIENT_LAYOUTS = {
    "contiguous-channels_last": ((4, CHANNELS, 16, 16), "contiguous", "channels_last", True),
    "contiguous-permuted": ((4, CHANNELS, 16, 16), "contiguous", "permuted", True),
    "contiguous-expanded": ((4, CHANNELS, 16, 16), "contiguous", "expanded", True),
    "channels_last-contiguous": ((4, CHANNELS, 16, 16), "channels_last", "contiguous", True),
    "channels_last-permuted-eval": ((4, CHANNELS, 16, 16), "channels_last", "permuted", False),
    "3d-contiguous-channels_last": ((2, CHANNELS, 3, 4, 4), "contiguous", "channels_last", True),
    "3d-channels_last-expanded": ((2, CHANNELS, 3, 4, 4), "channels_last", "expanded", True),
    "1x1-channels_last-contiguous": ((16, CHANNELS, 1, 1), "channels_last", "contiguous", True),
    "1x1-contiguous-channels_last-eval": ((16, CHANNELS, 1, 1), "contiguous", "channels_last", False),
    "one-channel-channels_last-contiguous": ((4, 1, 8, 8), "channels_last", "contiguous", True),
}


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape, layout, grad_layout, training", list(GRADIENT_LAYOUTS.values()),
                         ids=list(GRADIENT_LAYOUTS))
def test_gradient_layouts_match_the_references(both_routes, dtype, policy, shape, layout, grad_layout, training):
    case = make_case(shape, dtype, layout, training, affine=True, stats=True)
    case.grad_layout = grad_layout
    check_case(case, policy, dtype, both_routes)


@pytest.mark.parametrize("policy", ["input", "autocast"])
def test_batched_gradients_of_a_channels_last_input(both_routes, policy):
    # is_grads_batched (torch.autograd.functional.jacobian's vectorize=True) runs the backward under
    # vmap: the gradient-layout hook leaves a batched gradient as it is.
    amp_bn_fix.set_policy(policy)
    case = make_case((4, CHANNELS, 5, 5), torch.bfloat16, "channels_last", True, affine=True, stats=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.batch_norm(case.x, None, None, case.weight, case.bias, True)
    grads = torch.randn(3, *out.shape, generator=torch.Generator().manual_seed(6)).to(out.dtype)
    batched = torch.autograd.grad(out, case.leaves(), grads, is_grads_batched=True, retain_graph=True)
    looped = [torch.stack(g) for g in zip(*(torch.autograd.grad(out, case.leaves(), grad, retain_graph=True)
                                            for grad in grads))]
    for one, other in zip(batched, looped):
        assert_within(one, other, rounding_bound(other.abs().max().item(), {torch.bfloat16: 8}))


def test_the_output_takes_hooks_of_its_own_as_in_torch():
    # The shim's gradient hook sits where Tensor.register_hook keeps hooks: a user's hook joins it,
    # on that output alone, runs once per backward and can be removed.
    amp_bn_fix.set_policy("input")
    x = make_input(SHAPES["bn2d"], torch.bfloat16, "contiguous")
    weight = torch.ones(CHANNELS, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first, second = (F.batch_norm(x, None, None, weight, None, True) for _ in range(2))
    seen = []
    handle = first.register_hook(lambda grad: seen.append(grad.is_contiguous()))
    grad = output_gradient(first.shape, "permuted", torch.bfloat16)
    first.backward(grad, retain_graph=True)
    second.backward(grad)
    assert seen == [True]  # the user's hook, on the first output only, after the shim's
    handle.remove()
    first.backward(grad)
    assert seen == [True]


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("shape", [SHAPES["bn1d-3d"], SHAPES["bn1d-2d"]], ids=["bn1d-3d", "bn1d-2d"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_transpose_after_batch_norm_1d_matches_the_references(both_routes, dtype, shape, policy):
    # Conv1d -> BatchNorm1d -> transpose -> Linear: the gradient comes back transposed.
    case = make_case(shape, dtype, "contiguous", training=True, affine=True, stats=True)
    case.grad_layout = "permuted"
    check_case(case, policy, dtype, both_routes)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "mixed-call-outside-autocast"])
def test_half_weights_match_the_references_and_get_half_grads(both_routes, dtype, policy, training, autocast):
    # Half weights with FP32 stats: outside autocast the native kernel rejects the mix; the shim
    # computes it in FP32 either way.
    case = make_case(SHAPES["bn2d"], dtype, "contiguous", training, affine=True, stats=True, param_dtype=dtype)
    check_case(case, policy, dtype if autocast else None, both_routes)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_autocast_dtype_other_than_the_input_dtype(policy, training):
    case = make_case(SHAPES["bn2d"], torch.float16, "contiguous", training, affine=True, stats=True)
    check_case(case, policy, autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stats", [True, False], ids=["stats", "nostats"])
def test_large_mean_small_spread_keeps_fp32_statistics(both_routes, dtype, policy, stats):
    # A mean far from zero relative to the spread: statistics rounded to half would be visibly off.
    case = make_case(SHAPES["bn2d"], dtype, "contiguous", training=True, affine=False, stats=stats)
    x = (torch.randn(SHAPES["bn2d"], generator=torch.Generator().manual_seed(3)) * 0.5 + 300).to(dtype)
    case.x = x.requires_grad_()
    # FP32 statistics leave an error of about 1e-4 here; half-precision ones would leave 0.1 to 1.
    check_case(case, policy, dtype, both_routes)


# --- what the fast paths avoid -------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", ["input", "autocast"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_half_output_policies_never_copy_the_input_to_fp32(dtype, policy, training):
    amp_bn_fix.set_policy(policy)
    case = make_case(SHAPES["bn2d"], dtype, "contiguous", training, affine=True, stats=True)
    grad = torch.ones(case.x.shape, dtype=dtype)
    with count_kernels() as traffic, torch.autocast("cpu", dtype=dtype):
        out = F.batch_norm(case.x, case.running_mean, case.running_var, case.weight, case.bias, training)
        out.backward(grad)
    assert out.dtype is dtype
    # An FP32 copy of the input (or of its gradient) is a kernel writing 4 bytes a value.
    assert not [k.name for k in traffic.kernels if k.written >= 4 * case.x.numel()]


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_fp32_policy_training_takes_its_statistics_from_the_half_input(dtype):
    # The FP32 training kernel on a float copy of the input is the slow reference path.
    case = make_case(SHAPES["bn2d"], dtype, "contiguous", True, affine=True, stats=True)
    with count_kernels() as traffic, torch.autocast("cpu", dtype=dtype):
        out = F.batch_norm(case.x, case.running_mean, case.running_var, case.weight, case.bias, True)
    assert out.dtype is torch.float32
    assert "native_batch_norm" not in traffic.names()
    # The statistics read the input once, as 16 bits: 2 bytes a value (and a few scratch stats).
    stats_read = [k.read for k in traffic.kernels if k.name == "batch_norm_update_stats"]
    assert stats_read and 2 * case.x.numel() <= sum(stats_read) < 2.5 * case.x.numel()


# The real size thresholds (the tests' conftest lowers them to 0 for their small inputs), read at
# collection, before any fixture runs.
REAL_MIN_VALUES, REAL_MIN_PER_CHANNEL = _tuning.MIN_VALUES, _tuning.MIN_PER_CHANNEL


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count for one test, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _fp32_training_call(shape, seed=4):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + 2).bfloat16()
    running_mean, running_var = torch.zeros(shape[1]), torch.ones(shape[1])
    with count_kernels() as traffic, torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.batch_norm(x, running_mean, running_var, training=True)
    assert out.dtype is torch.float32
    fast = "batch_norm_update_stats" in traffic.names()
    return x, out, running_mean, running_var, fast


# What the tuning cannot change: rows (one sample, one channel) shorter than 32 values, or with no
# split into equal pieces of 32 to 1024 values, are never taken, at any size and thread count.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(512, 8, 3, 3), (64, 8, 31), (16, 4, 2062)], ids=["rows-of-9", "rows-of-31", "no-pieces"])
def test_fp32_fast_path_never_takes_rows_it_cannot_reduce_quickly(torch_threads, threads, shape):
    torch_threads(threads)
    x, out, running_mean, running_var, fast = _fp32_training_call(shape)
    assert not fast
    assert_as_accurate_as_the_fp32_kernel(x, out, running_mean, running_var)


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_fast_path_leaves_small_inputs_to_the_reference(monkeypatch, torch_threads, threads):
    # With the real thresholds, an input below them (whatever they are) takes the reference path.
    monkeypatch.setattr(_tuning, "MIN_VALUES", REAL_MIN_VALUES)
    monkeypatch.setattr(_tuning, "MIN_PER_CHANNEL", REAL_MIN_PER_CHANNEL)
    torch_threads(threads)
    channels = 4
    samples = max(2, min(_tuning.min_values(), REAL_MIN_PER_CHANNEL * channels) // (channels * 64) - 1)
    *_, fast = _fp32_training_call((samples, channels, 64))
    assert not fast


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(8, 16, 14, 14), (2, 4, 4096), (16, 8, 6, 6)], ids=["2d", "long-rows", "short-rows"])
def test_the_fast_path_changes_no_result_beyond_the_bound(monkeypatch, torch_threads, threads, shape):
    torch_threads(threads)
    x, fast_out, fast_mean, fast_var, fast = _fp32_training_call(shape)
    assert fast  # thresholds at 0 (conftest): the fast path takes these shapes
    monkeypatch.setattr(_tuning, "MIN_VALUES", 1 << 62)  # no input is that large
    x, ref_out, ref_mean, ref_var, fast = _fp32_training_call(shape)
    assert not fast
    assert_as_accurate_as_the_fp32_kernel(x, fast_out, fast_mean, fast_var)
    assert_as_accurate_as_the_fp32_kernel(x, ref_out, ref_mean, ref_var)


def assert_as_accurate_as_the_fp32_kernel(x, out, running_mean, running_var):
    """The fast path's training call on ``x`` (stats from zeros and ones) against float64, next to
    ``F.batch_norm(x.float(), ...)``'s own error: the FP32 kernel accumulates a channel in double,
    so its error is a few roundings; a float accumulation over long rows or a whole channel is
    10 to 100 times that. Each is measured against float64; the fast path may be a few roundings
    worse than the kernel, never a long float sum worse."""
    channels = x.shape[1]
    ref = fp64_batch_norm(x, torch.zeros(channels), torch.ones(channels))
    mean32, var32 = torch.zeros(channels), torch.ones(channels)
    kernel = ORIGINAL(x.float(), mean32, var32, training=True)
    for ours, theirs, exact in ((out, kernel, ref.out), (running_mean, mean32, ref.running_mean),
                                (running_var, var32, ref.running_var)):
        assert_no_less_accurate(ours, theirs, exact)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("length", [1024, 3136, 65536])
def test_fp32_policy_long_rows_keep_fp32_accuracy(dtype, length):
    # A float accumulation over whole rows of 65536 values around a mean of 3 is off by 2e-6
    # (relative, output); the FP32 kernel's error, and the fast path's with rows split, is ~1e-7.
    x = (torch.randn(2, CHANNELS, length, generator=torch.Generator().manual_seed(5)) + 3).to(dtype)
    running_mean, running_var = torch.zeros(CHANNELS), torch.ones(CHANNELS)
    with count_kernels() as traffic, torch.autocast("cpu", dtype=dtype):
        out = F.batch_norm(x, running_mean, running_var, training=True)
    assert "batch_norm_update_stats" in traffic.names()  # the fast path ran
    assert_as_accurate_as_the_fp32_kernel(x, out, running_mean, running_var)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize(("mean", "spread", "seed"), [(1000.0, 10.0, 6), (30.0, 1.0, 3)], ids=["100-spreads", "30-spreads"])
def test_fp32_policy_statistics_keep_fp32_accuracy_on_every_route(both_routes, dtype, mean, spread, seed):
    # A mean tens of spreads from zero over 65536 values per channel: a float sum of the channel
    # (CPU's statistics op, and the mixed kernel's and native autocast's accumulation) is off by
    # ~1e-5 at 30 spreads and 60 times the FP32 kernel's error at 100; CUDA's (Welford) and the
    # route's stand-in for it on CPU are not.
    x = (mean + spread * torch.randn(16, 4, 64, 64, generator=torch.Generator().manual_seed(seed))).to(dtype)
    running_mean, running_var = torch.zeros(4), torch.ones(4)
    with torch.autocast("cpu", dtype=dtype):
        out = F.batch_norm(x, running_mean, running_var, training=True)
    assert out.dtype is torch.float32
    assert_as_accurate_as_the_fp32_kernel(x, out, running_mean, running_var)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("rank", [3, 4, 5])
def test_fp32_policy_training_saves_only_the_half_input_for_backward(dtype, rank):
    # An FP32 copy of the input would double what is held from forward to backward.
    shape = {3: (4, CHANNELS, 256), 4: SHAPES["bn2d"], 5: (2, CHANNELS, 4, 8, 8)}[rank]
    case = make_case(shape, dtype, "contiguous", True, affine=True, stats=True)
    saved = []
    with count_kernels() as traffic, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                              lambda t: t):
        with torch.autocast("cpu", dtype=dtype):
            out = F.batch_norm(case.x, case.running_mean, case.running_var, case.weight, case.bias, True)
    assert "batch_norm_update_stats" in traffic.names()  # the fast path ran
    large = [t for t in saved if t.numel() == case.x.numel()]
    assert large and all(t.dtype is dtype for t in large)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    assert case.x.grad.dtype is dtype and torch.isfinite(case.x.grad).all()


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("shape", [(9, CHANNELS, 256), (9, CHANNELS, 16, 16), (9, CHANNELS, 4, 8, 8)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("mean", [0.0, 300.0], ids=["centred", "large-mean"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_policy_chunked_forward_and_backward_match_the_references(monkeypatch, torch_threads, threads, dtype,
                                                                      shape, affine, mean):
    # Chunks of 2 samples per thread out of 9 (the last one shorter): the forward and backward of
    # large inputs, made small.
    monkeypatch.setattr(_tuning, "CHUNK", 2 * math.prod(shape[1:]))
    torch_threads(threads)
    assert len(_kernels._chunks(torch.empty(shape))) == -(-9 // (2 * threads))
    calls = []
    chunked = _kernels._backward_in_chunks
    monkeypatch.setattr(_kernels, "_backward_in_chunks", lambda *args: calls.append(1) or chunked(*args))
    case = make_case(shape, dtype, "contiguous", True, affine=affine, stats=True)
    if mean:
        # As in the large-mean test above: the FP32 computation's own error is about 1e-4 here.
        x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.5 + mean
        case.x = x.to(dtype).requires_grad_()
    check_case(case, "fp32", autocast_dtype=dtype)
    assert calls


# --- edge cases and errors -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_empty_batch_behaves_as_the_original(dtype, policy, training):
    amp_bn_fix.set_policy(policy)
    case = make_case((0, CHANNELS, 3, 3), dtype, "contiguous", training, affine=True, stats=True)
    stats = [case.running_mean.clone(), case.running_var.clone()]
    with torch.autocast("cpu", dtype=dtype):
        out = F.batch_norm(case.x, *stats, case.weight, case.bias, training)
    ref_stats = [case.running_mean.clone(), case.running_var.clone()]
    ref = ORIGINAL(case.x.float(), *ref_stats, case.weight, case.bias, training)
    assert out.shape == ref.shape and out.dtype is expected_dtype(policy, dtype, dtype)
    for stat, ref_stat in zip(stats, ref_stats):
        torch.testing.assert_close(stat, ref_stat, rtol=0, atol=0)
    out.sum().backward()
    assert case.x.grad.shape == case.x.shape


def error_calls():
    x = make_input((4, CHANNELS, 3, 3), torch.bfloat16, "contiguous")
    one = make_input((1, CHANNELS), torch.bfloat16, "contiguous")
    stats = (torch.zeros(CHANNELS), torch.ones(CHANNELS))
    w, b = torch.ones(CHANNELS), torch.zeros(CHANNELS)
    return {
        "eps-zero-train": (x, *stats, w, b, True, 0.1, 0.0),
        "eps-negative-train": (x, *stats, w, b, True, 0.1, -1e-5),
        "eps-negative-eval": (x, *stats, w, b, False, 0.1, -1e-5),
        "one-value-per-channel": (one, *stats, w, b, True, 0.1, 1e-5),
        "one-value-per-channel-nostats": (one, None, None, w, b, True, 0.1, 1e-5),
        "eval-without-stats": (x, None, None, w, b, False, 0.1, 1e-5),
        "wrong-stat-size": (x, torch.zeros(CHANNELS + 1), torch.ones(CHANNELS + 1), w, b, True, 0.1, 1e-5),
        "wrong-weight-size": (x, *stats, torch.ones(CHANNELS + 1), b, True, 0.1, 1e-5),
        "mean-without-var": (x, stats[0], None, w, b, True, 0.1, 1e-5),
        "one-dim-input": (x.flatten(), None, None, None, None, True, 0.1, 1e-5),
    }


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(error_calls()))
def test_invalid_calls_raise_the_originals_error(policy, name):
    amp_bn_fix.set_policy(policy)
    args = error_calls()[name]
    # Older torch accepts some of these (eps <= 0 on 2.4 to 2.8, running_mean without running_var
    # on 2.4 and 2.6): the shim must accept them too, and compute what the original computes.
    theirs = outcome(ORIGINAL, args, input_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = outcome(F.batch_norm, args)
    x = args[0]
    compare_outcomes(ours, theirs, lambda: outcome(ORIGINAL, args, dtype=torch.float64),
                     n=x.numel() // x.shape[1] if x.dim() > 1 else 1)


# --- the guard on the fast paths -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")  # tests/test_record.py checks it
@pytest.mark.parametrize("policy", POLICIES)
def test_guard_keeps_stats_on_a_non_finite_batch_through_the_fast_paths(policy):
    amp_bn_fix.set_policy(policy)
    case = make_case(SHAPES["bn2d"], torch.float16, "contiguous", True, affine=True, stats=True)
    x = case.x.detach().clone()
    x[0, 0, 0, 0] = float("inf")
    before = [case.running_mean.clone(), case.running_var.clone()]
    mean, var = case.running_mean, case.running_var
    with torch.autocast("cpu", dtype=torch.float16):
        F.batch_norm(x, mean, var, case.weight, case.bias, True)
    assert mean is case.running_mean and var is case.running_var
    assert torch.equal(mean, before[0]) and torch.equal(var, before[1])
    with torch.autocast("cpu", dtype=torch.float16):
        F.batch_norm(case.x, mean, var, case.weight, case.bias, True)
    # A finite batch updates them, as the float64 reference does.
    ref = fp64_batch_norm(case.x, *before, case.weight, case.bias)
    n = case.x.numel() // CHANNELS
    assert_near(mean, ref.running_mean, n, what="running mean")
    assert_near(var, ref.running_var, n, what="running var")


# --- double backward and torch.compile --------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_fp32_policy_double_backward_matches_the_reference(dtype):
    case = make_case(SHAPES["bn2d"], dtype, "contiguous", True, affine=True, stats=False)

    gen = torch.Generator().manual_seed(4)
    r1, r2 = torch.randn(case.x.shape, generator=gen), torch.randn(case.x.shape, generator=gen)

    def grad_norm(fn, cast):
        # The gradient of a random projection of the input gradient: a second-order quantity.
        x, w, b = (cast(t.detach()).requires_grad_() for t in (case.x, case.weight, case.bias))
        out = fn(x, w, b)
        gx, = torch.autograd.grad((out * cast(r1)).sum(), x, create_graph=True)
        return torch.autograd.grad((gx * cast(r2).to(gx.dtype)).sum(), (x, w))

    def ours(x, w, b):
        with torch.autocast("cpu", dtype=dtype):
            return F.batch_norm(x, None, None, w, b, True)

    got = grad_norm(ours, lambda t: t)
    ref = grad_norm(lambda x, w, b: ORIGINAL(x.float(), None, None, w, b, True), lambda t: t)
    exact = grad_norm(lambda x, w, b: ORIGINAL(x, None, None, w, b, True), fp64)
    for g, r, e in zip(got, ref, exact):
        assert g.dtype is r.dtype
        scale = e.abs().max().item()
        assert scale > 0
        # The input gradient is rounded to half on the way: agreement to a few half-precision roundings.
        bound = rounding_bound(scale, {dtype: 16})
        assert_within(g, e, bound, what="against float64")
        assert_within(g, r, bound, what="against the FP32 kernel")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_forward_and_backward_match_eager(backend, policy):
    torch._dynamo.reset()
    amp_bn_fix.configure(policy=policy)
    case = make_case(SHAPES["bn2d"], torch.bfloat16, "contiguous", True, affine=True, stats=True)

    def step(x, mean, var, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.batch_norm(x, mean, var, w, b, True)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    results = []
    for fn in (compiled, step):
        out, stats_out, grads = run(
            case, lambda x, m, v, w, b, *flags: fn(x, m, v, w, b), cast=lambda t: t, grad_dtype=torch.bfloat16
        )
        results.append((out, stats_out, grads))
    torch._dynamo.reset()
    exact = run(case, ORIGINAL, cast=fp64, grad_dtype=torch.bfloat16)
    # Compiled and eager code sum in different orders: each is compared with float64, at the
    # accuracy of FP32 sums over one channel (the reductions' magnitudes: see ``_bounds``).
    n = case.x.numel() // CHANNELS
    g = torch.randn(exact[0].shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    _, input_scale, param_scale = batch_norm_scales(case.x, case.weight, g, case.eps)
    for name, (out, stats, grads) in zip(("compiled", "eager"), results):
        assert out.dtype is expected_dtype(policy, torch.bfloat16, torch.bfloat16)
        assert_near(out, exact[0], n, what=f"{name} output")
        for stat, ref in zip(stats, exact[1]):
            assert_near(stat, ref, n, what=f"{name} running stat")
        for grad, ref, scale in zip(grads, exact[2], (input_scale, param_scale, param_scale)):
            assert_near(grad, ref.double(), n, scale=scale, what=f"{name} gradient")
