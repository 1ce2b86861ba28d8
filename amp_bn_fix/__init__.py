r"""Run BatchNorm in FP32 under ``torch.autocast``.

Autocast puts ``batch_norm`` on no cast list, so after a Linear/Conv it receives float16/bfloat16
and returns float16/bfloat16. Importing this package wraps ``torch.nn.functional.batch_norm`` so
that, under autocast, a half-precision input is normalized in FP32 with FP32 running statistics,
and the output dtype follows a policy:

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
``AMP_BN_FIX_GUARD`` (``1``/``0``) and ``AMP_BN_FIX_KEEP_FP32`` (``stats``, ``all``, ``none``).
A bad value makes the import raise ``ValueError``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from . import _config, _patch
from ._config import Config
from ._version import __version__

__all__ = [
    "Config",
    "__version__",
    "disable",
    "enable",
    "get_config",
    "get_policy",
    "is_enabled",
    "policy",
    "set_policy",
]


def enable(policy: Optional[str] = None) -> None:
    r"""Patch ``torch.nn.functional.batch_norm`` (idempotent).

    Args:
        policy: if given, also make it the process-wide policy (see :func:`set_policy`).

    Example::

        >>> amp_bn_fix.enable("input")
        >>> amp_bn_fix.is_enabled()
        True
    """
    if policy is not None:
        set_policy(policy)
    _patch.install()


def disable() -> None:
    r"""Remove the patch: ``torch.nn.functional.batch_norm`` is the original object again.

    Idempotent. The policy setting is kept for a later :func:`enable`.

    Example::

        >>> amp_bn_fix.disable()
        >>> amp_bn_fix.is_enabled()
        False
    """
    _patch.uninstall()


def is_enabled() -> bool:
    r"""Whether the patch is installed in this process."""
    return _patch.is_installed()


def get_policy() -> str:
    r"""The policy in force for this thread: its innermost :func:`policy` scope, else the global one."""
    return _patch.active_policy()


def set_policy(name: str) -> None:
    r"""Set the process-wide policy: ``"fp32"``, ``"input"``, ``"autocast"`` or ``"off"``.

    It applies while the shim is enabled; it does not enable it (see :func:`enable`).

    Raises:
        ValueError: for any other name; the message lists the allowed ones.

    Example::

        >>> amp_bn_fix.set_policy("autocast")
        >>> amp_bn_fix.get_policy()
        'autocast'
    """
    _patch.configure(_patch.current_config().replace(policy=_config.check_policy(name)))


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    r"""Override the policy for the current thread within a ``with`` block (nestable).

    Other threads keep theirs, and do not see this one: ``nn.DataParallel`` replicas, and the
    autograd threads where activation checkpointing recomputes on CUDA, use the process-wide
    policy. The patch must be enabled for the policy to take effect.

    Example::

        >>> with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy("input"):
        ...     bn(x).dtype
        torch.bfloat16
    """
    previous = _patch.set_thread_policy(_config.check_policy(name))
    try:
        yield
    finally:
        _patch.set_thread_policy(previous)


def get_config() -> Config:
    r"""The process-wide settings and where each came from (``default``, ``env`` or ``API``)."""
    return _patch.current_config()


_patch.configure(_config.from_env())
if _patch.current_config().policy != "off":
    enable()
