"""FP32 master copies of 16-bit running statistics: a half model stays a half model.

A model cast to 16 bits (``.half()``, ``.bfloat16()``, ``.to(dtype)``) keeps exactly the dtypes its
user asked for: its state dict, ``parameters()``, ``buffers()``, pickles and fusers see what plain
torch shows. The accuracy of its running statistics lives here instead, as mixed-precision
optimizers keep master weights: one FP32 ``(2, C)`` tensor per BatchNorm (mean and variance), which
the shim updates where it computes a training call and rounds into the 16-bit buffers after each
update. Eval calls the shim computes read it, not the rounded buffers.

A master belongs to the very buffer objects it was made for, in the state they were left in: it
is dropped when either buffer is changed from outside (``load_state_dict``, ``copy_``, any
in-place op bumps the buffer's version counter; the shim writes through ``.data``, which does
not), when a call updates the buffers without the shim (``policy("off")``, a device type left
out, ``disable()``), and with the buffers themselves. A buffer without a master starts one from its
own values.

CUDA graphs: a replay runs the device ops captured and no Python, so neither a version counter nor
a dropped master is seen there. A master that a call uses while a CUDA graph is captured is
therefore kept by value from then on, for good: every call that uses it, captured or eager, first
checks on the device (five ops, no read) that it still rounds to the buffers, and starts it again
from them where it does not (a ``load_state_dict`` between replays, torch's own update). It stays
the one tensor the graph holds: nothing drops or replaces it while its buffers live, ``disable()``
included. A captured
call that finds no master makes one that holds nothing until that check fills it, at the first
replay (or at an eager call before it): the captured graph never seeds it again from the rounded
buffers.

The cast hook (``_BatchNorm._apply``, patched by ``_patch``) carries masters along, so
``.to(device)`` and ``.float()`` lose nothing; with ``keep_fp32`` ``all`` or ``stats`` it keeps the
module's own tensors FP32 instead (:func:`apply_keeping_fp32`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, FrozenSet, Optional, Set, Tuple

import torch

from . import _record, _state
from ._compat import foreach_copy

_F32 = torch.float32
_UninitializedBuffer = torch.nn.parameter.UninitializedBuffer


class _Master:
    __slots__ = ("mean_ref", "var_ref", "values", "versions", "by_value")

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, values: torch.Tensor,
                 on_death: "weakref.ReferenceType[torch.Tensor]") -> None:
        self.mean_ref = on_death
        self.var_ref = weakref.ref(running_var)
        self.values = values
        self.versions = (running_mean._version, running_var._version)
        # Checked against the buffers' values, not their versions: a CUDA graph has captured it.
        self.by_value = False


# id(running_mean) -> its master
_masters: Dict[int, _Master] = {}


def _of(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[_Master]:
    """The master made for these very buffer objects, current or not."""
    master = _masters.get(id(running_mean))
    if master is None or master.mean_ref() is not running_mean or master.var_ref() is not running_var:
        return None
    return master


def _current(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[_Master]:
    master = _of(running_mean, running_var)
    if master is None or not (master.by_value or master.versions == (running_mean._version, running_var._version)):
        return None
    return master


def values(running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
    """The FP32 ``(2, C)`` master of these 16-bit stats, started from their values if there is none."""
    master = _of(running_mean, running_var)
    if master is not None and master.by_value:
        return _checked_by_value(master.values, running_mean, running_var)
    if not _record.capturing():
        if master is not None and master.versions == (running_mean._version, running_var._version):
            return master.values
        return seed(running_mean, running_var, torch.stack((running_mean, running_var)).to(_F32))
    # Captured into a CUDA graph: this master is kept by value from now on. One made here holds
    # nothing yet (the op that made it would run at every replay): the check fills it.
    if master is None:
        empty = torch.empty((2, *running_mean.shape), dtype=_F32, device=running_mean.device)
        seed(running_mean, running_var, empty)
        master = _masters[id(running_mean)]
    master.by_value = True
    return _checked_by_value(master.values, running_mean, running_var)


def _checked_by_value(values: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
    """``values``, started again from the buffers unless it rounds to them exactly: on the device, no read.

    A master that rounds to its buffers is as good as one started from them (both lie within half a
    16-bit step of them); one that does not (the buffers changed from outside, or it holds nothing
    yet) takes their values, NaN included. Written through ``.data``: no version bump, as with the
    rest of the running-stat update.
    """
    buffers = torch.stack((running_mean, running_var))
    stale = torch.ne(values.to(buffers.dtype), buffers).any()
    torch.where(stale, buffers, values.data, out=values.data)
    return values


def peek(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[torch.Tensor]:
    """The master of these stats if one is kept (nothing is made; one kept by value is checked first)."""
    master = _current(running_mean, running_var)
    if master is None:
        return None
    return _checked_by_value(master.values, running_mean, running_var) if master.by_value else master.values


def is_kept(running_mean: torch.Tensor, running_var: torch.Tensor) -> bool:
    """Whether these stats have a master (a cheap lookup: the decision asks it outside autocast)."""
    return _current(running_mean, running_var) is not None


def seed(running_mean: torch.Tensor, running_var: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keep ``values`` (FP32, ``(2, C)``, on the stats' device) as the master of these stats.

    A master kept by value stays the tensor a CUDA graph holds: it takes ``values`` in place.
    """
    key = id(running_mean)
    kept = _of(running_mean, running_var)
    if (kept is not None and kept.by_value and kept.values.shape == values.shape
            and kept.values.device == values.device):
        kept.values.data.copy_(values)
        return kept.values

    def drop(ref: "weakref.ReferenceType[torch.Tensor]") -> None:
        if _masters.get(key) is master:
            del _masters[key]

    master = _Master(running_mean, running_var, values, weakref.ref(running_mean, drop))
    _masters[key] = master
    return values


