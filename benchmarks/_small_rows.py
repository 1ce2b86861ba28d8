"""The small-call regime: a tiny BatchNorm, a tiny conv-net step and the ATen ops of one call.

Here the shim's fixed cost per call is most of the call: a bf16 ``BatchNorm2d(16)`` on a
(4,16,4,4) input takes tens of microseconds natively. Each row compares the shim (its default
settings, guard on, with the policy named) against ``amp_bn_fix.disable()``, interleaved in one
process; the conv-net step's ``fp32`` also against the same net with its BatchNorms written by
hand in FP32 (shim off), which isolates the shim's own cost from the FP32 activations that policy
hands on. Every row also has a device-path variant (``-device-path``): CPU calls take exactly the
path a CUDA call takes (``amp_bn_fix.testing.device_route()``), skipped where that does not exist.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import torch
from torch import nn

from _harness import OFF, ON, Bench, Skip, device_path, settings
from _models import by_hand_fp32, count_bn, grads_like, half_input, tiny_convnet, train_step
from _traffic import NATIVE, count_call

TINY_SHAPE = (4, 16, 4, 4)
POLICIES = ("fp32", "input", "autocast")
# The project's targets, printed next to the figures and never asserted.
TARGETS = {"train": "<= 1.6", "fwdbwd": "<= 1.4", "eval": "<= 1.6", "step": "<= 1.10"}


def ops_target(kind: str, policy: str) -> str:
    """Launches beyond native's that ``tests/test_cost.py`` holds for a small call on the device route."""
    if kind == "train":
        return "extra <= 6" if policy == "fp32" else "extra <= 5"
    return "extra <= 1" if policy == "fp32" else "extra <= 0"


@contextlib.contextmanager
def path(b: Bench, emulate: bool) -> Iterator[None]:
    """The host path, or with ``emulate`` the device path, for the body."""
    if not emulate:
        yield
        return
    if b.device != "cpu":
        raise Skip("on a device the shim takes the device path anyway: see the row without -device-path")
    with device_path():
        yield


def _label(emulate: bool) -> str:
    return "device path" if emulate else "host path"


def tiny(kind: str, emulate: bool = False) -> Callable[[Bench], None]:
    """``kind``: ``train`` (training forward), ``fwdbwd`` (training forward+backward), ``eval`` (eval forward)."""

    def run(b: Bench) -> None:
        dtype = torch.bfloat16
        bn = nn.BatchNorm2d(TINY_SHAPE[1]).to(b.device).train(kind != "eval")
        x = half_input(TINY_SHAPE, dtype, b.device)
        if kind == "eval":
            x = x.detach()
        grads = grads_like(x)
        calls = (10 if kind == "fwdbwd" else 20) if b.quick else (100 if kind == "fwdbwd" else 200)
        if kind == "fwdbwd":
            # Autocast per call, the backward outside it, as a training loop does.
            def call() -> None:
                with torch.autocast(b.device, dtype=dtype):
                    y = bn(x)
                y.backward(grads[y.dtype])
                x.grad = bn.weight.grad = bn.bias.grad = None
        else:
            def call() -> None:
                bn(x)

        @contextlib.contextmanager
        def region() -> Iterator[None]:
            """One autocast region around all the forward-only calls, as around a model's forward."""
            if kind == "fwdbwd":
                yield
                return
            with torch.autocast(b.device, dtype=dtype), torch.set_grad_enabled(kind == "train"):
                yield

        what = {"train": "training forward", "fwdbwd": "training forward+backward", "eval": "eval forward (no_grad)"}[kind]
        print(f"[{b.current}] bf16 BatchNorm2d(16) {TINY_SHAPE}, {what}, {_label(emulate)}: "
              "shim (default settings, the policy named) vs disable(); per call")
        for policy in POLICIES:
            with path(b, emulate), settings(policy=policy, guard=True), region():
                t = b.compare(call, call, 21, calls, ON, OFF)
            b.add("tiny", f"{what}, {policy}" + (", device path" if emulate else ""), "shim", "off", t,
                  note=f"{t.a_us - t.b_us:+.1f} us per call", target=TARGETS[kind])

    return run


