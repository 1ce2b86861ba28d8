"""A deterministic hypothesis fuzz of F.batch_norm calls, valid and invalid, against plain torch.

Calls the shim does not handle (FP32/FP64 inputs, no autocast and one dtype, the policy ``off``)
must be bitwise the unpatched function's, errors included. Handled calls (a 16-bit input under
autocast, or next to tensors of another dtype outside autocast) are compared with the same call in
float64: the same error when that one fails, else the output dtype the policy names and values and
running stats within FP32 accuracy, plus one rounding of the output.
"""

import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amp_bn_fix
from _bounds import assert_near, batch_norm_scales
from _shared import ORIGINAL

HALF = (torch.float16, torch.bfloat16)
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
FUZZ = settings(
    derandomize=True,
    max_examples=600,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def weighted(*pairs):
    """Sample ``value`` with relative weight ``count`` for each ``(value, count)``."""
    return st.sampled_from([value for value, count in pairs for _ in range(count)])


@st.composite
def calls(draw):
    ndim = draw(st.integers(2, 5))
    channels = draw(st.integers(1, 4))
    batch = draw(weighted((0, 1), (1, 1), (2, 3), (4, 3)))
    # Up to 12x12 per sample and channel: long enough rows for the CPU fast paths.
    spatial = [draw(st.integers(1, 12 if ndim == 4 else 6)) for _ in range(ndim - 2)]
    shape = (batch, channels, *spatial)
    layouts = [("contiguous", 4), ("strided", 1), ("expanded", 1)]
    if ndim == 4:
        layouts.append(("channels_last", 2))
    if ndim == 5:
        layouts.append(("channels_last_3d", 2))
    # Mostly valid calls; each kind of invalid one (wrong size, integer dtype, one stat only,
    # eps <= 0, one value per channel in training) often enough to be compared with torch's error.
    tensor_kinds = [("none", 2), ("input-dtype", 3), ("float32", 3), ("wrong-size", 1)]
    return {
        "shape": shape,
        "dtype": draw(weighted((torch.bfloat16, 3), (torch.float16, 3), (torch.float32, 1), (torch.float64, 1))),
        "layout": draw(weighted(*layouts)),
        "stats": draw(weighted(*tensor_kinds, ("int", 1), ("mean-only", 1))),
        "weight": draw(weighted(*tensor_kinds, ("int", 1))),
        "bias": draw(weighted(*tensor_kinds)),
        "training": draw(st.booleans()),
        "momentum": draw(weighted((0.1, 4), (0.0, 1), (1.0, 1), (0.5, 1), (-1.0, 1))),
        "eps": draw(weighted((1e-5, 4), (1e-3, 2), (0.5, 1), (0.0, 1), (-1.0, 1))),
        "policy": draw(st.sampled_from(["fp32", "input", "autocast", "off"])),
        "autocast": draw(weighted((None, 1), (torch.bfloat16, 2), (torch.float16, 2))),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_input(spec, gen):
    shape, dtype, layout = spec["shape"], spec["dtype"], spec["layout"]
    if layout == "expanded":  # one sample's values repeated along the batch (stride 0)
        return torch.randn((1, *shape[1:]), generator=gen).to(dtype).expand(shape)
    if layout == "strided":  # every other element of the last dimension
        wide = torch.randn((*shape[:-1], shape[-1] * 2), generator=gen).to(dtype)
        return wide[..., ::2]
    x = torch.randn(shape, generator=gen).to(dtype)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last_3d":
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x


def make_tensor(kind, channels, dtype, gen, low, high):
    if kind == "none":
        return None
    size = channels + 1 if kind == "wrong-size" else channels
    values = torch.rand(size, generator=gen) * (high - low) + low
    if kind == "int":
        return values.long()
    return values.to(torch.float32 if kind == "float32" else dtype)


def build(spec):
    gen = torch.Generator().manual_seed(spec["seed"])
    x = make_input(spec, gen)
    channels, dtype = spec["shape"][1], spec["dtype"]
    stats_kind = spec["stats"]
    mean = make_tensor("input-dtype" if stats_kind == "mean-only" else stats_kind, channels, dtype, gen, -1, 1)
    var = None if stats_kind == "mean-only" else make_tensor(stats_kind, channels, dtype, gen, 0.5, 2)
    weight = make_tensor(spec["weight"], channels, dtype, gen, 0.5, 1.5)
    bias = make_tensor(spec["bias"], channels, dtype, gen, -1, 1)
    return x, mean, var, weight, bias


def call(fn, spec, tensors, dtype=None, autocast=None):
    """``fn`` on copies of ``tensors`` (float ones cast to ``dtype``): ``(output, mean, var)`` or the error."""

    def copy(t):
        return None if t is None else t.to(dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True)

    x, mean, var, weight, bias = tensors
    mean, var, weight, bias = copy(mean), copy(var), copy(weight), copy(bias)
    if dtype is not None:
        x = x.to(dtype)
    try:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = fn(x, mean, var, weight, bias, spec["training"], spec["momentum"], spec["eps"])
    except Exception as exc:
        return type(exc), str(exc)
    return out, mean, var


def left_by_keep_stats(tensors):
    """FP32 running stats next to weight and bias in the input's dtype: what torch's kernels reject."""
    x, mean, var, weight, bias = tensors
    return (
        mean is not None and var is not None and mean.dtype is var.dtype is torch.float32
        and (weight is not None or bias is not None)
        and all(t is None or t.dtype is x.dtype for t in (weight, bias))
    )


def handled(spec, tensors):
    """Whether the shim computes the call itself (README, "Policies")."""
    x = tensors[0]
    if x.dtype not in HALF:
        return False
    if any(t is not None and not t.is_floating_point() for t in tensors[1:]):
        return False  # integer stats or parameters: torch rejects them with its own error
    if spec["policy"] == "off":
        return left_by_keep_stats(tensors)  # computed, not rejected, under every policy
    if spec["autocast"] is not None:
        return True
    return any(t is not None and t.dtype is not x.dtype for t in tensors[1:])


def expected_dtype(spec, x_dtype):
    if spec["autocast"] is None or spec["policy"] == "off":
        return x_dtype  # outside autocast: the caller chose the input's precision
    return {"fp32": torch.float32, "input": x_dtype, "autocast": spec["autocast"]}[spec["policy"]]


def assert_bitwise(ours, theirs):
    assert type(ours[0]) is type(theirs[0])
    if isinstance(ours[0], type):  # an error: torch's own type and message
        assert ours == theirs
        return
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype is b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())


def check(spec):
    """Compare one call with plain torch or float64; return what kind of call it was."""
    amp_bn_fix.set_policy(spec["policy"])
    tensors = build(spec)
    ours = call(F.batch_norm, spec, tensors, autocast=spec["autocast"])
    if not handled(spec, tensors):
        assert_bitwise(ours, call(ORIGINAL, spec, tensors, autocast=spec["autocast"]))
        return "passed-through"
    ref = call(ORIGINAL, spec, tensors, dtype=torch.float64)
    if isinstance(ref[0], type):
        # Invalid whatever the precision: an error torch raises for this call, either on the same
        # arguments or, where plain torch first objects to the mixed dtypes the shim accepts, on
        # the same call in one precision.
        assert ours == ref or ours == call(ORIGINAL, spec, tensors, autocast=spec["autocast"]), (ours, ref)
        return "handled-invalid"
    assert not isinstance(ours[0], type), ours
    out, mean, var = ours
    x_dtype = tensors[0].dtype
    assert out.dtype is expected_dtype(spec, x_dtype) and out.shape == ref[0].shape
    # FP32 arithmetic, each result rounded once to its dtype (older torch: eps < 0 gives NaN, where
    # the result must be NaN too).
    n = max(out.numel() // out.shape[1], 1) if out.shape[1] else 1
    # The statistics' errors, relative to the input's magnitude, are divided by the standard
    # deviation: large for a variance near 0 (an expanded input's samples are all equal).
    scale = None
    if out.numel():
        x, mean0, var0, weight = tensors[:4]
        running = None if spec["training"] else (mean0, var0)
        conditioned = batch_norm_scales(x, weight, eps=spec["eps"], running=running)[0]
        if math.isfinite(conditioned):
            scale = max(conditioned, ref[0].nan_to_num(0.0).abs().max().item())
    assert_near(out, ref[0], n, scale=scale, nonfinite=True, what="output")
    for ours_stat, ref_stat, given_stat in zip((mean, var), ref[1:], tensors[1:3]):
        if ours_stat is None:
            continue
        assert ours_stat.dtype is given_stat.dtype  # updated in place, in the caller's dtype
        assert_near(ours_stat, ref_stat, n, nonfinite=True, what="running stat")
    return "handled-valid"


def test_fuzz_against_plain_torch_and_fp64():
    seen = {"handled-valid": 0, "handled-invalid": 0, "passed-through": 0, "long-rows": 0}

    @FUZZ
    @given(spec=calls())
    def fuzz(spec):
        seen[check(spec)] += 1
        batch, channels = spec["shape"][:2]
        if batch and channels and build(spec)[0].numel() // (batch * channels) >= 32:
            seen["long-rows"] += 1

    fuzz()
    # A fuzz that never made valid handled calls, invalid ones or rows long enough for the fast
    # paths would pass vacuously.
    assert min(seen.values()) >= 30, seen
