r"""Helpers for testing code that runs under amp_bn_fix, on a machine without a GPU.

A CUDA call takes another route through the shim than a CPU call: nothing is read from the device
on the host (the guard decides with ops on the device, and its counters stay there until
:func:`amp_bn_fix.report` reads them), and the CPU's own fast paths are not used. Under
:func:`device_route`, CPU calls take exactly that route, so a test suite without a GPU runs the
logic a GPU user meets; :func:`count_kernels` counts what that route would cost a GPU.

Example::

    >>> import torch, amp_bn_fix
    >>> from amp_bn_fix.testing import device_route
    >>> bn = torch.nn.BatchNorm1d(4)
    >>> x = torch.randn(8, 4, dtype=torch.bfloat16)
    >>> x[0, 0] = float("inf")
    >>> with device_route(), torch.autocast("cpu", dtype=torch.bfloat16):
    ...     _ = bn(x)
    >>> bool(torch.isfinite(bn.running_mean).all())   # the guard kept them, deciding "on the device"
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _state

__all__ = ["device_route", "count_kernels", "kept_for_backward", "Kernel", "Traffic"]

# How many device_route() blocks are open, in every thread (changed under the state's lock).
_depth = 0


@contextlib.contextmanager
def device_route() -> Iterator[None]:
    r"""Within the block, every call the shim computes takes the route a CUDA call takes.

    That is: no host reads of tensor values (the guard's decision and its count stay tensors on
    the device), no CPU fast paths (the ops a CUDA call runs, on CPU). Results stay within
    the bounds every route keeps; speed on CPU is not representative. Process-wide, for every
    thread (like the device a model runs on, it is not a per-thread setting); nestable.

    Example::

        >>> import torch, amp_bn_fix
        >>> from amp_bn_fix.testing import device_route
        >>> with device_route(), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch.nn.BatchNorm2d(3)(torch.randn(2, 3, 4, 4)).dtype
        torch.float32
    """
    global _depth
    with _state.lock:
        _depth += 1
        _state.device_route = True
    try:
        yield
    finally:
        with _state.lock:
            _depth -= 1
            _state.device_route = _depth > 0


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One op that runs a kernel: its name, the bytes it reads and writes, and the kernels CUDA launches for it."""

    name: str
    read: int
    written: int
    launches: int = 1


@dataclasses.dataclass
class Traffic:
    """What the ops run in a :func:`count_kernels` block cost a GPU, counted, not timed.

    ``kernels``: each op that runs a kernel, in order. Views and allocations run no kernel and are
    left out; a read of a value on the host (``.item()``, ``bool(tensor)``) is a kernel named
    ``_local_scalar_dense``.
    """

    kernels: List[Kernel] = dataclasses.field(default_factory=list)

    @property
    def launches(self) -> int:
        return sum(k.launches for k in self.kernels)

    @property
    def moved(self) -> int:
        """Bytes read and written by every kernel."""
        return sum(k.read + k.written for k in self.kernels)

    def names(self) -> List[str]:
        return [k.name for k in self.kernels]


# How CUDA's kernels for an op differ from "one launch, each operand read once" (read in
# aten/src/ATen/native/cuda/Normalization.cu). A training batch norm reduces its input for the
# statistics, then reads it again to normalize (``batch_norm_cuda_out``: the statistics, the
# running-stat update with the inverse std, the elementwise kernel); its backward reduces the
# gradient and the input, then reads both again for the input's gradient (one fused kernel in
# NCHW, ``batch_norm_backward_kernel``). ``batch_norm_update_stats_cuda`` runs the statistics and,
# given running stats, their update: two kernels.
_READ_TWICE: Dict[str, Tuple[int, ...]] = {
    "native_batch_norm": (0,), "_native_batch_norm_legit": (0,), "_native_batch_norm_legit_functional": (0,),
    "cudnn_batch_norm": (0,), "native_batch_norm_backward": (0, 1), "cudnn_batch_norm_backward": (0, 1),
}
# Where the training flag is among each of those ops' arguments.
_TRAINING_ARG = {"native_batch_norm": 5, "_native_batch_norm_legit": 5, "_native_batch_norm_legit_functional": 5,
                 "cudnn_batch_norm": 5, "native_batch_norm_backward": 7, "cudnn_batch_norm_backward": None}
_LAUNCHES = {"native_batch_norm": 3, "_native_batch_norm_legit": 3, "_native_batch_norm_legit_functional": 3,
             "_native_batch_norm_legit_no_training": 3}
# Ops whose second kernel runs only with running stats (argument 1): CUDA's statistics op, and the
# CPU stand-in the route a CUDA call takes runs for it there. By qualified name: ATen's own
# ``batch_norm_stats(input, eps)`` (SyncBatchNorm's) is one kernel.
_UPDATES_STATS = {"aten::batch_norm_update_stats", "amp_bn_fix::batch_norm_stats"}
# Ops that allocate without writing (``empty*``) or only read metadata run no kernel.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "size", "stride",
              "sym_size", "sym_stride", "sym_numel", "is_same_size", "_has_compatible_shallow_copy_type"}


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


