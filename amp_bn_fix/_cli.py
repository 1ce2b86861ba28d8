"""The ``amp-bn-fix`` command line (also ``python -m amp_bn_fix``)."""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

import torch

from . import _demo, _patch


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _format_table(header: Sequence[str], rows: List[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def cmd_demo(args: argparse.Namespace) -> int:
    print("Seed (pytorch issue 88929): Linear(4,4) -> BatchNorm1d(4) -> Linear(4,5) under autocast")
    print(f"amp_bn_fix policy: {_patch.active_policy()}\n")
    rows = []
    for device, dtype in _demo.cases():
        for row in _demo.seed_rows(device, dtype):
            rows.append([row.device, _short(row.autocast_dtype), row.layer, _short(row.without), _short(row.with_shim)])
    print(_format_table(["device", "autocast", "layer", "without shim", "with shim"], rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amp-bn-fix", description="Run BatchNorm in FP32 under torch.autocast."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="reproduce the seed report without and with the shim")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
