"""The seed report, reproduced: per-layer output dtypes under autocast, without and with the shim."""

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


def seed_rows(device: str, dtype: torch.dtype) -> List[DemoRow]:
    """The seed's Linear -> BatchNorm1d -> Linear, each layer's output dtype both ways.

    Leaves the patch as it found it.
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).to(device)
    was_installed = _patch.is_installed()
    try:
        _patch.uninstall()
        without = _layer_dtypes(net, device, dtype)
        _patch.install()
        with_shim = _layer_dtypes(net, device, dtype)
    finally:
        if not was_installed:
            _patch.uninstall()
    names = [type(layer).__name__ for layer in net]
    return [DemoRow(device, dtype, *row) for row in zip(names, without, with_shim)]
