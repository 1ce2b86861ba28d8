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
``AMP_BN_FIX_GUARD`` (``1``/``0``) and ``AMP_BN_FIX_KEEP_FP32`` (``all``, ``stats``, ``none``).
A bad value makes the import raise ``ValueError``.
"""

from __future__ import annotations

import atexit
import contextlib
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional

from _amp_bn_fix_boot import settings as _settings
from _amp_bn_fix_boot._version import __version__
from _amp_bn_fix_boot.settings import Config

from . import _patch, _record

if TYPE_CHECKING:
    import torch

__all__ = [
    "Config",
    "__version__",
    "disable",
    "enable",
    "get_config",
    "get_policy",
    "is_enabled",
    "policy",
    "report",
    "set_policy",
]


def enable(policy: Optional[str] = None) -> None:
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
        >>> repr(torch.nn.functional.batch_norm)
        '<ShimWrapper at 0x... for function at 0x...>'
    """
    return _patch.is_installed()


def get_policy() -> str:
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
    return _patch.active_policy()


def set_policy(name: str) -> None:
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
    _patch.configure(_patch.current_config().replace(policy=_settings.check_policy(name)))


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    r"""Override the policy within a ``with`` block (nestable), for this thread and asyncio task.

    Scopes are per thread and per asyncio task (they live in a :mod:`contextvars` variable): an
    asyncio task created inside the block starts with its policy, and a scope opened in one task
    is not seen by other tasks. Other threads keep theirs and do not see this one:
    ``nn.DataParallel`` replicas, and the autograd threads where activation checkpointing
    recomputes on CUDA, use the process-wide policy. The shim must be enabled for the policy to
    take effect.

    Example::

        >>> import torch, amp_bn_fix
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> x = torch.randn(8, 4, dtype=torch.bfloat16)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy("input"):
        ...     bn(x).dtype
        torch.bfloat16
    """
    with _patch.scoped_policy(_settings.check_policy(name)):
        yield


def get_config() -> Config:
    r"""The process-wide settings and where each came from.

    Returns:
        A frozen :class:`Config` with ``policy``, ``devices`` (``None`` for every device type, else
        a frozenset of names), ``keep_fp32`` and ``guard``, and ``sources`` mapping each of them to
        ``"default"``, ``"env"`` or ``"API"``. :meth:`Config.describe` spells a setting as its
        environment variable would. ``policy()`` scopes are not part of it (see :func:`get_policy`).

    Example::

        >>> import amp_bn_fix
        >>> amp_bn_fix.set_policy("input")
        >>> config = amp_bn_fix.get_config()
        >>> config.policy, config.sources["policy"]
        ('input', 'API')
        >>> sorted(config.sources)
        ['devices', 'guard', 'keep_fp32', 'policy']
    """
    return _patch.current_config()


def report(model: Optional["torch.nn.Module"] = None) -> Dict[str, Any]:
    r"""What the shim has done in this process: counters, read now.

    Returns:
        ``{"handled": {policy: calls}, "passed_through": calls, "guard_skips": {module: skips}}``:
        the calls the shim computed, per policy in force (``off`` for the ``stats`` models it computes
        anyway), the calls it left to torch, and per BatchNorm module the training steps whose
        running-stat update the guard skipped. Modules are named by their path in ``model`` when
        given, else by type and address. Counting costs no host-device sync; reading the guard's
        counters of tensors on a device here does. Calls made by compiled code are not counted
        (their tracing is).

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


_patch.configure(_settings.from_env())
if _settings.report_requested():
    atexit.register(_record.print_summary)
_unknown = _settings.unknown_names()
if _unknown:
    warnings.warn(f"amp_bn_fix: {_settings.describe_unknown(_unknown)}", RuntimeWarning, stacklevel=2)
if _patch.current_config().policy != "off":
    enable()
