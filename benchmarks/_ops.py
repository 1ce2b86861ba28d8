"""Quiet profiler runs: some torch builds print a line per profiler start and stop."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Some torch builds print a line per profiler start and stop on the C stderr: not ours to show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