def convnet_step(emulate: bool = False) -> Callable[[Bench], None]:
    def run(b: Bench) -> None:
        batch, size = (4, 16) if b.quick else (16, 32)
        torch.manual_seed(0)
        model = tiny_convnet().to(b.device)
        x = torch.randn(batch, 3, size, size, device=b.device)
        y = torch.randint(0, 10, (batch,), device=b.device)
        step = train_step(model, x, y, b.device)
        label = f"conv-net SGD step ({batch},3,{size},{size}), {count_bn(model)} BN"
        print(f"[{b.current}] {label}, bf16 autocast, {_label(emulate)}: shim (default settings) vs disable()")
        calls = 3 if b.device == "cpu" else 5
        where = ", device path" if emulate else ""
        for policy in ("fp32", "input"):
            with path(b, emulate), settings(policy=policy, guard=True):
                t = b.compare(step, step, 15, calls, ON, OFF)
            b.add("convnet", f"{label}, {policy}{where}", "shim", "off", t,
                  note=f"{t.a_us - t.b_us:+.1f} us per step", target=TARGETS["step"] if policy == "fp32" else "")
        # What the shim itself adds to an FP32 BatchNorm's step: against the same net with its
        # BatchNorms written by hand in FP32 (shim off), which hands on the same FP32 activations.
        print(f"[{b.current}] {label}, bf16 autocast, {_label(emulate)}: shim (fp32) vs bn(x.float()) by hand")
        by_hand = train_step(by_hand_fp32(copy.deepcopy(model)), x, y, b.device)
        with path(b, emulate), settings(policy="fp32", guard=True):
            t = b.compare(step, by_hand, 15, calls, ON, OFF)
        b.add("convnet", f"{label}, fp32{where}", "shim", "by hand", t,
              note=f"{t.a_us - t.b_us:+.1f} us per step", target=TARGETS["step"])

    return run


HALF_SHAPES = (TINY_SHAPE, (16, 64, 28, 28))


def half_model(emulate: bool = False) -> Callable[[Bench], None]:
    """A bf16 ``.bfloat16()`` BatchNorm2d (its FP32 master kept), per call: training and eval forward
    outside autocast (torch's output, the master's FP32 update), and training under autocast."""

    def run(b: Bench) -> None:
        dtype = torch.bfloat16
        print(f"[{b.current}] bf16 half-model BatchNorm2d, {_label(emulate)}: shim (default settings) vs disable(); per call")
        for shape in HALF_SHAPES:
            bn = nn.BatchNorm2d(shape[1]).to(b.device, dtype)
            x = half_input(shape, dtype, b.device).detach()
            calls = (5 if b.quick else 50) if shape is not TINY_SHAPE else (20 if b.quick else 200)
            for case, training, autocast in (("training forward", True, False), ("eval forward", False, False),
                                             ("training forward, autocast", True, True)):
                bn.train(training)

                def call() -> None:
                    bn(x)

                with path(b, emulate), torch.autocast(b.device, dtype=dtype, enabled=autocast), torch.no_grad():
                    t = b.compare(call, call, 21, calls, ON, OFF)
                b.add("half", f"{shape}, {case}" + (", device path" if emulate else ""), "shim", "off", t,
                      note=f"{t.a_us - t.b_us:+.1f} us per call")

    return run


def aten_ops(emulate: bool = False) -> Callable[[Bench], None]:
    def run(b: Bench) -> None:
        if emulate and b.device != "cpu":
            raise Skip("on a device the shim takes the device path anyway: see the row without -device-path")
        print(f"[{b.current}] kernels of one bf16 BatchNorm2d(16) {TINY_SHAPE} call under autocast, "
              f"{_label(emulate)}, shim vs disable() (amp_bn_fix.testing.count_kernels)")
        device = b.device if emulate or b.device != "cpu" else "host"
        for kind in ("train", "eval"):
            native = count_call(TINY_SHAPE, torch.bfloat16, NATIVE, kind, device=device)
            for policy in POLICIES:
                count = count_call(TINY_SHAPE, torch.bfloat16, policy, kind, device=device)
                b.add_figure("aten-ops", f"{kind} fwd, {policy}" + (", device path" if emulate else ""),
                             "shim", "off", count.launches, native.launches, "ops", target=ops_target(kind, policy),
                             shim_ops=count.names(), off_ops=native.names())
                print(f"      shim: {' '.join(count.names())}\n      off:  {' '.join(native.names())}")

    return run
