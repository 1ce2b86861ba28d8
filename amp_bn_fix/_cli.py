"""The ``amp-bn-fix`` commands that need torch: ``demo`` and ``check``.

The command line itself (arguments, ``--help``, errors, ``run``) is ``_amp_bn_fix_boot.cli``,
which imports neither torch nor this package until one of these commands runs.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple

from _amp_bn_fix_boot import settings
from _amp_bn_fix_boot import status as startup
from _amp_bn_fix_boot.names import ENV_ENABLE

from . import _check, _demo, _state

REPORT = "the bug report pytorch#88929"


def _format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def demo(args: Optional[argparse.Namespace] = None) -> int:
    """Each layer's output dtype under autocast without and with the shim; 1 when one is not as expected."""
    policy = _state.policy()
    print(f"{REPORT[0].upper() + REPORT[1:]}: Linear(4,4) -> BatchNorm1d(4) -> Linear(4,5) under autocast")
    print(f"amp_bn_fix policy: {policy} (from {_state.config.sources['policy']})\n")
    rows: List[_demo.DemoRow] = [row for device, dtype in _demo.cases() for row in _demo.report_rows(device, dtype)]
    name = _check.dtype_name
    table = [[r.device, name(r.autocast_dtype), r.layer, name(r.without), name(r.with_shim), name(r.expected)] for r in rows]
    print(_format_table(["device", "autocast", "layer", "without shim", "with shim", "expected"], table))
    devices = _state.config.devices
    left_out = sorted({r.device for r in rows if devices is not None and r.device not in devices})
    ok, verdict = demo_verdict(policy, all(r.with_shim == r.expected for r in rows), left_out,
                               len(left_out) == len({r.device for r in rows}))
    print(f"\n{verdict}")
    return 0 if ok else 1


_DEVICES_VARIABLE = settings.BY_NAME["devices"].env


def demo_verdict(policy: str, as_expected: bool, left_out: Sequence[str] = (), all_left_out: bool = False) -> Tuple[bool, str]:
    """(passed, one line) for the demo's table; ``left_out``: its device types that
    ``AMP_BN_FIX_DEVICES`` leaves to torch (``all_left_out``: every one of them)."""
    if not as_expected:
        return False, "MISMATCH: with the shim some layer does not have the expected dtype (see the table; amp-bn-fix check runs a self-test)"
    if left_out:
        devices = ", ".join(left_out)
        if all_left_out:
            return True, (f"with the shim every layer has the expected dtype; both columns match because "
                          f"{_DEVICES_VARIABLE} leaves {devices} to torch, which the shim passes through untouched")
        policy_line = demo_verdict(policy, True)[1]
        return True, f"{policy_line} ({devices}: passed through untouched, not among {_DEVICES_VARIABLE})"
    if policy == "fp32":
        return True, f"with the shim every layer has the expected dtype: BatchNorm1d returns float32, as {REPORT} asks"
    why = {
        "input": "BatchNorm returns its input's dtype (its statistics and running-stat update are still FP32)",
        "autocast": "BatchNorm returns autocast's dtype (its statistics and running-stat update are still FP32)",
        "off": "the shim passes every call through untouched",
    }[policy]
    return True, (
        f"with the shim every layer has the expected dtype; both columns match because the policy is {policy}: "
        f"{why}. The default policy, fp32, returns float32"
    )


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _fields(pairs: Sequence[Tuple[str, str]]) -> str:
    """``name  value`` lines with the values aligned; a multi-line value continues under itself."""
    width = max(len(name) for name, _ in pairs) + 2
    return "\n".join(name.ljust(width) + value.replace("\n", "\n" + " " * width) for name, value in pairs)


def _switch(status: "startup.StartupStatus") -> str:
    if status.switch is None:
        return "unset (off)"
    if not status.switch_readable:
        return f"{status.switch!r} (not valid: the start-up hook says so and stays off)"
    return f"{status.switch!r} ({'on' if status.requested else 'off'})"


def check(args: Optional[argparse.Namespace] = None) -> int:
    """Versions, devices, settings, the start-up hook, a fresh interpreter and a self-test.

    Exits with 1 when the self-test fails, or when a Python process of this environment would not
    get the shim although ``AMP_BN_FIX`` asks for it (or ``AMP_BN_FIX`` cannot be read).
    """
    status = startup.gather()
    print("versions:")
    print(_indent(_fields(_check.versions())))
    print(f"\nautocast devices: {', '.join(_demo.autocast_devices())}")
    gpu = _check.gpu_status()
    if gpu is not None:
        print(f"\nGPU status: {gpu}")
    print("\nconfig:")
    print(_indent(_format_table(["setting", "value", "from"], [list(row) for row in _check.config_rows()])))
    if status.unknown:
        print(_indent(settings.describe_unknown(status.unknown)))
    print("\nstart-up hook:")
    print(_indent(_fields([
        ("installed", "\n".join(status.start_files) or "no (not in a site directory of this interpreter)"),
        (ENV_ENABLE, _switch(status)),
        ("launcher", "in use (amp-bn-fix run)" if status.bootstrap_on_path else "not in use"),
    ])))
    fresh = _check.fresh_interpreter()
    verdict = {True: "the shim is enabled", False: "torch is plain (no shim)", None: "the interpreter failed"}[fresh.enabled]
    print(f"\na fresh interpreter here (import torch): {verdict}")
    for line in fresh.stderr:
        print(_indent(line))
    print(_indent(startup.summary(status)))
    broken = status.broken or (status.will_enable and fresh.enabled is not True)
    print("\nself-test (Linear -> BatchNorm1d -> Linear under autocast, the settings above):")
    results = [_check.self_test(device, dtype) for device, dtype in _demo.cases()]
    rows = [[r.device, _check.dtype_name(r.dtype), "ok" if r.ok else "FAIL", r.detail] for r in results]
    print(_indent(_format_table(["device", "autocast", "result", "detail"], rows)))
    return 0 if all(r.ok for r in results) and not broken else 1
