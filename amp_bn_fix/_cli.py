"""The ``amp-bn-fix`` commands that need torch: ``demo`` and ``check``.

The command line itself (arguments, ``--help``, errors, ``run``) is ``_amp_bn_fix_boot.launcher``,
which imports neither torch nor this package until one of these commands runs.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple

from . import _check, _config, _demo, _patch

REPORT = "the bug report pytorch#88929"


def _format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def demo(args: Optional[argparse.Namespace] = None) -> int:
    """Each layer's output dtype under autocast without and with the shim; 1 when one is not as expected."""
    policy = _patch.active_policy()
    print(f"{REPORT[0].upper() + REPORT[1:]}: Linear(4,4) -> BatchNorm1d(4) -> Linear(4,5) under autocast")
    print(f"amp_bn_fix policy: {policy} (from {_patch.current_config().sources['policy']})\n")
    rows: List[_demo.DemoRow] = [row for device, dtype in _demo.cases() for row in _demo.report_rows(device, dtype)]
    name = _check.dtype_name
    table = [[r.device, name(r.autocast_dtype), r.layer, name(r.without), name(r.with_shim), name(r.expected)] for r in rows]
    print(_format_table(["device", "autocast", "layer", "without shim", "with shim", "expected"], table))
    ok, verdict = demo_verdict(policy, all(r.with_shim == r.expected for r in rows))
    print(f"\n{verdict}")
    return 0 if ok else 1


def demo_verdict(policy: str, as_expected: bool) -> Tuple[bool, str]:
    """(passed, one line) for the demo's table."""
    if not as_expected:
        return False, "MISMATCH: with the shim some layer does not have the expected dtype (see the table; amp-bn-fix check runs a self-test)"
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


def _hook_effect(hook: _check.HookStatus) -> Tuple[str, str]:
    """(how AMP_BN_FIX reads, what the Python processes of this environment do at ``import torch``)."""
    if hook.env_value is None:
        switch, on = "unset (off)", False
    else:
        try:
            on = _config.parse_flag(hook.env_value, _config.ENV_ENABLE)
        except ValueError as exc:
            return f"{hook.env_value!r} (invalid: {exc})", "run without the shim and print one warning line"
        switch = f"{hook.env_value!r} ({'on' if on else 'off'})"
    if not hook.files:
        return switch, "run without the shim unless they import amp_bn_fix (the hook is not installed: reinstall amp_bn_fix)"
    if on:
        return switch, "enable the shim when they import torch"
    return switch, f"run without the shim unless they import amp_bn_fix (set {_config.ENV_ENABLE}=1 to enable it in all of them)"


def check(args: Optional[argparse.Namespace] = None) -> int:
    """Versions, devices, settings, the start-up hook and a self-test; 1 when the self-test fails."""
    hook = _check.hook_status()
    print("versions:")
    print(_indent(_fields(_check.versions())))
    print(f"\nautocast devices: {', '.join(_check.autocast_devices())}")
    print(f"patch: {'active' if _patch.is_installed() else 'not active'} in this process")
    print(_indent(_fields([
        ("repr(F.batch_norm)", _check.batch_norm_repr()),
        ("in your program", "amp_bn_fix.is_enabled() is True while the shim is on, and repr() of\n"
                            "torch.nn.functional.batch_norm shows a ShimWrapper (str() and print()\n"
                            "show the original function either way)"),
    ])))
    print("\nconfig:")
    print(_indent(_format_table(["setting", "value", "from"], [list(row) for row in _check.config_rows()])))
    switch, effect = _hook_effect(hook)
    print("\nstart-up hook:")
    print(_indent(_fields([
        ("installed", "\n".join(hook.files) or "no (reinstall amp_bn_fix)"),
        (_config.ENV_ENABLE, switch),
        ("python processes", effect),
        ("launcher", "in use (amp-bn-fix run)" if hook.launcher else "not in use"),
    ])))
    print(f"\nself-test ({REPORT}: Linear -> BatchNorm1d -> Linear under autocast, policy fp32):")
    results = [_check.self_test(device, dtype) for device, dtype in _check.self_test_cases()]
    rows = [[r.device, _check.dtype_name(r.dtype), "ok" if r.ok else "FAIL", r.detail] for r in results]
    print(_indent(_format_table(["device", "autocast", "result", "detail"], rows)))
    return 0 if all(r.ok for r in results) else 1
