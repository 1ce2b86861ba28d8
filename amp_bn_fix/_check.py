"""``amp-bn-fix check``: what is installed, what is in force, and whether the shim works here.

Only gathers facts and runs the self-test; the command line formats them.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
import wrapt
from _amp_bn_fix_boot import settings
from _amp_bn_fix_boot._version import __version__

from . import _patch, _state
from ._demo import expected_output, report_network


# What has run where, said wherever a GPU user meets the package (README, FAQ, compatibility.md).
# When a GPU run has happened, this says what it showed.
GPU_STATUS = (
    "amp_bn_fix has not run on a GPU yet: it is tested on CPU, where the route a CUDA call takes is "
    "emulated (amp_bn_fix.testing.device_route()). tools/gpu_check.sh, run from a clone, checks this "
    "machine in under 8 minutes; its CUDA costs per policy are predictions until then (docs/performance.md)."
)


def gpu_status() -> Optional[str]:
    """The status line for a machine with CUDA, or None without it (a CPU user gets what was tested)."""
    return GPU_STATUS if torch.cuda.is_available() else None


class SelfTest(NamedTuple):
    device: str
    dtype: torch.dtype
    ok: bool
    detail: str
    # What BatchNorm computed, for a caller to check against its own reference: its input, weight,
    # bias, running stats before the call, output, running stats after it (None after an error).
    tensors: Optional[Tuple[torch.Tensor, ...]] = None


# A fresh interpreter of this environment imports torch, and nothing else, then says whether
# torch.nn.functional.batch_norm is amp_bn_fix's wrapper: what the start-up hook did there.
_FRESH_PROBE = (
    "import torch, torch.nn.functional as F; "
    "print('shim' if getattr(type(F.batch_norm), '_amp_bn_fix_wrapper', False) is True else 'plain')"
)


class FreshInterpreter(NamedTuple):
    enabled: Optional[bool]  # None when the interpreter failed
    stderr: List[str]


def fresh_interpreter() -> FreshInterpreter:
    """``import torch`` in a new interpreter with this environment and working directory."""
    try:
        result = subprocess.run([sys.executable, "-c", _FRESH_PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return FreshInterpreter(None, [f"{type(exc).__name__}: {exc}"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    verdict = result.stdout.split()[-1:] if result.returncode == 0 else []
    return FreshInterpreter(verdict == ["shim"] if verdict else None, lines[-5:])


def versions() -> List[Tuple[str, str]]:
    return [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("wrapt", wrapt.__version__),
        ("amp_bn_fix", __version__),
    ]


def config_rows() -> List[Tuple[str, str, str]]:
    """(setting, value, where it came from: default / env / API) for the effective config."""
    config = _state.config
    return [(name, config.describe(name), config.sources[name]) for name in settings.CONFIG_NAMES]


def self_test(device: str, dtype: torch.dtype) -> SelfTest:
    """The bug report's case (Linear -> BatchNorm1d -> Linear, training) under autocast, with the settings in force.

    Passes when BatchNorm's output has the dtype the settings give (float32 with ``fp32``, 16-bit
    where the policy or ``AMP_BN_FIX_DEVICES`` leaves it to torch) and matches a float64
    reference computed from the same 16-bit input, and the running stats stay float32 and match
    the reference update. Runs with the patch installed; leaves it as it found it.
    """
    config = _state.config
    try:
        with _patch.installed():
            return _report_case(device, dtype, config)
    except Exception as exc:
        return SelfTest(device, dtype, False, f"error: {type(exc).__name__}: {exc}")


def _report_case(device: str, dtype: torch.dtype, config: settings.Config) -> SelfTest:
    net = report_network(device)
    bn = net[1]
    before = (bn.running_mean.clone(), bn.running_var.clone())
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=dtype):
        hidden = net[0](x)
        normalized = bn(hidden)
        net[2](normalized)
    tensors = (hidden.detach(), bn.weight.detach(), bn.bias.detach(), *before, normalized.detach(),
               bn.running_mean.detach(), bn.running_var.detach())
    expected, passed_through, why = expected_output(config, device, dtype)
    if hidden.dtype is not dtype:
        detail = f"autocast gave Linear output {dtype_name(hidden.dtype)}, expected {dtype_name(dtype)}"
        return SelfTest(device, dtype, False, detail, tensors)
    if normalized.dtype is not expected:
        detail = f"BatchNorm1d output is {dtype_name(normalized.dtype)}, expected {dtype_name(expected)} ({why})"
        return SelfTest(device, dtype, False, detail, tensors)
    if not passed_through and (bn.running_mean.dtype is not torch.float32 or bn.running_var.dtype is not torch.float32):
        return SelfTest(device, dtype, False, f"running stats became {dtype_name(bn.running_mean.dtype)}", tensors)
    error, stats_error = errors_against_float64(tensors, bn.momentum, bn.eps)
    # FP32 statistics over 8 values, then a rounding or two to the output dtype (a pass-through
    # computes in the input's 16 bits).
    tolerance = 4 * torch.finfo(expected).eps + 64 * torch.finfo(torch.float32).eps
    if error > tolerance or stats_error > tolerance:
        detail = f"max |error| {error:.1e} (output), {stats_error:.1e} (running stats) vs float64"
        return SelfTest(device, dtype, False, detail, tensors)
    return SelfTest(device, dtype, True, f"BatchNorm1d output {dtype_name(normalized.dtype)} ({why}), "
                    f"max |error| {error:.1e} vs float64", tensors)


def errors_against_float64(tensors: Tuple[torch.Tensor, ...], momentum: float, eps: float) -> Tuple[float, float]:
    """Largest errors of the output and of the updated running stats against float64."""
    hidden, weight, bias, mean, var, out, new_mean, new_var = (t.double().cpu() for t in tensors)
    # A float64 call is torch's own whatever the shim's state: the reference never goes through it.
    expected = F.batch_norm(hidden, mean, var, weight, bias, True, momentum, eps)
    scale = expected.abs().max().item() + 1
    error = (out - expected).abs().max().item() / scale
    stats_error = max((new_mean - mean).abs().max().item(), (new_var - var).abs().max().item()) / (var.abs().max().item() + 1)
    return error, stats_error


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")
