r"""Run BatchNorm in FP32 under ``torch.autocast``.

Autocast leaves ``batch_norm`` in whatever dtype it is given, so after a Linear/Conv it receives
float16/bfloat16 and returns float16/bfloat16. Importing this package wraps
``torch.nn.functional.batch_norm`` so that, under autocast, a half-precision input is normalized
in FP32 with FP32 running statistics, and the output dtype follows a policy:

======== ==================================================================
policy   output dtype under autocast
======== ==================================================================
fp32     float32 (default)
input    the input's dtype
autocast the active autocast dtype of the input's device
off      the native call, untouched
======== ==================================================================

Example::

    >>> import torch, amp_bn_fix
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     net(torch.randn(8, 4)).dtype
    torch.float32

The environment picks the settings at import: ``AMP_BN_FIX_POLICY`` (``fp32``, ``input``,
``autocast``, ``off``), ``AMP_BN_FIX_DEVICES`` (``all`` or a comma list such as ``cuda,cpu``),
``AMP_BN_FIX_GUARD`` (``1``/``0``) and ``AMP_BN_FIX_KEEP_FP32`` (``master``, ``all``,
``stats``, ``none``).
A bad value makes the import raise ``ValueError``. :func:`configure` changes them at run time.
"""

# No ``from __future__ import annotations``: the annotations are evaluated here, so that help() and
# typing.get_type_hints show the allowed values, and the typing names can leave the namespace (end).
import sys as _sys
import warnings as _warnings
from typing import Any, Dict, Iterable, Optional, Union

import torch as _torch
from _amp_bn_fix_boot import settings as _settings
from _amp_bn_fix_boot._version import __version__
from _amp_bn_fix_boot.settings import Config, PolicyName
from _amp_bn_fix_boot.settings import DeviceType as _DeviceType
from _amp_bn_fix_boot.settings import KeepMode as _KeepMode

from . import _compat, _config, _patch, _record, _state

__all__ = [
    "Config",
    "PolicyName",
    "__version__",
    "configure",
    "disable",
    "enable",
    "get_config",
    "get_policy",
    "is_enabled",
    "policy",
    "report",
    "set_policy",
]


def enable(policy: Optional[PolicyName] = None) -> None:
    r"""Patch ``torch.nn.functional.batch_norm`` (idempotent).

    Args:
        policy: if given, also make it the process-wide policy (see :func:`set_policy`).

    Example::

        >>> import amp_bn_fix
        >>> amp_bn_fix.enable("input")
        >>> amp_bn_fix.is_enabled(), amp_bn_fix.get_policy()
        (True, 'input')
    """
    if policy is not None:
        set_policy(policy)
    _patch.install()


def disable() -> None:
    r"""Remove the patch: ``torch.nn.functional.batch_norm`` is the original object again.

    Idempotent. The policy setting is kept for a later :func:`enable`.

    Example::

        >>> import torch, amp_bn_fix
        >>> amp_bn_fix.disable()
        >>> amp_bn_fix.is_enabled()
        False
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     bn(torch.randn(8, 4, dtype=torch.bfloat16)).dtype   # native: no FP32 output
        torch.bfloat16
        >>> amp_bn_fix.enable()
    """
    _patch.uninstall()


def is_enabled() -> bool:
    r"""Whether the shim is on in this process.

    Returns:
        ``True`` while ``torch.nn.functional.batch_norm`` is the shim's wrapper (after
        ``import amp_bn_fix`` or :func:`enable`), ``False`` after :func:`disable` or when
        ``AMP_BN_FIX_POLICY=off`` kept the import from enabling it. ``print(F.batch_norm)`` cannot
        tell (wrapt forwards ``str`` to the original function); ``repr`` names the wrapper.

    Example::

        >>> import torch, amp_bn_fix
        >>> amp_bn_fix.enable()
        >>> amp_bn_fix.is_enabled()
        True
        >>> repr(torch.nn.functional.batch_norm)  # doctest: +ELLIPSIS
        '<ShimWrapper at 0x... for function at 0x...>'
    """
    return _patch.is_installed()


def get_policy() -> PolicyName:
    r"""The name of the policy in force here: ``"fp32"``, ``"input"``, ``"autocast"`` or ``"off"``.

    Returns:
        The policy of the innermost :func:`policy` scope open in this thread (or asyncio task),
        else the process-wide one (:func:`set_policy`, ``AMP_BN_FIX_POLICY``, default ``"fp32"``).

    Example::

        >>> import amp_bn_fix
        >>> amp_bn_fix.set_policy("fp32")
        >>> with amp_bn_fix.policy("input"):
        ...     amp_bn_fix.get_policy()
        'input'
        >>> amp_bn_fix.get_policy()
        'fp32'
    """
    return _state.policy()


