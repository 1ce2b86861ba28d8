"""The ``amp-bn-fix`` command line (also ``python -m amp_bn_fix``)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence, Tuple

from _amp_bn_fix_boot import launcher

from . import _check, _config, _demo, _patch


def _format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def cmd_demo(args: argparse.Namespace) -> int:
    print("Seed (pytorch issue 88929): Linear(4,4) -> BatchNorm1d(4) -> Linear(4,5) under autocast")
    print(f"amp_bn_fix policy: {_patch.active_policy()}\n")
    rows = []
    for device, dtype in _demo.cases():
        for row in _demo.seed_rows(device, dtype):
            rows.append([row.device, _check.dtype_name(row.autocast_dtype), row.layer, _check.dtype_name(row.without), _check.dtype_name(row.with_shim)])
    print(_format_table(["device", "autocast", "layer", "without shim", "with shim"], rows))
    return 0


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _fields(pairs: Sequence[Tuple[str, str]]) -> str:
    """``name  value`` lines with the values aligned; a multi-line value continues under itself."""
    width = max(len(name) for name, _ in pairs) + 2
    return "\n".join(name.ljust(width) + value.replace("\n", "\n" + " " * width) for name, value in pairs)


def _hook_switch(value: Optional[str]) -> str:
    if value is None:
        return "unset (off)"
    try:
        return f"{value!r} ({'on' if _config.hook_requested({_config.ENV_ENABLE: value}) else 'off'})"
    except ValueError as exc:
        return f"{value!r} (invalid: {exc})"


def cmd_check(args: argparse.Namespace) -> int:
    hook = _check.hook_status()
    print("versions:")
    print(_indent(_fields(_check.versions())))
    print(f"\nautocast devices: {', '.join(_check.autocast_devices())}")
    print(f"patch: {'active' if _patch.is_installed() else 'not active'} in this process")
    print("\nconfig:")
    print(_indent(_format_table(["setting", "value", "from"], [list(row) for row in _check.config_rows()])))
    print("\nstart-up hook:")
    print(_indent(_fields([
        ("installed", "\n".join(hook.files) or "no (reinstall amp_bn_fix)"),
        (_config.ENV_ENABLE, _hook_switch(hook.env_value)),
        ("this process", "started: enables the shim when torch is imported" if hook.registered else "not started"),
        ("launcher", "in use (amp-bn-fix run)" if hook.launcher else "not in use"),
    ])))
    print("\nself-test (seed: Linear -> BatchNorm1d -> Linear under autocast, policy fp32):")
    results = [_check.self_test(device, dtype) for device, dtype in _check.self_test_cases()]
    rows = [[r.device, _check.dtype_name(r.dtype), "ok" if r.ok else "FAIL", r.detail] for r in results]
    print(_indent(_format_table(["device", "autocast", "result", "detail"], rows)))
    return 0 if all(r.ok for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amp-bn-fix", description="Run BatchNorm in FP32 under torch.autocast."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="reproduce the seed report without and with the shim")
    demo.set_defaults(func=cmd_demo)
    check = commands.add_parser("check", help="versions, devices, settings, start-up hook and a self-test")
    check.set_defaults(func=cmd_check)
    launcher.add_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
