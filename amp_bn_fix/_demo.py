"""The bug report (pytorch#88929), reproduced: per-layer output dtypes under autocast, without and with the shim."""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Tuple

import torch
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


def expected_dtype(layer: nn.Module, dtype: torch.dtype, policy: str) -> torch.dtype:
    """The output dtype of ``layer`` in the report's network under ``dtype`` autocast with ``policy``.

    Linear runs in autocast's dtype. BatchNorm receives that dtype and returns float32 with the
    ``fp32`` policy (what the report asks for); with ``input``, ``autocast`` and ``off`` it returns
    the dtype it receives, which here is autocast's too.
    """
    if isinstance(layer, nn.modules.batchnorm._BatchNorm) and policy == "fp32":
        return torch.float32
    return dtype


def report_rows(device: str, dtype: torch.dtype) -> List[DemoRow]:
    """The report's Linear -> BatchNorm1d -> Linear, each layer's output dtype both ways.

    The shim runs with the policy in force in this thread. Leaves the patch as it found it.
    """
    net = report_network(device)
    policy = _state.policy()
    with _patch.uninstalled():
        without = _layer_dtypes(net, device, dtype)
    with _patch.installed():
        with_shim = _layer_dtypes(net, device, dtype)
    return [
        DemoRow(device, dtype, type(layer).__name__, a, b, expected_dtype(layer, dtype, policy))
        for layer, a, b in zip(net, without, with_shim)
    ]