def set_policy(name: PolicyName) -> None:
    r"""Set the process-wide policy: ``"fp32"``, ``"input"``, ``"autocast"`` or ``"off"``.

    It applies while the shim is enabled; it does not enable it (see :func:`enable`).

    Raises:
        ValueError: for any other name; the message lists the allowed ones.

    Example::

        >>> import amp_bn_fix
        >>> amp_bn_fix.set_policy("autocast")
        >>> amp_bn_fix.get_policy()
        'autocast'
        >>> amp_bn_fix.set_policy("fast")
        Traceback (most recent call last):
          ...
        ValueError: policy='fast' is not valid; allowed values: fp32, input, autocast, off
    """
    configure(policy=name)


def policy(name: PolicyName) -> _config.PolicyScope:
    r"""Override the policy within a ``with`` block (nestable), for this thread and asyncio task;
    as a decorator, wherever the decorated function, generator or coroutine function runs.

    Scopes are per thread and per asyncio task (they live in a :mod:`contextvars` variable): an
    asyncio task created inside the block starts with its policy, and a scope opened in one task
    is not seen by other tasks. Other threads keep theirs and do not see this one:
    ``nn.DataParallel`` replicas use the process-wide policy. Activation checkpointing
    (``torch.utils.checkpoint``, reentrant or not, and ``checkpoint_sequential``) recomputes
    under the scopes its forward ran in, wherever backward runs: after the block, or in the
    autograd threads that run it on CUDA. The shim must be enabled for the policy to take effect.

    Example::

        >>> import torch, amp_bn_fix
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> x = torch.randn(8, 4, dtype=torch.bfloat16)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy("input"):
        ...     bn(x).dtype
        torch.bfloat16
    """
    return _config.PolicyScope(_settings.check_policy(name))


