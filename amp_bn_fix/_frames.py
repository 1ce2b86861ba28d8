"""Where a warning points: the first frame outside the package's machinery, the user's line."""

from __future__ import annotations

import sys


def stacklevel_outside(*modules: str) -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, name the
    first frame whose module is none of ``modules`` nor inside one of them (a package)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and _within(frame.f_globals.get("__name__", ""), modules):
        level, frame = level + 1, frame.f_back
    return level


def _within(name: str, modules: tuple) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)
