"""Configuration: the environment variables amp_bn_fix reads, parsed and validated.

This module imports neither torch nor wrapt, so the start-up hook can validate the environment
before anything heavy is loaded. It holds no global state: :func:`from_env` returns a fresh
:class:`Config` and the runtime (``_patch``) decides what to do with it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import MappingProxyType
from typing import Dict, FrozenSet, Mapping, Optional, Sequence

POLICIES = ("fp32", "input", "autocast", "off")
KEEP_MODES = ("stats", "all", "none")
# Device types torch's autocast knows. Anything else is almost certainly a typo ("gpu").
DEVICE_TYPES = (
    "cpu",
    "cuda",
    "xpu",
    "mps",
    "hpu",
    "mtia",
    "maia",
    "xla",
    "ipu",
    "privateuseone",
)

ENV_ENABLE = "AMP_BN_FIX"
ENV_POLICY = "AMP_BN_FIX_POLICY"
ENV_DEVICES = "AMP_BN_FIX_DEVICES"
ENV_KEEP_FP32 = "AMP_BN_FIX_KEEP_FP32"
ENV_GUARD = "AMP_BN_FIX_GUARD"

_TRUE = ("1", "true", "yes", "on")
# The start-up hook (_amp_bn_fix_boot/hook.py) and amp_bn_fix.pth repeat these words so that an
# interpreter with the switch off imports nothing; a test keeps the three in step.
_FALSE = ("0", "false", "no", "off", "")


def _allowed(values: tuple) -> str:
    return ", ".join(values)


def _invalid(what: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{what}={value!r} is not valid; allowed values: {allowed}")


def check_policy(name: object, what: str = "policy") -> str:
    """Return the canonical policy name for ``name`` or raise ``ValueError`` naming the choices."""
    if isinstance(name, str) and name.strip().lower() in POLICIES:
        return name.strip().lower()
    raise _invalid(what, name, _allowed(POLICIES))


def check_keep_fp32(mode: object, what: str = "keep_fp32") -> str:
    if isinstance(mode, str) and mode.strip().lower() in KEEP_MODES:
        return mode.strip().lower()
    raise _invalid(what, mode, _allowed(KEEP_MODES))


def parse_flag(value: object, what: str) -> bool:
    """Parse a boolean switch such as ``AMP_BN_FIX=1``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise _invalid(what, value, "1/true/yes/on or 0/false/no/off")


def parse_devices(value: object, what: str = "devices") -> Optional[FrozenSet[str]]:
    """Parse ``"all"`` (returns ``None``) or a comma list of autocast device types."""
    allowed = f"'all' or a comma list of: {_allowed(DEVICE_TYPES)}"
    if isinstance(value, str):
        names = [part.strip().lower() for part in value.split(",")]
    elif isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        names = [v.strip().lower() for v in value]
    else:
        raise _invalid(what, value, allowed)
    if names == ["all"]:
        return None
    if not names or any(n not in DEVICE_TYPES for n in names):
        raise _invalid(what, value, allowed)
    return frozenset(names)


_SETTINGS = ("policy", "devices", "keep_fp32", "guard")


@dataclasses.dataclass(frozen=True)
class Config:
    """The effective settings; ``sources`` says where each came from: default, env or API."""

    policy: str = "fp32"
    devices: Optional[FrozenSet[str]] = None  # None: every device type
    keep_fp32: str = "all"
    guard: bool = True
    # Read-only, and left out of hashing and comparison: two configs with the same settings are equal.
    sources: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(_SETTINGS, "default")), hash=False, compare=False
    )

    def replace(self, source: str = "API", **changes: object) -> "Config":
        """A copy with ``changes`` applied and recorded as coming from ``source``."""
        sources = MappingProxyType({**self.sources, **dict.fromkeys(changes, source)})
        return dataclasses.replace(self, sources=sources, **changes)  # type: ignore[arg-type]

    def describe(self, name: str) -> str:
        """The setting ``name`` as its environment variable would spell it.

        ``name`` is one of ``"policy"``, ``"devices"``, ``"keep_fp32"`` and ``"guard"``; the value
        comes back as a string: ``"all"`` or a sorted comma list for the devices, ``"1"``/``"0"``
        for the guard, the word itself for the others.

        Example::

            >>> from amp_bn_fix import Config
            >>> Config(devices=frozenset({"cuda", "cpu"})).describe("devices")
            'cpu,cuda'
            >>> Config(guard=False).describe("guard")
            '0'
        """
        value = getattr(self, name)
        if name == "devices":
            value = "all" if value is None else ",".join(sorted(value))
        elif name == "guard":
            value = "1" if value else "0"
        return str(value)