class _Unchanged:
    """The default of :func:`configure`'s arguments: leave that setting as it is."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unchanged>"


# Typed Any so that each argument's annotation can say what it takes.
_UNCHANGED: Any = _Unchanged()


class _PreviousSettings(dict):
    """What :func:`configure` returns: the settings before the call, and a context manager that
    restores them, with their sources, when its ``with`` block ends."""

    def __init__(self, config: Config) -> None:
        super().__init__((name, getattr(config, name)) for name in _settings.CONFIG_NAMES)
        self.config = config

    def __enter__(self) -> "_PreviousSettings":
        return self

    def __exit__(self, *exc_info: object) -> None:
        _config.configure(self.config)


def configure(
    *,
    policy: PolicyName = _UNCHANGED,
    devices: Union[None, str, Iterable[_DeviceType]] = _UNCHANGED,
    keep_fp32: _KeepMode = _UNCHANGED,
    guard: bool = _UNCHANGED,
) -> _PreviousSettings:
    r"""Change the process-wide settings; each one left out stays as it is.

    Args:
        policy: BatchNorm's output dtype under autocast: ``"fp32"``, ``"input"``, ``"autocast"``
            or ``"off"`` (see :func:`set_policy`).
        devices: the device types whose calls the shim changes: ``None`` or ``"all"`` for every
            one, else names such as ``["cuda", "cpu"]`` or a comma list ``"cuda,cpu"``.
        keep_fp32: where BatchNorm's FP32 state lives when a model is cast to 16 bit from then
            on: ``"master"`` (beside the model, which stays as torch casts it), ``"all"`` or
            ``"stats"`` (inside it) or ``"none"``. A model cast under ``"master"`` keeps its
            master, whatever the setting later.
        guard: whether a training call whose batch statistics are not finite keeps the running
            stats as they were.

    The values are those of the environment variables (``AMP_BN_FIX_POLICY``, ...), parsed alike:
    case-insensitive words, and for ``guard`` a bool or the words ``AMP_BN_FIX_GUARD`` takes.
    :func:`get_config` then reports ``"API"`` as their source. Like :func:`set_policy`, it does
    not enable the shim. Safe to call from several threads.

    Returns:
        The settings before the call, as a dict (``policy``, ``devices``, ``keep_fp32``,
        ``guard``): ``configure(**previous)`` puts their values back (their source is then
        ``"API"``). It is also a context manager, like ``torch.set_grad_enabled``: used in a
        ``with`` statement, the settings are changed for the block, and when it ends all of them
        are as before it, sources included.

    Raises:
        ValueError: for a bad value, naming the argument, the value and the allowed values; no
            setting changes then.

    Example::

        >>> import amp_bn_fix
        >>> previous = amp_bn_fix.configure(guard=False, devices="cuda,cpu")
        >>> config = amp_bn_fix.get_config()
        >>> config.guard, sorted(config.devices), config.sources["guard"]
        (False, ['cpu', 'cuda'], 'API')
        >>> _ = amp_bn_fix.configure(**previous)
        >>> amp_bn_fix.get_config() == amp_bn_fix.Config(**previous)
        True
        >>> before = amp_bn_fix.get_config()
        >>> with amp_bn_fix.configure(policy="input", keep_fp32="stats"):
        ...     amp_bn_fix.get_policy(), amp_bn_fix.get_config().keep_fp32
        ('input', 'stats')
        >>> amp_bn_fix.get_config() == before and amp_bn_fix.get_config().sources == before.sources
        True
        >>> amp_bn_fix.configure(keep_fp32="half")
        Traceback (most recent call last):
          ...
        ValueError: keep_fp32='half' is not valid; allowed values: master, all, stats, none
    """
    given = locals()  # the arguments: one per setting of the settings table (a test pins the signature)
    # Every value is checked before any is applied: a bad one changes nothing.
    changes = {
        name: _settings.BY_NAME[name].parse_given(given[name], name)
        for name in _settings.CONFIG_NAMES
        if given[name] is not _UNCHANGED
    }
    return _PreviousSettings(_config.change(**changes))


def get_config() -> Config:
    r"""The process-wide settings and where each came from.

    Returns:
        A frozen :class:`Config` with ``policy``, ``devices`` (``None`` for every device type, else
        a frozenset of names), ``keep_fp32`` and ``guard``, and ``sources`` mapping each of them to
        ``"default"``, ``"env"`` or ``"API"`` (:func:`configure`, :func:`set_policy`).
        :meth:`Config.describe` spells a setting as its environment variable would. ``policy()``
        scopes are not part of it (see :func:`get_policy`).

    Example::

        >>> import amp_bn_fix
        >>> amp_bn_fix.set_policy("input")
        >>> config = amp_bn_fix.get_config()
        >>> config.policy, config.sources["policy"]
        ('input', 'API')
        >>> sorted(config.sources)
        ['devices', 'guard', 'keep_fp32', 'policy']
    """
    return _state.config


def report(model: Optional[_torch.nn.Module] = None) -> Dict[str, Any]:
    r"""What the shim has done in this process: counters, read now.

    Returns:
        ``{"handled": {policy: calls}, "passed_through": calls, "guard_skips": {module: skips}}``:
        the calls the shim computed, counted under what they did (the policy in force under
        autocast; ``input`` for calls outside autocast and for the ``stats`` models computed
        under the policy ``off``: FP32 arithmetic, the input's dtype out), the calls it left to
        torch, and per BatchNorm module the training steps whose running-stat update the guard
        skipped. Modules are named by their path in ``model`` when given, else by their channel
        count and address. Once a call was made while a CUDA graph was captured, also
        ``"captured": {policy: calls}``: those calls (also under ``handled``) run again at each
        replay of the graph, uncounted, and their guard decisions are counted nowhere (a replay
        runs no Python). Counting costs no host-device sync; reading the guard's counters of
        tensors on a device here does (skips decided on a device are known only then). Calls
        made by compiled code are not counted (their tracing is).

    Raises:
        RuntimeError: called while a CUDA graph is captured (reading the device is not allowed then).

    Example::

        >>> import torch, amp_bn_fix
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> before = amp_bn_fix.report()["handled"].get("fp32", 0)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     _ = bn(torch.randn(8, 4, dtype=torch.bfloat16))
        >>> amp_bn_fix.report()["handled"]["fp32"] - before
        1
    """
    return _record.snapshot(model)


def _imported_to_run_the_command() -> bool:
    """Whether this import is ``python -m amp_bn_fix``'s, made before its ``__main__`` runs.

    ``-m`` imports a package before its ``__main__``, so nothing of the command can run first. The
    command checks the settings itself and reports each bad one as a line, without a traceback;
    only there may the import leave a bad setting to it. While ``-m`` imports the parents of the
    module it runs, ``sys.argv`` is ``"-m"`` and the arguments after that module: in
    ``sys.orig_argv`` the one before them names it, alone (``-m name``, ``-Im name``) or at the end
    of a bundle of options (``-mname``, ``-Imname``).
    """
    argv, given = _sys.argv, getattr(_sys, "orig_argv", [])
    at = len(given) - len(argv)
    if argv[:1] != ["-m"] or at < 1 or given[at + 1:] != argv[1:]:
        return False
    module = given[at]
    if module.startswith("-"):
        for i, option in enumerate(module[1:], 2):
            if option == "m":
                module = module[i:]
                break
            if option in "cWX":  # an option whose value is the rest of the bundle
                return False
        else:
            return False
    return module in (__name__, __name__ + ".__main__")


def _start() -> None:
    """Apply the environment's settings and enable the shim (unless ``AMP_BN_FIX_POLICY=off``), once
    per process: ``importlib.reload(amp_bn_fix)`` (IPython's autoreload) keeps the settings, the
    patches and the exit summary as they are."""
    if _state.started:
        return
    try:
        config = _settings.from_env()
        report_at_exit = _settings.report_requested()
    except ValueError:
        if _imported_to_run_the_command():
            return  # the command reports it, and enables nothing
        raise
    _config.configure(config)
    _compat.keep_out_of_dynamo()
    if report_at_exit:
        _record.summary_at_exit()
    unknown = _settings.unknown_names()
    if unknown:
        # 3: the frame that imports amp_bn_fix (warnings skips the import system's own frames).
        _warnings.warn(f"amp_bn_fix: {_settings.describe_unknown(unknown)}", RuntimeWarning, stacklevel=3)
    if config.policy != "off":
        enable()
    _state.started = True  # only now: an import that raised (a warning made an error) starts again


_start()

# What remains in the namespace is the public API (and private names): the typing names served
# the annotations above, which are evaluated by now.
del Any, Dict, Iterable, Optional, Union
