"""The settings: one table of them, and the environment variables amp_bn_fix reads, parsed and validated.

:data:`SETTINGS` is the one list of the settings: each one's name, environment variable, parser,
allowed values and what it does. The environment reader, :class:`Config`, the ``amp-bn-fix run``
options, ``amp-bn-fix check`` and ``amp_bn_fix.configure`` all derive from it.

This module imports neither torch nor wrapt, so the start-up hook and the command line validate
the environment before anything heavy is loaded, with the very code the package uses. It holds no
global state: :func:`from_env` returns a fresh :class:`Config` and the runtime (``amp_bn_fix._config``)
decides what to do with it. Every problem is a ``ValueError`` naming the bad value and the allowed ones.
"""

# No ``from __future__ import annotations``: Config is public as amp_bn_fix.Config (below), and
# typing.get_type_hints would look its string annotations up there.
import collections.abc
import dataclasses
import difflib
import os
from types import MappingProxyType
from typing import Any, Callable, Dict, FrozenSet, List, Literal, Mapping, Optional, Tuple, get_args

from .names import ENV_ENABLE, OFF_WORDS, ON_WORDS, PACKAGE

PolicyName = Literal["fp32", "input", "autocast", "off"]
KeepMode = Literal["master", "all", "stats", "none"]
# Device types torch's autocast knows. Anything else is almost certainly a typo ("gpu").
DeviceType = Literal["cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "privateuseone"]

POLICIES: Tuple[str, ...] = get_args(PolicyName)
KEEP_MODES: Tuple[str, ...] = get_args(KeepMode)
DEVICE_TYPES: Tuple[str, ...] = get_args(DeviceType)

POLICY_ALLOWED = ", ".join(POLICIES)
KEEP_ALLOWED = ", ".join(KEEP_MODES)
DEVICES_ALLOWED = f"'all' or a comma list of: {', '.join(DEVICE_TYPES)}"
FLAG_ALLOWED = "1/true/yes/on or 0/false/no/off"


def _invalid(what: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{what}={value!r} is not valid; allowed values: {allowed}")


def check_policy(name: object, what: str = "policy") -> str:
    """Return the canonical policy name for ``name`` or raise ``ValueError`` naming the choices."""
    if isinstance(name, str) and name.strip().lower() in POLICIES:
        return name.strip().lower()
    raise _invalid(what, name, POLICY_ALLOWED)


def check_keep_fp32(mode: object, what: str = "keep_fp32") -> str:
    """Return the canonical ``keep_fp32`` mode for ``mode`` or raise ``ValueError`` naming the choices."""
    if isinstance(mode, str) and mode.strip().lower() in KEEP_MODES:
        return mode.strip().lower()
    raise _invalid(what, mode, KEEP_ALLOWED)


def parse_flag(value: object, what: str) -> bool:
    """Parse a boolean switch such as ``AMP_BN_FIX=1``: a bool, 0 or 1, or one of the on/off words."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ON_WORDS:
            return True
        if word in OFF_WORDS:
            return False
    raise _invalid(what, value, FLAG_ALLOWED)


def parse_devices(value: object, what: str = "devices") -> Optional[FrozenSet[str]]:
    """Parse ``None`` or ``"all"`` (both return ``None``: every device type), or autocast device types.

    The device types come as a comma list (``"cuda,cpu"``, as ``AMP_BN_FIX_DEVICES`` spells them)
    or as an iterable of names.
    """
    if value is None:
        return None
    if isinstance(value, str):
        names = [part.strip().lower() for part in value.split(",")]
    elif isinstance(value, collections.abc.Iterable) and not isinstance(value, (bytes, collections.abc.Mapping)):
        items = list(value)
        if not all(isinstance(v, str) for v in items):
            raise _invalid(what, value, DEVICES_ALLOWED)
        names = [v.strip().lower() for v in items]
    else:
        raise _invalid(what, value, DEVICES_ALLOWED)
    if names == ["all"]:
        return None
    if not names or any(n not in DEVICE_TYPES for n in names):
        raise _invalid(what, value, DEVICES_ALLOWED)
    return frozenset(names)


def _spell_devices(devices: Optional[FrozenSet[str]]) -> str:
    return "all" if devices is None else ",".join(sorted(devices))


def _spell_flag(on: bool) -> str:
    return "1" if on else "0"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    name: str  # the Config attribute and configure() keyword; ``run``'s option is --name-with-dashes
    env: str  # the environment variable
    parse: Callable[[object, str], Any]  # (value, what) -> the value; ValueError naming what, value, allowed
    allowed: str  # the allowed values, as errors and help spell them
    doc: str  # what it does, one line
    spell: Callable[[Any], str] = str  # a parsed value as the environment variable spells it
    # "config": a field of Config, settable with configure(); "import": read once, by the package's
    # import (AMP_BN_FIX_REPORT); "hook": read by the start-up hook only (AMP_BN_FIX itself).
    scope: str = "config"
    switch: bool = False  # ``run`` takes it as a bare option that sets it to 1

    def parse_given(self, value: object, what: str) -> Any:
        """A value given in code or on ``run``'s command line, parsed. A blank string is not a value
        there (leaving the setting out is), as it is in the environment, where it means the default:
        ``guard=""`` would otherwise read as the off word it is for ``AMP_BN_FIX``."""
        if isinstance(value, str) and not value.strip():
            raise _invalid(what, value, self.allowed)
        return self.parse(value, what)

    @property
    def option(self) -> Optional[str]:
        """``amp-bn-fix run``'s option for it; None for the hook's switch, which ``run`` always sets."""
        return None if self.scope == "hook" else "--" + self.name.replace("_", "-")


# Config's fields are the names of the "config" rows, in this order (checked below).
SETTINGS: Tuple[Setting, ...] = (
    Setting("enable", ENV_ENABLE, parse_flag, FLAG_ALLOWED,
            "the start-up hook enables the shim in every Python process that imports torch",
            _spell_flag, scope="hook"),
    Setting("policy", "AMP_BN_FIX_POLICY", check_policy, POLICY_ALLOWED,
            "BatchNorm's output dtype under autocast"),
    Setting("devices", "AMP_BN_FIX_DEVICES", parse_devices, DEVICES_ALLOWED,
            "the device types whose calls the shim changes", _spell_devices),
    Setting("keep_fp32", "AMP_BN_FIX_KEEP_FP32", check_keep_fp32, KEEP_ALLOWED,
            "where BatchNorm's FP32 state lives when a model is cast to 16 bit"),
    Setting("guard", "AMP_BN_FIX_GUARD", parse_flag, FLAG_ALLOWED,
            "keep the running stats when a batch's statistics are not finite", _spell_flag),
    Setting("report", "AMP_BN_FIX_REPORT", parse_flag, FLAG_ALLOWED,
            "each Python process writes a one-line summary of what the shim did to stderr at exit",
            _spell_flag, scope="import", switch=True),
)
BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
# Every variable amp_bn_fix reads; any other AMP_BN_FIX_* name is a misspelling.
ENV_NAMES: Tuple[str, ...] = tuple(s.env for s in SETTINGS)
# The settings a Config holds, in its field order.
CONFIG_NAMES: Tuple[str, ...] = tuple(s.name for s in SETTINGS if s.scope == "config")


class _Sources(Dict[str, str]):
    """Where each setting came from: a dict that refuses changes. Unlike a mapping proxy it is
    copied and pickled like a dict, so a Config goes through ``copy.deepcopy``,
    ``dataclasses.asdict`` and pickling (to a spawned process, say)."""

    def _read_only(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("Config.sources is read-only: Config.replace() makes a config with other settings")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> Tuple[Any, ...]:
        return _Sources, (dict(self),)


@dataclasses.dataclass(frozen=True)
class Config:
    r"""The effective settings; ``sources`` says where each came from: ``"default"``, ``"env"`` or ``"API"``.

    Frozen: :func:`amp_bn_fix.get_config` returns one, :func:`amp_bn_fix.configure` changes the
    settings in force. Two configs with the same settings compare equal whatever their sources.

    Example::

        >>> from amp_bn_fix import Config
        >>> config = Config(policy="input")
        >>> config.policy, config.devices, config.keep_fp32, config.guard
        ('input', None, 'master', True)
    """

    policy: PolicyName = "fp32"
    devices: Optional[FrozenSet[str]] = None  # None: every device type
    keep_fp32: KeepMode = "master"
    guard: bool = True
    # Read-only, and left out of hashing and comparison: two configs with the same settings are equal.
    sources: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: _Sources(dict.fromkeys(CONFIG_NAMES, "default")), hash=False, compare=False
    )

    def replace(self, source: str = "API", **changes: object) -> "Config":
        """A copy with ``changes`` applied and recorded as coming from ``source``."""
        sources = _Sources({**self.sources, **dict.fromkeys(changes, source)})
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
        if name not in CONFIG_NAMES:
            raise ValueError(f"{name!r} is not a setting; the settings are {', '.join(CONFIG_NAMES)}")
        return BY_NAME[name].spell(getattr(self, name))


# One table: a Config field without a row, or a row without a field, is a mistake made here.
assert tuple(f.name for f in dataclasses.fields(Config) if f.name != "sources") == CONFIG_NAMES
# Public as amp_bn_fix.Config (its documentation, repr and help say so); it lives here to stay torch-free.
Config.__module__ = PACKAGE
for _method in (Config.replace, Config.describe):
    _method.__module__ = PACKAGE
del _method


def from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Read the ``AMP_BN_FIX_*`` variables of ``environ`` (default: this process's environment).

    Raises:
        ValueError: for a bad value, naming the variable, the value and the allowed values.
    """
    return _read(os.environ if environ is None else environ)


def _read(environ: Mapping[str, str]) -> Config:
    changes: Dict[str, object] = {}
    for setting in SETTINGS:
        value = environ.get(setting.env, "")
        if setting.scope == "hook" or not value.strip():
            continue
        parsed = setting.parse(value, setting.env)  # an "import" setting: checked like the others
        if setting.scope == "config":
            changes[setting.name] = parsed
    return Config().replace("env", **changes) if changes else Config()


def problems(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Every bad value among the settings of ``environ`` that the package reads, one message each.

    :func:`from_env` raises the first of them; ``AMP_BN_FIX`` itself, which only the start-up hook
    reads, is not among them (:func:`hook_requested`).
    """
    environ = os.environ if environ is None else environ
    found = []
    for setting in SETTINGS:
        value = environ.get(setting.env, "")
        if setting.scope == "hook" or not value.strip():
            continue
        try:
            setting.parse(value, setting.env)
        except ValueError as exc:
            found.append(str(exc))
    return found


def hook_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``AMP_BN_FIX`` asks the start-up hook to enable the shim (``ValueError`` if unreadable)."""
    return parse_flag((os.environ if environ is None else environ).get(ENV_ENABLE, "0"), ENV_ENABLE)


def report_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``AMP_BN_FIX_REPORT`` asks for a summary of the counters at exit (``ValueError`` if unreadable)."""
    env = BY_NAME["report"].env
    return parse_flag((os.environ if environ is None else environ).get(env, "0"), env)


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
