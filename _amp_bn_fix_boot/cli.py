"""The ``amp-bn-fix`` command line: its console script (also ``python -m amp_bn_fix``) and ``run``.

Every argument is parsed here, without importing torch or amp_bn_fix, so ``--help``, ``--version``
and argument errors cost no torch import. ``demo`` and ``check`` need torch: they check the
settings in the environment first (each bad one is one line on stderr, and the exit status is 2),
then run from ``amp_bn_fix._cli``, imported only then. ``python -m amp_bn_fix`` gets here too: the
package's import leaves a bad setting for this code to report when it is run as the command.

``amp-bn-fix run [--policy P] [--devices D] [--keep-fp32 K] [--guard G] [--report] -- CMD [ARGS...]``
(one option per setting of the settings table) sets ``AMP_BN_FIX=1`` and the given settings, puts
the bootstrap folder (whose sitecustomize starts the hook) first on ``PYTHONPATH`` and replaces
itself with ``CMD``: the exit code is the command's, and every Python process it starts inherits
the environment.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Union

from . import settings
from .names import BOOTSTRAP_DIR, COMMAND, ENV_ENABLE, PACKAGE

PROG = COMMAND


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for an unknown option says what was meant: the closest option
    of the command in use, or where an option of another one goes."""

    _words: List[str] = []

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None):  # type: ignore[override]
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                hint = self._hint(word.split("=", 1)[0]) if word.startswith("-") else None
                if hint:
                    message += f" ({hint})"
        super().error(message)

    def _hint(self, option: str) -> Optional[str]:
        own = [o for action in self._actions for o in action.option_strings]
        commands: Dict[str, argparse.ArgumentParser] = {}
        for subparsers in (a for a in self._actions if isinstance(a, argparse._SubParsersAction)):
            commands.update(subparsers.choices)
        name = next((word for word in self._words if word in commands), None)
        if name is None:
            known = own
        else:
            known = [o for action in commands[name]._actions for o in action.option_strings]
            if option in own:
                return f"{option} goes before the command: {self.prog} {option}"
            others = [other for other, parser in commands.items()
                      if other != name and any(option in a.option_strings for a in parser._actions)]
            if others:
                return f"{option} is an option of {' and '.join(others)}, not of {name}"
        close = difflib.get_close_matches(option, sorted(set(known)), n=3, cutoff=0.6)
        return f"did you mean {' or '.join(close)}?" if close else None


