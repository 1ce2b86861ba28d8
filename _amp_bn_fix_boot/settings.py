"""The settings: the environment variables amp_bn_fix reads, parsed and validated.

This module imports neither torch nor wrapt, so the start-up hook and the command line validate
the environment before anything heavy is loaded, with the very code the package uses. It holds no
global state: :func:`from_env` returns a fresh :class:`Config` and the runtime (``amp_bn_fix._patch``)
decides what to do with it. Every problem is a ``ValueError`` naming the bad value and the allowed ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from types import MappingProxyType
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

from .names import ENV_DEVICES, ENV_ENABLE, ENV_GUARD, ENV_KEEP_FP32, ENV_NAMES, ENV_POLICY, ENV_REPORT, OFF_WORDS, ON_WORDS

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
        if word in ON_WORDS:
            return True
        if word in OFF_WORDS:
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

    Raises:
        ValueError: for a bad value, naming the variable, the value and the allowed values.
    """
    return _read(os.environ if environ is None else environ)


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
    report_requested(environ)  # a bad value is an error like any other setting's
    return Config().replace("env", **changes) if changes else Config()


def hook_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``AMP_BN_FIX`` asks the start-up hook to enable the shim (``ValueError`` if unreadable)."""
    return parse_flag((os.environ if environ is None else environ).get(ENV_ENABLE, "0"), ENV_ENABLE)


def report_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``AMP_BN_FIX_REPORT`` asks for a summary of the counters at exit (``ValueError`` if unreadable)."""
    return parse_flag((os.environ if environ is None else environ).get(ENV_REPORT, "0"), ENV_REPORT)


def unknown_names(environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, Optional[str]]]:
    """``AMP_BN_FIX*`` variables amp_bn_fix does not read, each with the closest name it does read."""
    environ = os.environ if environ is None else environ
    found = []
    for name in sorted(environ):
        if name.upper().startswith(ENV_ENABLE) and name not in ENV_NAMES:
            close = difflib.get_close_matches(name.upper(), ENV_NAMES, n=1, cutoff=0.8)
            found.append((name, close[0] if close else None))
    return found


def describe_unknown(unknown: List[Tuple[str, Optional[str]]]) -> str:
    """One line naming the unknown variables (and what each probably meant)."""
    parts = [f"{name} (did you mean {close}?)" if close else name for name, close in unknown]
    return "unknown setting " + ", ".join(parts) + f"; amp_bn_fix reads {', '.join(ENV_NAMES)}"
