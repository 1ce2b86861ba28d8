"""The ``amp-bn-fix`` console script and its ``run`` command (the launcher).

``amp-bn-fix run [--policy P] [--devices D] -- CMD [ARGS...]`` sets ``AMP_BN_FIX=1`` and the given
settings, puts the bootstrap folder (whose sitecustomize starts the hook) first on ``PYTHONPATH``
and replaces itself with ``CMD``: the exit code is the command's, and every Python process it starts
inherits the environment. ``run`` is handled here without importing torch; every other command is
passed on to ``amp_bn_fix._cli``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from . import config

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def _devices(value: str) -> str:
    try:
        devices = config.load().parse_devices(value, "--devices")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return "all" if devices is None else ",".join(sorted(devices))


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add the ``run`` command to ``commands`` (the subparsers of an ``amp-bn-fix`` parser)."""
    settings = config.load()
    parser = commands.add_parser(
        "run",
        usage="amp-bn-fix run [-h] [--policy P] [--devices D] -- CMD [ARGS...]",
        help="run a command with the shim enabled in all of its Python processes",
        description="Run CMD with AMP_BN_FIX=1 and a start-up hook on PYTHONPATH, so that every "
        "Python process it starts (torchrun workers included) enables the shim when it imports torch.",
    )
    parser.add_argument(
        "--policy",
        choices=settings.POLICIES,
        metavar="P",
        help=f"{', '.join(settings.POLICIES)}; sets {settings.ENV_POLICY}",
    )
    parser.add_argument(
        "--devices", type=_devices, metavar="D", help=f"'all' or a comma list such as cuda,cpu; sets {settings.ENV_DEVICES}"
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command to run")
    parser.set_defaults(func=lambda args: run(parser, args))
    return parser


def environment(policy: Optional[str], devices: Optional[str], base: Optional[dict] = None) -> dict:
    """The environment ``run`` gives its command: ``base`` (default: ours) with the shim switched on.

    Raises:
        ValueError: when a setting, given or inherited, is not valid.
    """
    settings = config.load()
    env = dict(os.environ if base is None else base)
    env[settings.ENV_ENABLE] = "1"
    if policy is not None:
        env[settings.ENV_POLICY] = policy
    if devices is not None:
        env[settings.ENV_DEVICES] = devices
    settings.from_env(env)
    inherited = env.get("PYTHONPATH")
    entries = [p for p in inherited.split(os.pathsep) if p != BOOTSTRAP_DIR] if inherited else []
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *entries])
    return env


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Replace this process with the command; returns only when it cannot be started."""
    command: List[str] = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        parser.error("missing the command to run, e.g. amp-bn-fix run -- python train.py")
    try:
        env = environment(args.policy, args.devices)
    except ValueError as exc:
        parser.error(f"{exc} (from the environment)")
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"amp-bn-fix run: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    raise AssertionError("unreachable: exec returned")  # pragma: no cover


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``amp-bn-fix`` console script."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["run"]:
        parser = argparse.ArgumentParser(prog="amp-bn-fix")
        add_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
        args = parser.parse_args(arguments)
        return args.func(args)
    # The other commands import amp_bn_fix, whose import raises on a bad setting: say it plainly.
    try:
        config.load().from_env()
    except ValueError as exc:
        print(f"amp-bn-fix: error: {exc} (from the environment)", file=sys.stderr)
        return 2
    from amp_bn_fix import _cli

    return _cli.main(arguments)
