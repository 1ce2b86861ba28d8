"""``amp-bn-fix check``: what is installed, what is in force, and whether the shim works here.

Only gathers facts and runs the self-test; the command line formats them.
"""

from __future__ import annotations

import os
import platform
import site
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
import wrapt
from _amp_bn_fix_boot import launcher
from torch import nn

from . import _config, _patch
from ._version import __version__

START_FILES = ("amp_bn_fix.pth", "amp_bn_fix.start")
# Device types that can run autocast, each with how to ask whether one is present.
_DEVICE_MODULES = ("cuda", "xpu", "mps", "hpu", "mtia")


class SelfTest(NamedTuple):
    device: str
    dtype: torch.dtype
    ok: bool
    detail: str


class HookStatus(NamedTuple):
    files: List[str]  # the start-up files found in this interpreter's site directories
    env_value: Optional[str]  # AMP_BN_FIX as set, None when unset
    launcher: bool  # ``amp-bn-fix run``'s bootstrap folder is on PYTHONPATH


def versions() -> List[Tuple[str, str]]:
    return [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("wrapt", wrapt.__version__),
        ("amp_bn_fix", __version__),
    ]


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


def config_rows() -> List[Tuple[str, str, str]]:
    """(setting, value, where it came from: default / env / API) for the effective config."""
    config = _patch.current_config()
    return [(name, config.describe(name), config.sources[name]) for name in ("policy", "devices", "keep_fp32", "guard")]


def hook_status() -> HookStatus:
    directories = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    files = [os.path.join(d, name) for d in directories for name in START_FILES if os.path.isfile(os.path.join(d, name))]
    pythonpath = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return HookStatus(
        files=files,
        env_value=os.environ.get(_config.ENV_ENABLE),
        launcher=launcher.BOOTSTRAP_DIR in pythonpath,
    )


def batch_norm_repr() -> str:
    """``repr(torch.nn.functional.batch_norm)``: names the wrapper while the shim is enabled.

    ``str()`` and ``print()`` show the original function either way: wrapt forwards them.
    """
    return repr(F.batch_norm)


def self_test_cases() -> Iterator[Tuple[str, torch.dtype]]:
    """(device, autocast dtype) pairs to test: each present device with its low-precision dtypes."""
    for device in autocast_devices():
        if device == "cpu":
            yield from (("cpu", torch.float16), ("cpu", torch.bfloat16))
        elif device == "cuda":
            yield "cuda", torch.float16
            if torch.cuda.is_bf16_supported():
                yield "cuda", torch.bfloat16
        else:
            yield device, torch.get_autocast_dtype(device)


def self_test(device: str, dtype: torch.dtype) -> SelfTest:
    """The bug report's case (Linear -> BatchNorm1d -> Linear, training) under autocast, policy fp32.

    Passes when BatchNorm's output is float32 and matches a float64 reference computed from the
    same half-precision input, and the running stats stay float32 and match the reference update.
    Runs with the default settings and the patch installed; leaves both as it found them.
    """
    saved_config, was_installed = _patch.current_config(), _patch.is_installed()
    try:
        _patch.configure(_config.Config())
        _patch.install()
        with _patch.scoped_policy(None):
            return _report_case(device, dtype)
    except Exception as exc:
        return SelfTest(device, dtype, False, f"error: {type(exc).__name__}: {exc}")
    finally:
        _patch.configure(saved_config)
        if not was_installed:
            _patch.uninstall()


def _report_case(device: str, dtype: torch.dtype) -> SelfTest:
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    net.to(device)
    bn = net[1]
    x = torch.randn(8, 4, generator=generator).to(device)
    # Copies of the initial stats; the reference call below updates them in place.
    expected_mean, expected_var = bn.running_mean.double(), bn.running_var.double()
    with torch.autocast(device, dtype=dtype):
        hidden = net[0](x)
        normalized = bn(hidden)
        net[2](normalized)
    if hidden.dtype is not dtype:
        detail = f"autocast gave Linear output {dtype_name(hidden.dtype)}, expected {dtype_name(dtype)}"
        return SelfTest(device, dtype, False, detail)
    if normalized.dtype is not torch.float32:
        return SelfTest(device, dtype, False, f"BatchNorm1d output is {dtype_name(normalized.dtype)}, expected float32")
    if bn.running_mean.dtype is not torch.float32 or bn.running_var.dtype is not torch.float32:
        return SelfTest(device, dtype, False, f"running stats became {dtype_name(bn.running_mean.dtype)}")
    original = _original_batch_norm()
    expected = original(
        hidden.detach().double(), expected_mean, expected_var, bn.weight.detach().double(), bn.bias.detach().double(),
        True, bn.momentum, bn.eps,
    )
    error = (normalized.detach().double() - expected).abs().max().item()
    stats_error = max(
        (bn.running_mean.double() - expected_mean).abs().max().item(),
        (bn.running_var.double() - expected_var).abs().max().item(),
    )
    if error > 1e-4 or stats_error > 1e-4:
        detail = f"max |error| {error:.1e} (output), {stats_error:.1e} (running stats) vs float64"
        return SelfTest(device, dtype, False, detail)
    return SelfTest(device, dtype, True, f"BatchNorm1d output float32, max |error| {error:.1e} vs float64")


def _original_batch_norm():
    """``F.batch_norm`` without our wrapper (the reference must not go through the shim)."""
    function = F.batch_norm
    while isinstance(function, wrapt.FunctionWrapper):
        function = function.__wrapped__
    return function


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")
