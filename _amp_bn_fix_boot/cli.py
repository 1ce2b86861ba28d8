"""The ``amp-bn-fix`` command line: its console script (also ``python -m amp_bn_fix``) and ``run``.

Every argument is parsed here, without importing torch or amp_bn_fix, so ``--help``, ``--version``
and argument errors cost no torch import. ``demo`` and ``check`` need torch: they check the
settings in the environment first (a bad one is one line on stderr and exit status 2), then run
from ``amp_bn_fix._cli``, imported only then.

``amp-bn-fix run [--policy P] [--devices D] [--keep-fp32 K] [--guard G] -- CMD [ARGS...]`` sets
``AMP_BN_FIX=1`` and the given settings, puts the bootstrap folder (whose sitecustomize starts the
hook) first on ``PYTHONPATH`` and replaces itself with ``CMD``: the exit code is the command's, and
every Python process it starts inherits the environment.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Callable, List, Optional, Sequence

from . import settings
from .names import BOOTSTRAP_DIR, COMMAND, ENV_DEVICES, ENV_ENABLE, ENV_GUARD, ENV_KEEP_FP32, ENV_POLICY, ENV_REPORT

PROG = COMMAND


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for an unknown option names the closest valid ones."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[name-defined]
        if message.startswith("unrecognized arguments:"):
            known = [o for action in self._actions for o in action.option_strings]
            for subparsers in (a for a in self._actions if isinstance(a, argparse._SubParsersAction)):
                known += [o for parser in subparsers.choices.values() for a in parser._actions for o in a.option_strings]
            for word in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(word, sorted(set(known)), n=3, cutoff=0.6)
                if word.startswith("-") and close:
                    message += f" (did you mean {' or '.join(close)}?)"
        super().error(message)


def _devices(value: str) -> str:
    try:
        devices = settings.parse_devices(value, "--devices")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return "all" if devices is None else ",".join(sorted(devices))


def _guard(value: str) -> str:
    try:
        return "1" if settings.parse_flag(value, "--guard") else "0"
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _error(problem: str) -> int:
    """A usage error that is not in the arguments: one line, exit status 2 (as argparse's)."""
    print(f"{PROG}: error: {problem}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The whole ``amp-bn-fix`` parser: ``demo``, ``check`` and ``run``."""
    from ._version import __version__

    parser = _Parser(
        prog=PROG,
        description="Run BatchNorm in FP32 under torch.autocast: see the shim work (demo), check an "
        "installation (check) or run a program with the shim enabled in all of its Python processes (run).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    demo = commands.add_parser(
        "demo",
        help="each layer's output dtype under autocast, without and with the shim",
        description="The network of the bug report pytorch#88929 (Linear -> BatchNorm1d -> Linear) under "
        "CPU autocast (and CUDA when present): each layer's output dtype without the shim, with it, and the "
        "one expected with the policy in force. Exits with 1 when a layer does not have the expected dtype.",
    )
    demo.set_defaults(func=_in_package("demo"))
    check = commands.add_parser(
        "check",
        help="versions, devices, settings, start-up hook and a self-test",
        description="Print the versions, the devices autocast can use, whether the shim is active, each "
        "setting and where it came from, the start-up hook's state and a self-test on each device. Exits "
        "with 1 when the self-test fails.",
    )
    check.set_defaults(func=_in_package("check"))
    add_run_parser(commands)
    return parser


def _in_package(name: str) -> Callable[[argparse.Namespace], int]:
    """A command that runs ``amp_bn_fix._cli.<name>`` once the environment's settings are known good."""

    def command(args: argparse.Namespace) -> int:
        try:
            settings.from_env(os.environ)
        except ValueError as exc:
            # Importing amp_bn_fix would raise it as a traceback.
            return _error(f"{exc} (from the environment)")
        from amp_bn_fix import _cli

        return getattr(_cli, name)(args)

    return command


def add_run_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add the ``run`` command to ``commands`` (the subparsers of the ``amp-bn-fix`` parser)."""
    parser = commands.add_parser(
        "run",
        usage=f"{PROG} run [-h] [--policy P] [--devices D] [--keep-fp32 K] [--guard G] [--report] -- CMD [ARGS...]",
        help="run a command with the shim enabled in all of its Python processes",
        description="Run CMD with AMP_BN_FIX=1 and a start-up hook on PYTHONPATH, so that every "
        "Python process it starts (torchrun workers included) enables the shim when it imports torch.",
    )
    parser.add_argument(
        "--policy",
        choices=settings.POLICIES,
        metavar="P",
        help=f"{', '.join(settings.POLICIES)}; sets {ENV_POLICY}",
    )
    parser.add_argument(
        "--devices", type=_devices, metavar="D", help=f"'all' or a comma list such as cuda,cpu; sets {ENV_DEVICES}"
    )
    parser.add_argument(
        "--keep-fp32", choices=settings.KEEP_MODES, metavar="K",
        help=f"{', '.join(settings.KEEP_MODES)}; sets {ENV_KEEP_FP32}",
    )
    parser.add_argument("--guard", type=_guard, metavar="G", help=f"1 or 0; sets {ENV_GUARD}")
    parser.add_argument("--report", action="store_true",
                        help=f"each Python process writes a one-line summary of what the shim did to stderr at exit; sets {ENV_REPORT}=1")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command to run")
    parser.set_defaults(func=lambda args: run(parser, args))
    return parser


def environment(policy: Optional[str], devices: Optional[str], base: Optional[dict] = None,
                keep_fp32: Optional[str] = None, guard: Optional[str] = None, report: bool = False) -> dict:
    """The environment ``run`` gives its command: ``base`` (default: ours) with the shim switched on.

    Raises:
        ValueError: when a setting, given or inherited, is not valid.
    """
    env = dict(os.environ if base is None else base)
    env[ENV_ENABLE] = "1"
    settings_given = ((ENV_POLICY, policy), (ENV_DEVICES, devices), (ENV_KEEP_FP32, keep_fp32), (ENV_GUARD, guard),
                      (ENV_REPORT, "1" if report else None))
    for name, value in settings_given:
        if value is not None:
            env[name] = value
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
        env = environment(args.policy, args.devices, keep_fp32=args.keep_fp32, guard=args.guard, report=args.report)
    except ValueError as exc:
        return _error(f"{exc} (from the environment)")
    try:
        settings.parse_flag(os.environ.get(ENV_ENABLE, "1"), ENV_ENABLE)
    except ValueError as exc:
        # Harmless here, as run sets it; said once so that the shell's value gets fixed.
        print(f"{PROG} run: warning: {exc}; the command runs with {ENV_ENABLE}=1", file=sys.stderr)
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"{PROG} run: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    raise AssertionError("unreachable: exec returned")  # pragma: no cover


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``amp-bn-fix`` console script and of ``python -m amp_bn_fix``."""
    args = build_parser().parse_args(argv)
    return args.func(args)
