"""The count: what one BatchNorm call costs a GPU, counted on any device, not timed.

For a memory-bound op on a GPU, time follows the bytes its kernels move, and a small call's time
follows its launches. ``amp_bn_fix.testing.count_kernels`` counts both (each kernel's reads and
writes, CUDA's launches per op), ``kept_for_backward`` the bytes autograd keeps for backward; on CPU the calls take
the route a CUDA call takes (``amp_bn_fix.testing.device_route``). Used by the ``traffic`` and
``aten-ops`` rows and by the tests that hold the budgets (``tests/test_cost.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import amp_bn_fix
from amp_bn_fix.testing import Kernel, count_kernels, device_route, kept_for_backward

# The shape of the issue this count was made for (ResNet-50's first BatchNorm at batch 32), and
# the tiny call of the small-call rows.
LARGE = (32, 64, 56, 56)
TINY = (4, 16, 4, 4)
MODES = ("train", "fwdbwd", "eval")
POLICIES = ("fp32", "input", "autocast")
NATIVE = "native"
# BatchNorm written by hand in FP32, as users do today: ``bn(x.float())`` with autocast off, shim off.
BY_HAND = "by hand"


@dataclasses.dataclass(frozen=True)
class Count:
    """One call's count: bytes moved and kept per value of the input, launches, the kernels."""

    moved: float
    kept: float
    launches: int
    kernels: List[Kernel]

    def names(self) -> List[str]:
        return [k.name for k in self.kernels]


@contextlib.contextmanager
def _route(device: str) -> Iterator[None]:
    """On ``cpu`` the route a CUDA call takes; on ``host`` the CPU's own; on a device its own."""
    with device_route() if device == "cpu" else contextlib.nullcontext():
        yield


def count_call(shape: Sequence[int], dtype: torch.dtype, policy: str, mode: str, half_model: bool = False,
               device: str = "cpu", channels_last: bool = False) -> Count:
    """Count one ``BatchNorm{1,2,3}d`` call under ``dtype`` autocast on a 16-bit input of ``shape``.

    ``policy``: one of :data:`POLICIES`, :data:`NATIVE` for the shim disabled or :data:`BY_HAND`
    for BatchNorm written by hand in FP32 (shim disabled). ``mode``: a training
    forward, a training forward and backward (the incoming gradient in the output's dtype, made
    before the count), or an eval forward under ``no_grad``. ``half_model``: the module cast to
    ``dtype`` (its FP32 master started by a call before the count). ``device`` ``host``: the CPU's
    own route (``cpu`` counts the route a CUDA call takes).
    """
    route, device = device, "cpu" if device == "host" else device
    torch.manual_seed(0)
    module = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    bn = module(shape[1]).to(device).train(mode != "eval")
    if half_model:
        bn.to(dtype)
    x = torch.randn(tuple(shape), device=device).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    x.requires_grad_(mode == "fwdbwd")
    enabled, shim = amp_bn_fix.is_enabled(), policy in POLICIES
    scope = amp_bn_fix.policy(policy) if shim else contextlib.nullcontext()

    def call() -> torch.Tensor:
        with torch.autocast(device, dtype=dtype):
            if policy == BY_HAND:
                with torch.autocast(device, enabled=False):
                    return bn(x.float())
            return bn(x)

    try:
        (amp_bn_fix.enable if shim else amp_bn_fix.disable)()
        with scope, _route(route), torch.set_grad_enabled(mode == "fwdbwd"):
            out_dtype = call().dtype  # lazy set-up (a half model's master) is not part of the call
            grad = torch.randn(tuple(shape), device=device, dtype=out_dtype)
            with count_kernels() as traffic:
                y = call()
                kept = kept_for_backward(y)
                if mode == "fwdbwd":
                    y.backward(grad)
    finally:
        (amp_bn_fix.enable if enabled else amp_bn_fix.disable)()
    values = x.numel()
    return Count(traffic.moved / values, kept / values, traffic.launches, traffic.kernels)


def count_step(step: Callable[[], object]) -> Tuple[float, int]:
    """Bytes moved and launches of one call of ``step`` (a whole training step, say), as it runs now."""
    step()  # lazy set-up (optimizer state, a half model's master) is not part of the step
    with count_kernels() as traffic:
        step()
    return traffic.moved, traffic.launches


def predicted_ratio(count: Count, native: Count) -> float:
    """The GPU time ratio the count predicts for a large call: bytes moved, against native's."""
    return count.moved / native.moved


def traffic_rows(b, shapes: Sequence[Sequence[int]] = (LARGE, TINY), dtype: torch.dtype = torch.bfloat16,
                 half_models: Sequence[bool] = (False, True), policies: Optional[Sequence[str]] = None) -> None:
    """Per shape, model, mode and policy: bytes moved per value, launches and bytes kept, against native's."""
    for shape in shapes:
        for half_model in half_models:
            model = "half model" if half_model else "FP32 model"
            for mode in MODES:
                native = count_call(shape, dtype, NATIVE, mode, half_model, b.device)
                for policy in policies or POLICIES:
                    count = count_call(shape, dtype, policy, mode, half_model, b.device)
                    name = f"{tuple(shape)} {model} {mode}, {policy}"
                    note = (f"predicted GPU time {predicted_ratio(count, native):.2f}x native" if shape is not TINY
                            else "a small call: its launches, not its bytes, set its time")
                    b.add_figure("traffic", f"{name}: bytes/value", "shim", "native", count.moved, native.moved,
                                 "B", note=note)
                    b.add_figure("traffic", f"{name}: launches", "shim", "native", count.launches, native.launches,
                                 "ops", shim_ops=count.names(), off_ops=native.names())
                    if mode == "fwdbwd":
                        b.add_figure("traffic", f"{name}: kept for backward", "shim", "native", count.kept,
                                     native.kept, "B/value")