# What a sparse tensor is made of, by layout: its indices and values.
_SPARSE_PARTS: Dict[torch.layout, Tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s distinct elements (an expanded dimension holds one); of a sparse
    tensor, those of its indices and values."""
    if t.layout is not torch.strided:
        parts = _SPARSE_PARTS.get(t.layout)
        if parts is None:  # another layout (mkldnn): dense values
            return t.numel() * t.element_size()
        return sum(_bytes(getattr(t, part)()) for part in parts)
    elements = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) if t.numel() else 0
    return elements * t.element_size()


class _Counter(TorchDispatchMode):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _has_kernel(func.name(), _COMPOSITE):
            # Under inference_mode (and for inference tensors) the autograd keys are skipped, and
            # the composite ops (``to``, ``reshape``, ``batch_norm``) reach this mode whole: their
            # C++ composite kernel runs as it runs elsewhere, its ops coming back here.
            with self:
                return func._op_dk(_COMPOSITE, *args, **kwargs)
        out = func(*args, **kwargs)
        qualified = func._schema.name
        name = qualified.split("::")[-1]
        returns = func._schema.returns
        if name in _NO_KERNEL or (returns and all(r.alias_info is not None and not r.alias_info.is_write
                                                  for r in returns)):
            return out  # a view
        twice = _READ_TWICE.get(name, ())
        if twice:
            flag = _TRAINING_ARG.get(name)
            if flag is not None and not (len(args) > flag and args[flag]):
                twice = ()
        read = written = 0
        written_ids = set()
        for i, argument in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            alias = argument.alias_info
            for t in tensors:
                if alias is not None and alias.is_write:
                    written += _bytes(t)
                    written_ids.add(id(t))
                    if argument.kwarg_only and argument.name.startswith("out"):
                        continue  # an output buffer, not read
                read += _bytes(t) * (2 if i in twice else 1)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in written_ids:
                written += _bytes(t)
        launches = 1 + (len(args) > 1 and args[1] is not None) if qualified in _UPDATES_STATS else _LAUNCHES.get(name, 1)
        self.traffic.kernels.append(Kernel(name, read, written, launches))
        return out


@contextlib.contextmanager
def count_kernels() -> Iterator[Traffic]:
    r"""Count the kernels the ops in the block run and the bytes each reads and writes: what they
    cost a GPU, whose time follows bytes for a memory-bound op such as BatchNorm.

    Counted by a TorchDispatchMode (so the shim's ops and torch's, forward and backward, are seen
    as the dispatcher runs them) that the shim does not count as a tracer: calls take the route
    they take without it. Each op's kernel is taken to read each tensor operand once and write
    each output once, except where CUDA's kernels for it are known to do otherwise (a training
    batch norm reads its input twice: statistics, then normalization). Combine with
    :func:`device_route` to count the route a CUDA call takes, and with :func:`kept_for_backward`
    for the memory a forward keeps. Per thread: ops other threads run are not counted.

    Example::

        >>> import torch, amp_bn_fix
        >>> from amp_bn_fix.testing import count_kernels, device_route
        >>> bn, x = torch.nn.BatchNorm2d(64), torch.randn(16, 64, 32, 32).bfloat16()
        >>> with device_route(), count_kernels() as traffic, torch.autocast("cpu", dtype=torch.bfloat16):
        ...     y = bn(x)
        >>> round(traffic.moved / x.numel())   # bytes per value: the input read twice, an FP32 output
        8
    """
    traffic = Traffic()
    thread = _state.thread
    with _Counter(traffic):
        thread.counters += 1
        try:
            yield traffic
        finally:
            thread.counters -= 1


def kept_for_backward(*outputs: torch.Tensor) -> int:
    r"""The bytes autograd keeps to differentiate ``outputs``: every tensor a node of their graph
    saved for backward, each once (call it before the backward frees them).

    Example::

        >>> import torch
        >>> from amp_bn_fix.testing import kept_for_backward
        >>> x = torch.randn(8, 4, requires_grad=True)
        >>> kept_for_backward(torch.nn.BatchNorm1d(4)(x)) >= x.numel() * 4   # the input, at least
        True
    """
    kept: Dict[Tuple[int, int, torch.dtype], int] = {}
    seen = set()
    nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for value in _saved(node):
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    # A sparse tensor has no data pointer: each is its own.
                    where = t.data_ptr() if t.layout is torch.strided else id(t)
                    kept[(where, t.numel(), t.dtype)] = _bytes(t)
        nodes.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return sum(kept.values())


def _saved(node: Any) -> List[Any]:
    """What ``node`` keeps for backward, as it keeps it.

    A built-in node shows it as ``_saved_<name>``, a Python Function's as ``saved_tensors``; each
    tensor among them is also there as a ``SavedTensor`` (``_raw_saved_<name>``,
    ``_raw_saved_tensors``). A tensor that saved-tensor hooks packed (activation checkpointing,
    ``save_on_cpu``) is kept as what its pack hook returned: that is read (a checkpoint's holder
    is no tensor), never unpacked, which for a checkpoint would run its forward again, running
    stats and all. Where torch's ``SavedTensor`` does not show the packed value (2.4 does not),
    it is unpacked: there, call this outside checkpointed code.
    """
    kept: List[Any] = []
    for name in dir(node):
        if name.startswith("_saved_"):
            raw = getattr(node, "_raw" + name, None)
        elif name == "saved_tensors":
            raw = getattr(node, "_raw_saved_tensors", None)
        else:
            continue
        raws = raw if isinstance(raw, (tuple, list)) else () if raw is None else (raw,)
        if raws and all(hasattr(r, "data") for r in raws):
            # As stored: a tensor, what a pack hook returned, or None where nothing was saved.
            kept.extend(r.data for r in raws)
        else:
            kept.append(getattr(node, name))
    return kept
