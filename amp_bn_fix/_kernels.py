"""Batch norm of a half-precision input computed in FP32 without the reference's cost.

Both compute what the reference ``F.batch_norm(x.float(), ...)`` computes (FP32 statistics,
normalization and running-stat update) without an FP32 copy of the input. On CPU the FP32
training kernel is slow for NCHW inputs and a half-to-float copy costs about as much as a whole
mixed-dtype batch norm, while the native mixed-dtype kernel (half input, FP32 parameters and
statistics) accumulates in FP32, normalizes in FP32 and rounds once. Its statistics accumulate a
whole channel in float where the FP32 kernel's accumulate in double for contiguous NCHW inputs
(for channels_last and 2-D inputs it too sums in float): about 1e-5 relative error in the variance
at 1e5 values per channel of data a few spreads from zero, far below one half-precision rounding of
the output, and exactly what native autocast computes. A mean far from zero against the spread
costs more, as in native autocast (3e4 over a spread of 20, 2.6e5 values per channel: 1.6e-3, some
20 roundings of a float16 output); the ``fp32`` policy's kernels keep 3e-7 there. On a GPU, time
follows the bytes each kernel moves, and the copy is most of them.

* :func:`mixed_batch_norm`: half output, the native mixed kernel (CPU), no copy of the input.
* :func:`fp32_batch_norm`: FP32 output. Batch statistics read from the half input (on CPU row by
  row and combined in float64, as accurate as the FP32 kernel's), then the output written from it
  once; only the half input is kept for backward, which upcasts it again (on CPU a chunk at a
  time). :func:`fp32_route` says where it runs and how.

The callers run these in plain eager mode only (:func:`~amp_bn_fix._compat.plain_eager`), with
autocast disabled and with FP32 (or absent) statistics (:func:`fp32_batch_norm` also takes a half
model's 16-bit weight and bias as they are): they write the running
stats through ``.data``, run a Python ``autograd.Function`` and make scratch tensors, none of which
a tracer would record faithfully.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import _state, _tuning
from ._compat import LOW_PRECISION, add_gradient_hook, is_batched, plain_eager, suggest_memory_format

_aten = torch.ops.aten
# ``F.batch_norm``'s eight arguments, in its order.
Call = Tuple[Any, ...]
# Rows (one sample, one channel) shorter than this make :func:`_batch_stats` slow: the kernel
# reduces rows given as channels one by one.
_MIN_ROW = 32
# Longest piece of a row reduced in float: longer rows are split into equal pieces of at most this
# many values. The error of a float accumulation grows with its length (rows of 65536 values around
# a mean of 3: 2e-6 relative in the output, against 1e-7 for the FP32 kernel; 1024: 1.7e-7).
_MAX_ROW = 1024


def mixed_batch_norm(original: Callable[..., torch.Tensor], call: Call) -> torch.Tensor:
    """A half-precision output computed in FP32 by the native mixed-dtype kernel on CPU, for an
    input :func:`mixed_kernel_takes`.

    ``original`` (``F.batch_norm``'s signature) validates ``call`` and raises its own errors.
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    if weight is None and bias is None and running_mean is None and running_var is None and input.dim() >= 2:
        # With no FP32 tensor in the call the kernel takes its all-half path, which rounds the
        # batch statistics to half; one FP32 weight of ones makes it the mixed (FP32) kernel.
        weight = torch.ones(input.shape[1], dtype=torch.float32, device=input.device)
    out = original(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if out.requires_grad:
        add_gradient_hook(out, _laid_out_as(input))
    return out


def _laid_out_as(input: torch.Tensor) -> Callable[[torch.Tensor], Optional[torch.Tensor]]:
    """A hook that hands the output's gradient to the mixed kernel's backward laid out as ``input``.

    That backward accumulates in FP32 only where the gradient and the input suggest the same memory
    format (``Normalization.cpp``); otherwise in the input's dtype (bfloat16 bias gradients off by
    ~1e-3). A transpose, a mean over the batch, a flatten of 1x1 maps or a channels_last op after
    BatchNorm hands it such a gradient. The same strides are the same format, whatever strides
    the size-1 dimensions have; a gradient with them already is not copied. A batched gradient
    (``is_grads_batched``) has no strides to ask for, and is left as it is.
    """
    shape, strides = input.shape, input.stride()

    def laid_out(grad: torch.Tensor) -> Optional[torch.Tensor]:
        if is_batched(grad) or grad.stride() == strides:
            return None
        return torch.empty_strided(shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)

    return laid_out


def mixed_kernel_takes(input: torch.Tensor) -> bool:
    """Whether the native mixed kernel computes ``input`` exactly: contiguous and channels_last
    inputs (other strided inputs take the reference path)."""
    if input.is_contiguous():
        return True
    dim = input.dim()
    return ((dim == 4 and input.is_contiguous(memory_format=torch.channels_last))
            or (dim == 5 and input.is_contiguous(memory_format=torch.channels_last_3d)))


def fp32_route(host: bool, call: Call) -> Optional[bool]:
    """How :func:`fp32_batch_norm` computes this call: ``True`` in chunks (the host route), ``False``
    whole (the route a CUDA call takes), ``None`` not at all (the reference computes it).

    The route runs no native batch-norm op that would check the arguments, so everything
    ``F.batch_norm`` would reject (an argument of the wrong type, one value per channel, ``eps <= 0``,
    a tensor of the wrong size, dtype or device, stats that require grad), and the empty batch it
    special-cases, goes to the reference: errors and edge cases stay the original's.

    The caller asks only where the route pays (``_tuning``): on the host route for large training
    calls, of which only contiguous NCHW ones pay for the chunks' many small ops (other layouts
    would be copied by the row-wise reduction, and the reference is fast for channels_last); on the
    device route for large calls in every layout, training and eval alike, where the reference's
    FP32 copy of the input is what costs (see ``docs/performance.md``).
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    if training is not True and training is not False:
        return None
    if input.dtype not in LOW_PRECISION or type(momentum) not in (int, float) or type(eps) not in (int, float):
        return None
    shape = input.shape
    if len(shape) < 2 or not eps > 0.0 or (running_mean is None) is not (running_var is None):
        return None
    values = input.numel() // shape[1] if shape[1] else 0
    if values < (2 if training else 1) or (not training and running_mean is None):
        return None
    channels, device = (shape[1],), input.device
    for t in (running_mean, running_var):
        if t is not None and (t.shape != channels or t.dtype is not torch.float32 or t.device != device):
            return None
    for t in (weight, bias):  # a half model's are read as they are, promoted to FP32 by the ops
        if t is not None and (t.shape != channels or (t.dtype is not torch.float32 and t.dtype not in LOW_PRECISION)
                              or t.device != device):
            return None
    for stat in (running_mean, running_var):
        if stat is not None and stat.requires_grad:
            return None
    if not host:
        return False
    if not input.is_contiguous() or values < _tuning.MIN_PER_CHANNEL or _row_pieces(values // shape[0]) is None:
        return None
    return True


def _scale_and_shift(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     mean: torch.Tensor, invstd: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP32 ``scale`` and ``shift`` with ``output = input * scale + shift``, shaped to
    broadcast over ``input``: the normalization and the affine transform in one."""
    scale = invstd if weight is None else invstd * weight
    shift = -mean * scale if bias is None else torch.addcmul(bias, mean, scale, value=-1)
    view = (-1,) + (1,) * (input.dim() - 2)
    return scale.view(view), shift.view(view)


class _Normalize(torch.autograd.Function):
    """``(x - mean) * invstd * weight + bias`` in FP32 for a half ``x``: batch statistics in training,
    the running stats in eval.

    The statistics come in detached; the backward is torch's for the mode, so the gradient flows
    through the batch statistics as it does in ``F.batch_norm``, and an eval call's backward reads
    the running stats as they are at backward time, as torch's kernels do (a training call may
    have updated them in between, without a version bump). Only the half input is saved for
    backward (half the bytes of an FP32 copy, and a tensor the caller holds anyway). ``chunked``
    (CPU, training): the forward and the backward upcast it a chunk at a time, in cache
    (:func:`_backward_in_chunks`). Else, and with ``create_graph``, the backward is torch's FP32
    one on the whole upcast input, an ATen op with its own derivative (so double backward works)
    on every device: CUDA's backward kernels read the incoming gradient as the input's dtype
    (``aten/src/ATen/native/cuda/Normalization.cuh``: ``batch_norm_backward_kernel`` and
    ``batch_norm_backward_reduce_kernel`` take both through one ``input_scalar_t`` accessor), so
    they would round the FP32 gradient to 16 bits first.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                mean: torch.Tensor, var: torch.Tensor, eps: float, training: bool, chunked: bool) -> torch.Tensor:
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(input, weight, mean, invstd if training else var)
        ctx.eps, ctx.training, ctx.chunked = eps, training, chunked
        return _normalized(input, *_scale_and_shift(input, weight, bias, mean, invstd), chunked)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        input, weight, mean, spread = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # A half model's weight, as torch's FP32 backward takes it; autograd rounds the FP32
        # gradients of 16-bit weight and bias to their dtype.
        weight = None if weight is None else weight.float()
        if ctx.chunked and not torch.is_grad_enabled() and plain_eager(grad) and not is_batched(grad):
            grad_input, grad_weight, grad_bias = _backward_in_chunks(grad, input, weight, mean, spread, ctx.eps)
        else:
            # Torch's FP32 backward, also for batched gradients (``is_grads_batched``, torch.func over
            # the backward) and tracers: the chunked backward's in-place updates of plain tensors
            # cannot take a batched operand. CUDA's kernel asserts that the saved statistics are
            # defined: empty in eval, where it reads the running stats.
            saved = (None, None, mean, spread) if ctx.training else (mean, spread, mean[:0], spread[:0])
            grad_input, grad_weight, grad_bias = _aten.native_batch_norm_backward(
                grad, input.float(), weight, *saved, ctx.training, ctx.eps, [needs[0], needs[1], needs[2]]
            )
            if grad_input is not None:
                grad_input = grad_input.to(input.dtype)
        return (grad_input if needs[0] else None, grad_weight if needs[1] else None,
                grad_bias if needs[2] else None, None, None, None, None, None)


def _normalized(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, chunked: bool) -> torch.Tensor:
    """``input * scale + shift`` in FP32, written once from the 16-bit input (an ``addcmul`` promotes
    its operands: CUDA reads the 16-bit values and writes FP32 in one pass, 6 bytes an element).

    The output is laid out as torch's CPU kernel lays out its own (:func:`_output_format`), as
    where the reference (an FP32 copy, torch's kernel) computes smaller calls; an ``addcmul``
    alone would follow the input's strides.

    ``chunked`` (CPU, contiguous): the output filled a chunk at a time: each chunk is upcast, then
    normalized in place while it is still in cache. CPU kernels upcast a promoted operand into a
    temporary first, and an ``addcmul`` per chunk measured 1.5x slower.
    """
    out = torch.empty(input.shape, dtype=torch.float32, device=input.device, memory_format=_output_format(input))
    if not chunked:
        return torch.addcmul(shift, input, scale, out=out)
    for rows in _chunks(input):
        out[rows].copy_(input[rows]).mul_(scale).add_(shift)
    return out


def _output_format(input: torch.Tensor) -> torch.memory_format:
    """The memory format of torch's CPU batch norm's output for ``input`` (``batch_norm_cpu`` in
    ``aten/src/ATen/native/Normalization.cpp``): contiguous where the input is (a one-channel
    channels_last batch too, whose size-1 channel stride a following convolution reads), else the
    format the input is dense in, else the one its strides suggest (a transposed ``(N, L, C)``
    batch comes out contiguous, which ``.view()`` takes). cuDNN's (the suggested format) differs
    only for an input contiguous in both formats, as that one-channel batch."""
    if input.is_contiguous():
        return torch.contiguous_format
    for dense in (torch.channels_last_3d, torch.channels_last):
        if input.is_contiguous(memory_format=dense):
            return dense
    return suggest_memory_format(input)


def _backward_in_chunks(
    grad: torch.Tensor, input: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
    invstd: torch.Tensor, eps: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode batch-norm backward of a half ``input``, upcast a few samples at a time.

    torch's FP32 backward needs a whole FP32 copy of the input next to its FP32 input gradient;
    here each FP32 temporary covers at most ``_tuning.CHUNK`` values per thread, so it stays in cache and the peak
    memory stays near native autocast's. Two passes over the chunks: torch's backward computes
    the per-channel sums of each chunk (weight and bias gradients only), then
    ``grad_input = a * grad + b * (x - mean) + c``, torch's formula with the per-channel terms
    gathered, is computed in place in the chunk's FP32 copy and written to the half gradient.
    """
    channels = input.shape[1]
    view = (1, channels) + (1,) * (input.dim() - 2)
    count = input.numel() // channels
    chunks = _chunks(input)
    # One FP32 scratch chunk for every upcast: no allocation (and page faults) per chunk.
    scratch = torch.empty(input[chunks[0]].shape, dtype=torch.float32, device=input.device)

    def upcast(rows: slice) -> torch.Tensor:
        part = input[rows]
        return scratch[: part.shape[0]].copy_(part)

    grad_weight = torch.zeros_like(mean)
    grad_bias = torch.zeros_like(mean)
    for rows in chunks:
        _, part_weight, part_bias = _aten.native_batch_norm_backward(
            grad[rows], upcast(rows), weight, None, None, mean, invstd, True, eps, [False, True, True]
        )
        grad_weight += part_weight
        grad_bias += part_bias
    scale = invstd if weight is None else invstd * weight
    a = scale.view(view)
    b = (-scale * invstd * grad_weight / count).view(view)
    c = (-scale * grad_bias / count).view(view)
    mean_view = mean.view(view)
    grad_input = torch.empty_like(input)
    for rows in chunks:
        # Centred first, as torch does: b * x + (c - b * mean) would cancel for a large mean.
        grad_input[rows] = upcast(rows).sub_(mean_view).mul_(b).add_(c).addcmul_(grad[rows], a)
    return grad_input, grad_weight, grad_bias


def _chunks(input: torch.Tensor) -> List[slice]:
    """Slices of whole samples of ``input`` of about ``_tuning.CHUNK`` values per torch thread (at least one sample)."""
    step = max(1, _tuning.CHUNK * torch.get_num_threads() // max(1, input[0].numel()))
    return [slice(start, start + step) for start in range(0, input.shape[0], step)]


@functools.lru_cache(maxsize=256)
def _row_pieces(length: int) -> Optional[int]:
    """Into how many equal pieces of ``_MIN_ROW`` to ``_MAX_ROW`` values a row of ``length`` splits.

    None if it does not (a row shorter than ``_MIN_ROW``, or a length with no such divisor).
    """
    for pieces in range(-(-length // _MAX_ROW), length // _MIN_ROW + 1):
        if length % pieces == 0:
            return pieces
    return None


@functools.lru_cache(maxsize=256)
def _samples_per_part(samples: int, length: int) -> int:
    """How many samples' rows of ``length`` values one part of :func:`_batch_stats` takes.

    The most that divide ``samples`` evenly and hold at most ``_MAX_ROW`` values together.
    """
    return max(k for k in range(1, max(1, _MAX_ROW // length) + 1) if samples % k == 0)


def _float_stats(input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of a half ``input``, reduced in float by the mixed kernel."""
    # Its running stats are required for FP32 results; momentum 0 leaves these scratch ones alone.
    scratch = torch.zeros(2, input.shape[1], dtype=torch.float32, device=input.device)
    return torch.batch_norm_update_stats(input, scratch[0], scratch[1], 0.0)


def _batch_stats(input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of a half ``input``, in float64, to FP32 accuracy.

    The mixed kernel's reduction accumulates a whole channel in float, which loses up to ~1e-5
    (relative, more for a large mean) on big batches, where ``bn(x.float())`` accumulates in
    double. Here that kernel reduces equal parts of each channel of at most ``_MAX_ROW`` values,
    reading the half input once, and the parts are combined in float64: the variance is the mean
    of their variances plus the variance of their means. A part is a piece of one (sample,
    channel) row when rows are long, and the rows of a few samples when they are short: the
    kernel reduces rows given as channels one by one, slowly when they are short (0.99 ms for
    (32,256,14,14), against 0.27 ms for the same values in 256 channels).
    """
    samples, channels = input.shape[:2]
    length = input.numel() // (samples * channels)
    group = _samples_per_part(samples, length)
    if group == 1:
        pieces = _row_pieces(length)
        part_mean, part_var = _float_stats(input.reshape(1, samples * channels * pieces, -1))  # type: ignore[operator]
        part_mean, part_var = (t.view(samples, channels, -1).transpose(0, 1).reshape(channels, -1)
                               for t in (part_mean, part_var))
    else:
        parts = [_float_stats(input[start:start + group]) for start in range(0, samples, group)]
        part_mean = torch.stack([mean for mean, _ in parts], 1)
        part_var = torch.stack([var for _, var in parts], 1)
    part_mean = part_mean.double()
    mean = part_mean.mean(1)
    var = (part_var.double() + (part_mean - mean[:, None]).square()).mean(1)
    return mean, var


def fp32_batch_norm(call: Call, chunked: bool) -> torch.Tensor:
    """Batch norm of a half ``input`` with an FP32 output, computed in FP32 without an FP32 copy of it.

    ``running_mean``/``running_var`` (FP32 or both None) are updated in place as the native kernels
    do (unbiased variance, no autograd version bump); :func:`fp32_route` must have said ``chunked``.
    Training: batch statistics read from the 16-bit input once, then the output written once.
    ``chunked`` (the host route) reduces them row by row and combines in float64; else CUDA's
    statistics op (:func:`_device_stats`). Eval: the running stats' scale and shift, one pass.
    """
    input, running_mean, running_var, weight, bias, training, momentum, eps = call
    if not training:
        return _Normalize.apply(input, weight, bias, running_mean, running_var, eps, False, False)
    if not chunked:
        mean, var = _device_stats(input.detach(), running_mean, running_var, momentum)
    else:
        mean, var = _batch_stats(input.detach())
        if running_mean is not None and running_var is not None:
            count = input.numel() // input.shape[1]
            # Through ``.data``, like the native kernels' update: no autograd version bump.
            running_mean.data.copy_(running_mean.double() * (1 - momentum) + mean * momentum)
            running_var.data.copy_(running_var.double() * (1 - momentum) + var * (momentum * count / (count - 1)))
        mean, var = mean.float(), var.float()
    return _Normalize.apply(input, weight, bias, mean, var, eps, True, chunked)


def _device_stats(input: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                  momentum: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP32 batch mean and biased variance of a half ``input``, the running stats (if any) updated
    with them: CUDA's ``batch_norm_update_stats`` (``aten/src/ATen/native/cuda/Normalization.cu``: FP32
    statistics whatever the running stats, Welford in FP32; two kernels with running stats, one
    without). On CPU, the route a CUDA call takes runs :func:`_stand_in`, with the same rules."""
    stats = _stand_in() if input.is_cpu else torch.batch_norm_update_stats
    return stats(input, running_mean, running_var, momentum)


# The stand-in's registration, kept across ``importlib.reload`` of this module: a Library that is
# garbage-collected removes its kernel.
_library: Optional[torch.library.Library] = globals().get("_library")


def _stand_in() -> Callable[..., Tuple[torch.Tensor, torch.Tensor]]:
    """``amp_bn_fix::batch_norm_stats``: CUDA's statistics kernel on CPU, one op (so
    ``amp_bn_fix.testing.count_kernels`` counts one kernel where CUDA launches it). CPU's own
    ``batch_norm_update_stats`` sums a channel in float and returns the input's dtype without
    running stats; CUDA's returns FP32 and accumulates as accurately as its FP32 kernel, which this
    stand-in matches by reducing in float64."""
    global _library
    if _library is None:
        with _state.lock:  # the first calls of several threads: one registration
            if _library is None:
                library = torch.library.Library("amp_bn_fix", "FRAGMENT")
                library.define("batch_norm_stats(Tensor input, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
                               "float momentum) -> (Tensor, Tensor)")
                library.impl("batch_norm_stats", _cuda_statistics_on_cpu, "CPU")
                _library = library
    return torch.ops.amp_bn_fix.batch_norm_stats


def _cuda_statistics_on_cpu(input: torch.Tensor, running_mean: Optional[torch.Tensor],
                            running_var: Optional[torch.Tensor], momentum: float) -> Tuple[torch.Tensor, torch.Tensor]:
    dims = [0, *range(2, input.dim())]
    var, mean = torch.var_mean(input.double(), dims, correction=0)
    count = input.numel() // input.shape[1]
    # CUDA's Welford holds the sum of squared deviations in FP32: past FP32's range it is inf
    # (the guard's to see), though the variance itself would fit.
    mean, var = mean.float(), (var * count).float() / count
    if running_mean is not None and running_var is not None:
        # As CUDA's update: in FP32, the variance made unbiased, no autograd version bump.
        running_mean.data.copy_(mean * momentum + (1 - momentum) * running_mean)
        running_var.data.copy_(var * (count / (count - 1)) * momentum + (1 - momentum) * running_var)
    return mean, var