def commit(running_mean: torch.Tensor, running_var: torch.Tensor, values: torch.Tensor) -> None:
    """Round the updated master into the 16-bit buffers: through ``.data``, so no version bump."""
    foreach_copy((running_mean.data, running_var.data), (values[0], values[1]))


def forget(running_mean: torch.Tensor) -> None:
    """These stats were updated without the shim: their master, if any, no longer holds.

    One kept by value stays (a CUDA graph holds it): its next use starts it again from the buffers.
    """
    key = id(running_mean)
    master = _masters.get(key)
    if master is not None and not (master.by_value and master.mean_ref() is running_mean):
        del _masters[key]


def clear() -> None:
    """Drop every master (the shim stops watching the buffers: ``disable()``) but those kept by value.

    A CUDA graph goes on writing those at each replay, with the shim or without it: freeing one would
    hand memory the graph writes to other tensors. Checked by value, they are right again whenever
    the shim is enabled anew.
    """
    for key in [key for key, master in _masters.items() if not master.by_value]:
        del _masters[key]


# The cast hook: ``Module._apply(fn)`` performs every conversion (``.half()``, ``.bfloat16()``,
# ``.to(...)``, ``.cuda()``, ``.type(...)``), calling ``fn`` on each parameter, gradient and buffer.
_HALF = (torch.float16, torch.bfloat16)
_STATS = ("running_mean", "running_var")
_AFFINE = ("weight", "bias")


def _kept_ids(module: torch.nn.Module, keep: str) -> Set[int]:
    """The ids of the tensors of ``module`` (not of its children) that must not become 16-bit."""
    tensors = [module._buffers.get(name) for name in _STATS]
    if keep == "all":
        for name in _AFFINE:
            param = module._parameters.get(name)
            if param is not None:
                tensors += [param, param.grad]
    return {id(t) for t in tensors if t is not None}


_Fn = Callable[[torch.Tensor], torch.Tensor]