def _option_type(setting: settings.Setting) -> Callable[[str], str]:
    """argparse's ``type`` for ``setting``'s option: the value as its variable spells it, or an error."""

    def convert(value: str) -> str:
        try:
            return setting.spell(setting.parse_given(value, str(setting.option)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not valid; allowed values: {setting.allowed}") from None

    return convert


def _error(problem: str) -> int:
    """A usage error that is not in the arguments: one line, exit status 2 (as argparse's)."""
    print(f"{PROG}: error: {problem}", file=sys.stderr)
    return 2


def _bad_settings(problems: Sequence[str]) -> int:
    """Each bad setting of the environment as an error line of its own; exit status 2."""
    for problem in problems:
        _error(f"{problem} (from the environment)")
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
        description="Print the versions, the devices autocast can use, each setting and where it came "
        "from, the start-up hook's state, whether a fresh interpreter here gets the shim at import torch "
        "(and why not), and a self-test on each device. Exits with 1 when the self-test fails, when a "
        "process asking for the shim (AMP_BN_FIX=1) would not get it, or when AMP_BN_FIX cannot be read; "
        "with 2 for a bad value of another AMP_BN_FIX_* variable.",
    )
    check.set_defaults(func=_in_package("check"))
    add_run_parser(commands)
    return parser


def _in_package(name: str) -> Callable[[argparse.Namespace], int]:
    """A command that runs ``amp_bn_fix._cli.<name>`` once the environment's settings are known good."""

    def command(args: argparse.Namespace) -> int:
        # Checked here, before amp_bn_fix is imported (its import would raise the first as a
        # traceback): every bad setting, one line each.
        bad = settings.problems(os.environ)
        if bad:
            return _bad_settings(bad)
        # Any failure to import is one line (a torch whose CUDA libraries are missing raises OSError).
        try:
            import torch  # noqa: F401
        except Exception as exc:
            return _error(f"{name} needs torch, which {sys.executable} cannot import ({exc}); "
                          f"python -m _amp_bn_fix_boot.status says what start-up does without it")
        try:
            from amp_bn_fix import _cli
        except Exception as exc:  # a requirement missing or of another version (pip install --no-deps)
            return _error(f"{name} needs the {PACKAGE} package, which {sys.executable} cannot import "
                          f"({type(exc).__name__}: {exc}); python -m _amp_bn_fix_boot.status says what start-up "
                          "does without it")

        return getattr(_cli, name)(args)

    return command


def _run_options() -> List[settings.Setting]:
    return [setting for setting in settings.SETTINGS if setting.option is not None]


def add_run_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add the ``run`` command to ``commands`` (the subparsers of the ``amp-bn-fix`` parser).

    Its options are the settings table's: ``--NAME VALUE`` for each setting, ``--NAME`` alone for
    a switch (``--report``); each sets the setting's variable for the command.
    """
    usage = " ".join(f"[{s.option}]" if s.switch else f"[{s.option} {_metavar(s)}]" for s in _run_options())
    parser = commands.add_parser(
        "run",
        usage=f"{PROG} run [-h] {usage} -- CMD [ARGS...]",
        help="run a command with the shim enabled in all of its Python processes",
        # Lines broken by hand: the formatter keeps them as written, for the policy table below.
        description="Run CMD with AMP_BN_FIX=1 and a start-up hook on PYTHONPATH, so that every Python\n"
        "process it starts (torchrun workers included) enables the shim when it imports torch.",
        epilog=_policy_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = settings.Config()
    for setting in _run_options():
        if setting.switch:
            parser.add_argument(setting.option, dest=setting.name, action="store_const", const="1",
                                help=f"{setting.doc}; sets {setting.env}=1")
        else:
            default = f" (default {defaults.describe(setting.name)})" if setting.scope == "config" else ""
            parser.add_argument(setting.option, dest=setting.name, type=_option_type(setting), metavar=_metavar(setting),
                                help=f"{setting.doc}: {setting.allowed}{default}; sets {setting.env}")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command to run")
    parser.set_defaults(func=lambda args: run(parser, args))
    return parser


# What each policy costs on CUDA against native autocast, as the kernel count predicts it for a large
# 16-bit BatchNorm2d (docs/performance.md): one line each for run --help, where the policy is picked.
POLICY_COSTS = {
    "fp32": "float32 out; 1.33x native BatchNorm's bytes forward, 2.5x with backward; FP32 activations after it",
    "input": "the input's dtype out, FP32 statistics and the guard; native BatchNorm's bytes",
    "autocast": "autocast's dtype out; otherwise as input",
    "off": "every call left to torch: native autocast",
}


def _policy_epilog() -> str:
    default = settings.Config().policy
    width = max(map(len, POLICY_COSTS)) + 2
    lines = [f"policies (--policy; default {default}), with their CUDA cost as predicted by a count,\n"
             "not yet measured on a GPU (docs/performance.md):"]
    lines += [f"  {name.ljust(width)}{cost}" for name, cost in POLICY_COSTS.items()]
    return "\n".join(lines)


def _metavar(setting: settings.Setting) -> str:
    return setting.name[0].upper()


def environment(base: Optional[Mapping[str, str]] = None, **given: Union[str, bool, None]) -> Dict[str, str]:
    """The environment ``run`` gives its command: ``base`` (default: ours) with the shim switched on.

    ``given`` maps setting names (``policy``, ``devices``, ``keep_fp32``, ``guard``, ``report``)
    to values, as their options or variables spell them; ``None`` leaves the inherited value.

    Raises:
        ValueError: when a setting, given or inherited, is not valid: one line per bad setting.
    """
    env = dict(os.environ if base is None else base)
    env[ENV_ENABLE] = "1"
    for name, value in given.items():
        setting = settings.BY_NAME.get(name)
        if setting is None or setting.option is None:
            raise TypeError(f"environment() got an unexpected setting {name!r}")
        if value is not None:
            env[setting.env] = setting.spell(setting.parse_given(value, str(setting.option)))
    bad = settings.problems(env)
    if bad:
        raise ValueError("\n".join(bad))
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
        env = environment(**{s.name: getattr(args, s.name) for s in _run_options()})
    except ValueError as exc:
        return _bad_settings(str(exc).splitlines())
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