def from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Read the ``AMP_BN_FIX_*`` variables of ``environ`` (default: this process's environment).

    A bad value raises ``ValueError`` naming the variable, the value and the allowed values. One
    case is different: ``python -m amp_bn_fix`` reads its own environment while the package is
    imported, before its command line runs; there a bad value is the command's usage error, one
    line on stderr and exit status 2, as with the ``amp-bn-fix`` console script.
    """
    if environ is None:
        try:
            return _read(os.environ)
        except ValueError as exc:
            if running_the_command():
                print(f"{COMMAND}: error: {exc} (from the environment)", file=sys.stderr)
                raise SystemExit(2) from None
            raise
    return _read(environ)


def _read(environ: Mapping[str, str]) -> Config:
    changes: Dict[str, object] = {}
    if environ.get(ENV_POLICY, "").strip():
        changes["policy"] = check_policy(environ[ENV_POLICY], ENV_POLICY)
    if environ.get(ENV_DEVICES, "").strip():
        changes["devices"] = parse_devices(environ[ENV_DEVICES], ENV_DEVICES)
    if environ.get(ENV_KEEP_FP32, "").strip():
        changes["keep_fp32"] = check_keep_fp32(environ[ENV_KEEP_FP32], ENV_KEEP_FP32)
    if environ.get(ENV_GUARD, "").strip():
        changes["guard"] = parse_flag(environ[ENV_GUARD], ENV_GUARD)
    return Config().replace("env", **changes) if changes else Config()


def hook_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``AMP_BN_FIX`` asks the start-up hook to enable the shim."""
    return parse_flag(environ.get(ENV_ENABLE, "0"), ENV_ENABLE)


COMMAND = "amp-bn-fix"
_MODULE_COMMANDS = ("amp_bn_fix", "amp_bn_fix.__main__")
# Interpreter options that take a value (``-X dev``, ``-W error``): the value is not the script.
_OPTIONS_WITH_VALUE = "WX"


def running_the_command(argv: Optional[Sequence[str]] = None) -> bool:
    """Whether this interpreter runs the ``amp-bn-fix`` command: its console script or ``python -m amp_bn_fix``.

    ``argv`` is an interpreter command line as :data:`sys.orig_argv` holds it (the default), read
    as far as the script, ``-m MODULE`` or ``-c CODE`` it runs.
    """
    arguments = iter(list(sys.orig_argv if argv is None else argv)[1:])
    for argument in arguments:
        if argument == "--check-hash-based-pycs":
            next(arguments, None)
            continue
        if argument.startswith("--") and argument != "--":
            continue
        if argument == "--" or argument == "-" or not argument.startswith("-"):
            script = next(arguments, "") if argument == "--" else argument
            name = os.path.splitext(os.path.basename(script))[0]
            return name in (COMMAND, COMMAND + "-script")
        for index, letter in enumerate(argument[1:], start=1):
            if letter in "cm" or letter in _OPTIONS_WITH_VALUE:
                value = argument[index + 1 :] or next(arguments, "")
                if letter == "c":
                    return False
                if letter == "m":
                    return value in _MODULE_COMMANDS
                break  # -W/-X: the rest of this argument (or the next one) was the value
    return False
