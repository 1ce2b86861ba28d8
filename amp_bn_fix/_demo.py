"""The bug report (pytorch#88929), reproduced: per-layer output dtypes under autocast, without and with the shim."""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Tuple

import torch
from torch import nn

from . import _patch


class DemoRow(NamedTuple):
    device: str
    autocast_dtype: torch.dtype
    layer: str
    without: torch.dtype
    with_shim: torch.dtype
    expected: torch.dtype  # what the active policy should give


def cases() -> Iterator[Tuple[str, torch.dtype]]:
    """(device type, autocast dtype) pairs to show: CUDA fp16 when present, CPU fp16 and bf16 always."""
    if torch.cuda.is_available():
        yield "cuda", torch.float16
    yield "cpu", torch.float16
    yield "cpu", torch.bfloat16


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
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).to(device)
    policy = _patch.active_policy()
    was_installed = _patch.is_installed()
    try:
        _patch.uninstall()
        without = _layer_dtypes(net, device, dtype)
        _patch.install()
        with_shim = _layer_dtypes(net, device, dtype)
    finally:
        if not was_installed:
            _patch.uninstall()
    return [
        DemoRow(device, dtype, type(layer).__name__, a, b, expected_dtype(layer, dtype, policy))
        for layer, a, b in zip(net, without, with_shim)
    ]
