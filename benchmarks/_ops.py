"""Counting the ATen ops one call runs: the kernel launches a GPU would pay.

``profiled_ops`` counts the top-level ``aten::`` events of ``torch.profiler`` (those with no
``aten::`` event above them): a composite op such as ``aten::batch_norm`` counts once with whatever
it calls. The profiler changes nothing about the route a call takes; a ``TorchDispatchMode`` would
(the shim treats any active mode as a tracer and computes the traced form).

Pure view and metadata ops (``VIEW_OPS``) are left out: they copy no data and launch no kernel.
The profiler also sees composites that are views unless they copy (``reshape``, ``to``, ...): one
counts when something it runs is not a view.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator, List

import torch

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "unsqueeze", "squeeze", "select", "slice", "as_strided", "alias",
    "detach", "t", "expand", "permute", "transpose", "lift_fresh", "view_as", "expand_as", "unbind", "split",
    "split_with_sizes", "chunk", "narrow", "diagonal", "unflatten",
    # Return their input unless it is conjugated or negated (``Tensor.tolist`` calls them).
    "resolve_conj", "resolve_neg",
})
# Views, or no-ops, unless they call something that copies (the profiler shows what they call).
MAYBE_VIEW_OPS = frozenset({"reshape", "flatten", "contiguous", "to", "type_as"})


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


def profiled_ops(fn: Callable[[], object]) -> List[str]:
    """The top-level non-view ``aten::`` ops ``fn`` runs, as the profiler records them, in order."""
    with quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops = []
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None and not _is_view(event):
            ops.append(event.name[len("aten::"):])
    return ops


def _is_view(event: Any) -> bool:
    name = event.name[len("aten::"):] if event.name.startswith("aten::") else None
    if name is None:  # not an op (a record_function range): what it runs decides
        return all(_is_view(child) for child in event.cpu_children)
    if name in VIEW_OPS:
        return True
    return name in MAYBE_VIEW_OPS and all(_is_view(child) for child in event.cpu_children)
