"""Where a warning points: the first frame outside the package's machinery, the user's line."""

from __future__ import annotations

import sys


def stacklevel_outside(*modules: str) -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, name the
    first frame whose module is none of ``modules`` nor inside one of them (a package), and not
    code torch.fx generated (a traced or compiled graph's ``forward``, part of what called it)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and (_within(frame.f_globals.get("__name__", ""), modules)
                                 or frame.f_code.co_filename.startswith(_GENERATED)):
        level, frame = level + 1, frame.f_back
    return level


# The file name torch.fx gives the code it generates (``<eval_with_key>.3``).
_GENERATED = "<eval_with_key>"


def _within(name: str, modules: tuple) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)