def _split_fn(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[_Fn, Tuple[Any, ...], Dict[str, Any]]:
    # ``Module._apply(self, fn, recurse=True)``: ``fn`` may come by position or by name.
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("fn"), (), rest


def apply_keeping_fp32(
    original: Callable[..., torch.nn.Module],
    module: torch.nn.Module,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    keep: str,
    devices: Optional[FrozenSet[str]] = None,
) -> torch.nn.Module:
    """Run ``module._apply`` so that its kept tensors come out float32 instead of 16-bit.

    ``keep`` is ``"all"`` (running_mean, running_var, weight, bias and their gradients),
    ``"stats"`` (the running stats only) or ``"none"`` (torch's behaviour). Casts to
    float32/float64 are untouched, and so are tensors that land on a device type outside
    ``devices`` (``None``: every type), whose calls the shim leaves to torch.
    """
    if keep == "none" or not (args or "fn" in kwargs):
        return original(*args, **kwargs)  # a malformed call raises torch's own error
    fn, rest, rest_kwargs = _split_fn(args, kwargs)
    kept = _kept_ids(module, keep)

    def keeping_fn(tensor: torch.Tensor) -> torch.Tensor:
        result = fn(tensor)
        if id(tensor) not in kept or result.dtype not in _HALF:
            return result
        if devices is not None and result.device.type not in devices:
            return result
        # Convert from the tensor as it was, never from the rounded result; a meta tensor has
        # no values to convert (``to_empty`` turns it into uninitialized memory anyway).
        source = result if tensor.is_meta else tensor
        return source.to(device=result.device, dtype=torch.float32)

    return original(keeping_fn, *rest, **rest_kwargs)


def apply_carrying_masters(
    original: Callable[..., torch.nn.Module],
    module: torch.nn.Module,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    devices: Optional[FrozenSet[str]] = None,
) -> torch.nn.Module:
    """Run ``module._apply`` as torch does, the running stats' FP32 master following the cast.

    The module gets exactly torch's tensors. Cast to 16 bits from FP32 stats, the new buffers get a
    master made from the FP32 values before the cast; moved (``.to(device)``) or cast between 16-bit
    dtypes, they keep their master, moved along; cast back to FP32 (``.float()``), they take the
    master's values instead of the rounded ones. Nothing happens for a device type left out.
    """
    if not (args or "fn" in kwargs):
        return original(*args, **kwargs)  # a malformed call raises torch's own error
    fn, rest, rest_kwargs = _split_fn(args, kwargs)
    mean, var = module._buffers.get("running_mean"), module._buffers.get("running_var")
    # A lazy module before its first batch has no values yet: torch's cast sets the dtype it will have.
    if mean is None or var is None or isinstance(mean, _UninitializedBuffer) or mean.is_meta:
        return original(*args, **kwargs)
    kept = peek(mean, var) if mean.dtype in _HALF else None
    if kept is None and mean.dtype is torch.float32 and var.dtype is torch.float32:
        kept = torch.stack((mean.detach(), var.detach()))
    if kept is None:
        return original(*args, **kwargs)

    def carrying_fn(tensor: torch.Tensor) -> torch.Tensor:
        result = fn(tensor)
        if (tensor is mean or tensor is var) and result.dtype is torch.float32 and tensor.dtype in _HALF:
            # Back to FP32: the master's values, not the rounded ones.
            return kept[0 if tensor is mean else 1].to(result.device, copy=True)
        return result

    out = original(carrying_fn, *rest, **rest_kwargs)
    new_mean, new_var = module._buffers.get("running_mean"), module._buffers.get("running_var")
    if (
        new_mean is not None and new_var is not None and new_mean.dtype in _HALF and new_var.dtype is new_mean.dtype
        and not new_mean.is_meta and (devices is None or new_mean.device.type in devices)
    ):
        seed(new_mean, new_var, kept.to(new_mean.device, torch.float32, copy=True))
    return out


def cast_hook(wrapped: Callable[..., Any], instance: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The wrapper of ``_BatchNorm._apply``: casts keep BatchNorm FP32 as ``keep_fp32`` says (read per call)."""
    config = _state.config
    keep = "none" if _state.policy() == "off" else config.keep_fp32
    if keep == "master":
        return apply_carrying_masters(wrapped, instance, args, kwargs, config.devices)
    return apply_keeping_fp32(wrapped, instance, args, kwargs, keep, config.devices)
