"""The start-up hook: with ``AMP_BN_FIX`` on, enable the shim as soon as torch is imported.

``amp_bn_fix.pth`` (``amp_bn_fix.start`` from Python 3.15 on) calls :func:`start` in every
interpreter of the environment, and so does the sitecustomize of ``amp-bn-fix run``. Start-up stays
cheap and never fails: with the variable off nothing is imported; with it on, the settings are
checked and a wrapt post-import hook waits for ``torch`` (torch itself is not imported here). Any
problem is one warning line on stderr and the interpreter runs on without the shim.
"""

from __future__ import annotations

import os
from types import ModuleType

ENV = "AMP_BN_FIX"
# The values that mean "off" (amp_bn_fix._config's false words); amp_bn_fix.pth repeats them.
_OFF = ("", "0", "false", "no", "off")

_started = False
_registered = False


def start() -> None:
    """Register the post-import hook on ``torch`` if ``AMP_BN_FIX`` asks for it; once per process.

    Never raises: a bad setting or any error is reported as one warning line.
    """
    global _started, _registered
    if _started or os.environ.get(ENV, "").strip().lower() in _OFF:
        return
    _started = True
    try:
        from . import config

        settings = config.load()
        try:
            if not settings.hook_requested():
                return
            settings.from_env()
        except ValueError as exc:
            warn(str(exc))
            return
        import wrapt

        # Hooks the end of ``import torch``: torch.nn.functional is imported midway through it.
        wrapt.register_post_import_hook(_enable, "torch")
        _registered = True
    except Exception as exc:  # start-up must go on whatever happens here
        warn(f"start-up hook failed ({type(exc).__name__}: {exc})")


def registered() -> bool:
    """Whether :func:`start` set up enabling the shim in this process."""
    return _registered


def _enable(torch: ModuleType) -> None:
    """Post-import hook: the first import of amp_bn_fix enables it with the environment's settings.

    With ``import amp_bn_fix`` already under way (it imports torch), this returns that module and
    its own import finishes the job: one wrapper either way.
    """
    try:
        import amp_bn_fix  # noqa: F401
    except Exception as exc:  # a ValueError when the environment changed after start-up
        warn(str(exc) if isinstance(exc, ValueError) else f"enabling failed ({type(exc).__name__}: {exc})")


def warn(problem: str) -> None:
    """Report ``problem`` as one line (logger ``amp_bn_fix``; stderr unless logging says otherwise)."""
    import logging

    logging.getLogger("amp_bn_fix").warning("amp_bn_fix: %s; running without the shim", problem)
