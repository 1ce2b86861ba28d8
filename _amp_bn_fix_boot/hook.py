"""The start-up hook: with ``AMP_BN_FIX`` on, enable the shim as soon as torch is imported.

``amp_bn_fix.pth`` (``amp_bn_fix.start`` from Python 3.15 on) calls :func:`start` in every
interpreter of the environment, and so does the sitecustomize of ``amp-bn-fix run``. Start-up stays
cheap and never fails: with the variable off nothing is imported; with it on, a small meta path
finder waits for ``import torch`` (nothing else is imported: not torch, not wrapt, not the
settings). When torch's import completes, the settings are checked and ``amp_bn_fix`` is imported,
which enables the shim. Any problem is one warning line on stderr and the program runs on without
the shim.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from .names import ENV_ENABLE, OFF_WORDS, WARNING

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing would add some 10 ms to start-up; the annotations are strings
    from typing import Any, Optional, Sequence

_started = False
_registered = False


def start() -> None:
    """Wait for ``import torch`` if ``AMP_BN_FIX`` asks for it (enable now if torch is already in); once.

    Never raises: any error is reported as one warning line.
    """
    global _started, _registered
    if _started or os.environ.get(ENV_ENABLE, "").strip().lower() in OFF_WORDS:
        return
    _started = True
    # BaseException: a broken module may raise SystemExit or KeyboardInterrupt, and start-up must
    # survive it. A real Ctrl-C lands in this millisecond window almost never; it then costs one
    # warning line and a second Ctrl-C, against an interpreter that would not start at all.
    try:
        torch = sys.modules.get("torch")
        _registered = True
        if torch is None:
            sys.meta_path.insert(0, _TorchFinder())
        else:
            _enable(torch)
    except BaseException as exc:
        _registered = False
        warn(f"start-up hook failed ({type(exc).__name__}: {exc})")


def registered() -> bool:
    """Whether :func:`start` set up enabling the shim in this process (and enabling has not failed)."""
    return _registered


class _TorchFinder:
    """Meta path finder that only watches the top-level ``import torch``; duck-typed, because
    ``importlib.abc`` alone would import some twenty modules (tempfile, random, lzma, ...) at start-up.

    It finds torch's spec with the finders after it and wraps the loader, so that :func:`_enable`
    runs once torch's ``__init__`` has run to the end (``torch.nn.functional`` is imported midway
    through it), then removes itself from ``sys.meta_path``.
    """

    def __init__(self) -> None:
        self.fired = False

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Any:
        # A reload (target given) is not the import we wait for: leave it to the usual finders.
        if fullname != "torch" or target is not None or self.fired or self not in sys.meta_path:
            return None
        # Ask the finders after this one, as the import system would have without it.
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        # Already ours (a finder after this one asked the import system again): wrap once.
        if not isinstance(spec.loader, _TorchLoader) and hasattr(spec.loader, "exec_module"):
            spec.loader = _TorchLoader(spec.loader, self)
        return spec

    def loaded(self, torch: ModuleType) -> None:
        if self.fired:
            return
        self.fired = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        _enable(torch)


class _TorchLoader:
    """torch's own loader with :meth:`_TorchFinder.loaded` called after ``exec_module``.

    Anything else is the wrapped loader's (``get_filename``, ``is_package``, resource readers, ...),
    and the module gets the wrapped loader as ``__loader__`` and ``__spec__.loader``, as without the
    hook.
    """

    def __init__(self, loader: Any, finder: _TorchFinder) -> None:
        self._loader = loader
        self._finder = finder

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":  # not set yet (a copy in the making): no endless recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def exec_module(self, module: ModuleType) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        self._finder.loaded(module)


def _enable(torch: ModuleType) -> None:
    """Called when torch's import completes: check the settings, then import amp_bn_fix (which enables it).

    With ``import amp_bn_fix`` already under way (it imports torch), the import here returns that
    module and its own import finishes the job: one wrapper either way. Errors are one warning line,
    and ``import torch`` succeeds.
    """
    global _registered
    # SystemExit too (a broken module calling sys.exit must not end the program), but not
    # KeyboardInterrupt: this runs inside the user's ``import torch``, where a real Ctrl-C is likely
    # enough and must stop the program as it would without the shim.
    try:
        from . import settings, status

        if not settings.hook_requested():  # switched off after start-up
            _registered = False
            return
        shadow = status.shadowing_folder()
        if shadow is not None:
            raise ImportError(status.describe_shadowing(shadow))
        import amp_bn_fix  # noqa: F401  (raises ValueError for a bad setting)
    except (Exception, SystemExit) as exc:
        _registered = False
        warn(str(exc) if isinstance(exc, (ValueError, ImportError)) else f"enabling failed ({type(exc).__name__}: {exc})")


def warn(problem: str) -> None:
    """Report ``problem`` as one line on stderr, written directly: no logging set-up can hide it."""
    try:
        sys.stderr.write(WARNING.format(problem=" ".join(str(problem).split())) + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no usable stderr (pythonw, closed): nothing to tell
        pass
