"""Running-statistic accuracy of a half model per ``keep_fp32`` mode, against float64.

A ``.half()``/``.bfloat16()`` Conv2d + BatchNorm2d trains for a few hundred steps under autocast on
inputs whose batch statistics move a little each step (the small updates 16-bit statistics lose).
The BatchNorm's inputs are recorded and replayed in float64 from the same starting statistics;
each mode's running variance and mean are compared with that replay: the model's own buffers, and
for ``master`` also the FP32 master the shim keeps beside them. Plain torch (the shim disabled) is
the baseline.

    python benchmarks/half_model_accuracy.py [--steps 300]
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import amp_bn_fix
from amp_bn_fix import _master

MODES = ("master", "all", "stats", "none")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))


def _errors(keep: Optional[str], dtype: torch.dtype, steps: int) -> Dict[str, float]:
    """Relative error of the running variance, absolute of the mean, after ``steps`` (``keep`` None: plain torch)."""
    scope = amp_bn_fix.configure(keep_fp32=keep) if keep else contextlib.nullcontext()
    with scope:
        if keep is None:
            amp_bn_fix.disable()
        model = _model().to(dtype)
        seen: List[torch.Tensor] = []
        hook = model[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
        for step in range(steps):
            x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(step)) * 0.05 + 2
            with torch.autocast("cpu", dtype=dtype):
                model(x.to(dtype))
        hook.remove()
        bn = model[1]
        master = _master.peek(bn.running_mean, bn.running_var)
        amp_bn_fix.disable()  # the float64 replay is torch's own
        mean64, var64 = torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
        for x in seen:
            F.batch_norm(x.double(), mean64, var64, None, None, True, 0.1, 1e-5)
        amp_bn_fix.enable()

    def var_error(var: torch.Tensor) -> float:
        return ((var.double() - var64).abs() / var64).max().item()

    errors = {
        "buffers var": var_error(bn.running_var),
        "buffers mean": (bn.running_mean.double() - mean64).abs().max().item(),
    }
    if master is not None:
        errors["master var"] = var_error(master[1])
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    steps = parser.parse_args().steps
    print("| dtype | keep_fp32 | running var, rel. error | running mean, abs. error | master var, rel. error |")
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        for keep in (None, *MODES):
            e = _errors(keep, dtype, steps)
            master = f"{e['master var']:.1e}" if "master var" in e else "-"
            name = keep or "plain torch"
            print(f"| {str(dtype)[6:]} | {name} | {e['buffers var']:.1e} | {e['buffers mean']:.1e} | {master} |")


if __name__ == "__main__":
    main()
