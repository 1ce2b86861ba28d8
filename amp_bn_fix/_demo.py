"""The bug report (pytorch#88929), reproduced: per-layer output dtypes under autocast, without and with the shim."""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
from _amp_bn_fix_boot.settings import Config
from torch import nn

from . import _patch, _state


class DemoRow(NamedTuple):
    device: str
    autocast_dtype: torch.dtype
    layer: str
    without: torch.dtype
    with_shim: torch.dtype
    expected: torch.dtype  # what the active policy should give


# Device types that can run autocast, each with how to ask whether one is present.
_DEVICE_MODULES = ("cuda", "xpu", "mps", "hpu", "mtia")


def autocast_devices() -> List[str]:
    """Device types present in this process that autocast supports; ``cpu`` always."""
    found = ["cpu"]
    for name in _DEVICE_MODULES:
        module = getattr(torch, name, None)
        is_available = getattr(module, "is_available", None)
        try:
            present = bool(is_available()) if callable(is_available) else False
        except Exception:  # a backend whose runtime is broken counts as absent
            present = False
        if present and torch.amp.is_autocast_available(name):
            found.append(name)
    return found


def cases() -> Iterator[Tuple[str, torch.dtype]]:
    """(device type, autocast dtype) pairs the demo and the self-test run: each present device type
    with its 16-bit dtypes (CPU: float16 and bfloat16; CUDA: float16, and bfloat16 where supported)."""
    for device in autocast_devices():
        if device == "cpu":
            yield from (("cpu", torch.float16), ("cpu", torch.bfloat16))
        elif device == "cuda":
            yield "cuda", torch.float16
            if torch.cuda.is_bf16_supported():
                yield "cuda", torch.bfloat16
        else:
            yield device, torch.get_autocast_dtype(device)


def report_network(device: str = "cpu") -> nn.Sequential:
    """The network of the bug report pytorch#88929, seeded: Linear(4,4) -> BatchNorm1d(4) -> Linear(4,5)."""
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return net.to(device)


def _layer_dtypes(net: nn.Sequential, device: str, dtype: torch.dtype) -> List[torch.dtype]:
    out = torch.randn(2, 4, device=device)
    dtypes = []
    with torch.autocast(device, dtype=dtype):
        for layer in net:
            out = layer(out)
            dtypes.append(out.dtype)
    return dtypes


class Expected(NamedTuple):
    dtype: torch.dtype  # BatchNorm's output dtype under autocast
    passed_through: bool  # the settings leave the call to torch
    why: str


def expected_output(config: Config, device: str, dtype: torch.dtype, policy: Optional[str] = None) -> Expected:
    """What a BatchNorm after a Linear returns under ``dtype`` autocast on ``device`` with ``config``
    (and ``policy`` in force, by default the config's): float32 with ``fp32``, what it receives,
    autocast's dtype, with ``input`` and ``autocast``, and torch's own where the policy is ``off``
    or the settings leave ``device`` out."""
    policy = policy or config.policy
    if config.devices is not None and device not in config.devices:
        return Expected(dtype, True, f"passed through: {device} is not among the devices ({config.describe('devices')})")
    if policy == "off":
        return Expected(dtype, True, "passed through: policy off")
    return Expected(torch.float32 if policy == "fp32" else dtype, False, f"policy {policy}")


def report_rows(device: str, dtype: torch.dtype) -> List[DemoRow]:
    """The report's Linear -> BatchNorm1d -> Linear, each layer's output dtype both ways.

    The shim runs with the policy in force in this thread. Leaves the patch as it found it.
    """
    net = report_network(device)
    batch_norm = expected_output(_state.config, device, dtype, _state.policy()).dtype
    with _patch.uninstalled():
        without = _layer_dtypes(net, device, dtype)
    with _patch.installed():
        with_shim = _layer_dtypes(net, device, dtype)
    return [
        DemoRow(device, dtype, type(layer).__name__, a, b,
                batch_norm if isinstance(layer, nn.modules.batchnorm._BatchNorm) else dtype)
        for layer, a, b in zip(net, without, with_shim)
    ]
