"""FP32 master copies of 16-bit running statistics: a half model stays a half model.

A model cast to 16 bits (``.half()``, ``.bfloat16()``, ``.to(dtype)``) keeps exactly the dtypes its
user asked for: its state dict, ``parameters()``, ``buffers()``, pickles and fusers see what plain
torch shows. The accuracy of its running statistics lives here instead, as mixed-precision
optimizers keep master weights: one FP32 ``(2, C)`` tensor per BatchNorm (mean and variance), which
the shim updates where it computes a training call and rounds into the 16-bit buffers after each
update. Eval calls the shim computes read it, not the rounded buffers.

A master belongs to the very buffer objects it was made for, and it holds only while those buffers
still hold its rounding: every call that uses it first compares them, by value. Whatever changed
the buffers (``load_state_dict``, an in-place op, a write through ``.data``, a collective such as
``dist.broadcast``, torch's own update where the shim stepped aside), the next training call starts
the master again from their values, and an eval call reads their values and leaves the master as it
is, so buffers swapped for a while and restored find it again. A write that leaves them as they were
leaves the master, which lies within half a 16-bit step of them, as good as one started from them.
On the host route (CPU) the comparison is
read there; on the device route (CUDA) it is a select on the device, with no read. A master is
dropped with its buffers and by ``disable()``; buffers without one start one at the next training
call the shim computes, with autocast or without.

CUDA graphs: a replay runs the device ops captured and no Python. A master that a call uses while a
CUDA graph is captured is therefore checked on the device from then on (the captured check runs at
every replay), and it stays the one tensor the graph holds: nothing replaces or drops it while its
buffers live, ``disable()`` included. A captured call that finds no master makes one that holds
nothing until a training call's check fills it, at the first replay (or at an eager call before
it): the captured graph never seeds it again from the rounded buffers.

The cast hook (``_BatchNorm._apply``, patched by ``_patch``) carries masters along, so
``.to(device)`` and ``.float()`` lose nothing; with ``keep_fp32`` ``all`` or ``stats`` it keeps the
module's own tensors FP32 instead (:func:`apply_keeping_fp32`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from . import _guard, _record, _state, _tuning
from ._compat import LOW_PRECISION, foreach_copy

_F32 = torch.float32
# The dtypes a cast from 16 bits takes the master's values into.
_WIDER = (torch.float32, torch.float64)
_UninitializedBuffer = torch.nn.parameter.UninitializedBuffer
_BatchNorm, _InstanceNorm = torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm


class _Master:
    __slots__ = ("mean_ref", "var_ref", "values", "rows", "written", "written_rows", "captured")

    def __init__(self, running_var: torch.Tensor, values: torch.Tensor, written: torch.Tensor,
                 on_death: "weakref.ReferenceType[torch.Tensor]") -> None:
        self.mean_ref = on_death
        self.var_ref = weakref.ref(running_var)
        self.values = values
        # What the buffers last took from it, in their dtype: the check compares them with this,
        # an op less than rounding ``values`` again at every call.
        self.written = written
        # The rows of both, made once: a view costs about a microsecond on every call.
        self.rows, self.written_rows = values.unbind(), written.unbind()
        # A CUDA graph holds it: checked on the device, never replaced or dropped.
        self.captured = False


# id(running_mean) -> its master
_masters: Dict[int, _Master] = {}


def _registered(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[_Master]:
    """The master made for these very buffer objects, as they are now or not."""
    master = _masters.get(id(running_mean))
    if master is None or master.mean_ref() is not running_mean or master.var_ref() is not running_var:
        return None
    return master


def _of(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[_Master]:
    """The master made for these very buffer objects, whether it still holds or not (none where the
    buffers were given another shape, device or dtype through ``.data``: channel pruning, say)."""
    master = _registered(running_mean, running_var)
    if master is None:
        return None
    written = master.written
    if (written.shape[1:] != running_mean.shape or written.device != running_mean.device
            or written.dtype is not running_mean.dtype):
        return None
    return master


def for_update(running_mean: torch.Tensor, running_var: torch.Tensor, host: bool) -> _Master:
    """The master a training call updates, and :func:`commit` then rounds into these 16-bit stats:
    checked against them (``host``: read there), taking their values where they changed, or
    started from their values if there is none."""
    capturing = _record.capturing()
    master = _kept(running_mean, running_var, capturing)
    if master is None:
        buffers = torch.stack((running_mean, running_var))
        return seed(running_mean, running_var, buffers.to(_F32), buffers)
    _checked(master, running_mean, running_var, host and not capturing, in_place=True)
    return master


def for_reading(running_mean: torch.Tensor, running_var: torch.Tensor,
                host: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP32 running stats an eval call reads: the master's rows where the buffers hold what it
    wrote last, else their own values. Reading changes no master: buffers swapped for a while (an
    EMA's stats for validation) and then restored find theirs again."""
    capturing = _record.capturing()
    master = _kept(running_mean, running_var, capturing)
    if master is None:
        return running_mean.to(_F32), running_var.to(_F32)
    values = _checked(master, running_mean, running_var, host and not capturing, in_place=False)
    return master.rows if values is master.values else values.unbind()


def _kept(running_mean: torch.Tensor, running_var: torch.Tensor, capturing: bool) -> Optional[_Master]:
    """The master of these stats. While a CUDA graph is captured it is marked so (checked on the
    device from now on), and one is made if there is none: it holds nothing until a training
    call's check fills it (the op that filled it at once would run at every replay)."""
    master = _of(running_mean, running_var)
    if not capturing:
        return master
    if master is None:
        shape, device = (2, *running_mean.shape), running_mean.device
        # Uninitialized both: the first check finds the buffers changed (as good as certain: the
        # odds that garbage equals them bit for bit are nil) and takes their values.
        master = seed(running_mean, running_var, torch.empty(shape, dtype=_F32, device=device),
                      torch.empty(shape, dtype=running_mean.dtype, device=device))
    master.captured = True
    return master


def _checked(master: _Master, running_mean: torch.Tensor, running_var: torch.Tensor, host: bool, *,
             in_place: bool) -> torch.Tensor:
    """The master's values, or the buffers' where they do not hold what it wrote last.

    A master whose rounding the buffers hold is as good as one started from them (both lie within
    half a 16-bit step of them); buffers written since (or a master that holds nothing yet) give
    their values, NaN included. ``host``: compared there; else a select on the device, no read.
    ``in_place`` (an update follows, and its commit): the master takes the buffers' values, through
    ``.data`` (no version bump, as with the rest of the running-stat update); else a new tensor,
    and the master stays as it is.
    """
    values, written = master.values, master.written
    if host:
        held_mean, held_var = master.written_rows
        if torch.equal(held_mean, running_mean) and torch.equal(held_var, running_var):
            return values
        buffers = torch.stack((running_mean, running_var))
        if not in_place:
            return buffers.to(_F32)
        foreach_copy((values.data, written), (buffers, buffers))
        return values
    buffers = torch.stack((running_mean, running_var))
    stale = torch.ne(written, buffers).any()
    if not in_place:
        return torch.where(stale, buffers, values)
    # ``written`` is left as it is: the commit after the update writes it.
    torch.where(stale, buffers, values.data, out=values.data)
    return values


def has(running_mean: torch.Tensor, running_var: torch.Tensor) -> bool:
    """Whether these very buffer objects have a master (made under ``keep_fp32="master"``: it stays
    theirs whatever the setting later)."""
    return _of(running_mean, running_var) is not None


def peek(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[torch.Tensor]:
    """The FP32 ``(2, C)`` values an eval call would read for these stats, if they have a master
    (nothing is made or changed)."""
    master = _of(running_mean, running_var)
    if master is None:
        return None
    return _checked(master, running_mean, running_var, _tuning.host_route(running_mean), in_place=False)


def holds_more(running_mean: torch.Tensor, running_var: torch.Tensor) -> bool:
    """Whether float16 buffers that have a master hold an inf: a running stat beyond 65504, which the
    master holds finite. An eval call outside autocast then reads the master, where plain torch's
    gives zeros or NaN. Read on the host route only: on the device route such a call reads the
    buffers, as torch does (the read would wait for the device at every eval call).
    """
    return (running_mean.dtype is torch.float16 and _tuning.host_route(running_mean)
            and _of(running_mean, running_var) is not None and not _guard.host_finite(running_mean, running_var))


def seed(running_mean: torch.Tensor, running_var: torch.Tensor, values: torch.Tensor,
         written: Optional[torch.Tensor] = None) -> _Master:
    """Keep ``values`` (FP32, ``(2, C)``, on the stats' device) as the master of these stats, whose
    buffers hold ``written`` (by default its rounding to their dtype); returns the master.

    A master a CUDA graph holds stays that tensor: it takes ``values`` in place.
    """
    key = id(running_mean)
    if written is None:
        written = values.to(running_mean.dtype)
    if values.is_inference() or written.is_inference():
        # Made under ``torch.inference_mode()`` (a recalibration's first call, a cast): the master
        # outlives the block, and every later call writes it in place.
        with torch.inference_mode(False):
            values, written = values.clone(), written.clone()
    kept = _of(running_mean, running_var)
    if kept is not None and kept.captured:  # of the buffers' shape, device and dtype (``_of``)
        foreach_copy((kept.values.data, kept.written), (values, written))
        return kept

    def drop(ref: "weakref.ReferenceType[torch.Tensor]") -> None:
        if _masters.get(key) is master:
            _masters.pop(key, None)

    master = _Master(running_var, values, written, weakref.ref(running_mean, drop))
    _masters[key] = master
    return master


def commit(running_mean: torch.Tensor, running_var: torch.Tensor, master: _Master) -> None:
    """Round the updated master into the 16-bit buffers (through ``.data``, so no version bump) and
    into what it keeps as written, in one op."""
    foreach_copy((running_mean.data, running_var.data, *master.written_rows), master.rows * 2)


def clear() -> None:
    """Drop every master (the shim stops watching the buffers: ``disable()``) but those kept by value.

    A CUDA graph goes on writing those at each replay, with the shim or without it: freeing one would
    hand memory the graph writes to other tensors. Checked by value, they are right again whenever
    the shim is enabled anew.
    """
    # A copy of the items, and no error for a key gone since: a master's callback drops it when its
    # buffers die, in any thread, at any allocation.
    for key, master in list(_masters.items()):
        if not master.captured and _masters.get(key) is master:
            _masters.pop(key, None)


# The cast hook: ``Module._apply(fn)`` performs every conversion (``.half()``, ``.bfloat16()``,
# ``.to(...)``, ``.cuda()``, ``.type(...)``), calling ``fn`` on each parameter, gradient and buffer.
_AFFINE = ("weight", "bias")


def _stats_of(module: torch.nn.Module) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The running mean and variance ``module`` holds now (None where it has none)."""
    return module._buffers.get("running_mean"), module._buffers.get("running_var")


# The forward pre-hooks that compute a parameter from tensors of the module's own, by the hook's
# type: its attribute naming the parameter, and the suffixes of the tensors it reads
# (``torch.nn.utils.weight_norm``: ``{name}_g``, ``{name}_v``; ``prune``: ``{name}_orig``;
# ``spectral_norm``: ``{name}_orig`` and its power iteration's ``{name}_u``, ``{name}_v``).
_COMPUTING_HOOKS = ((WeightNorm, "name", ("_g", "_v")), (BasePruningMethod, "_tensor_name", ("_orig",)),
                    (SpectralNorm, "name", ("_orig", "_u", "_v")))


def _sources(module: torch.nn.Module, name: str) -> List[torch.Tensor]:
    """What ``module``'s parameter ``name`` is when it runs: the parameter itself, or the tensors
    torch computes it from (a parametrization's originals and buffers, a computing hook's tensors)."""
    found = [module._parameters.get(name)]
    parametrizations = module._modules.get("parametrizations")
    if parametrizations is not None and name in parametrizations:
        found += [*parametrizations[name].parameters(), *parametrizations[name].buffers()]
    for hook in module._forward_pre_hooks.values():
        for kind, attribute, suffixes in _COMPUTING_HOOKS:
            if isinstance(hook, kind) and getattr(hook, attribute, None) == name:
                found += [module._parameters.get(name + suffix, module._buffers.get(name + suffix))
                          for suffix in suffixes]
    return [t for t in found if t is not None]


def _kept_ids(module: torch.nn.Module, keep: str) -> Set[int]:
    """The ids of the tensors of ``module`` that must not become 16-bit: its running stats, and under
    ``all`` what its weight and bias are (:func:`_sources`), with their gradients."""
    tensors = list(_stats_of(module))
    if keep == "all":
        for name in _AFFINE:
            tensors += [t for source in _sources(module, name) for t in (source, source.grad)]
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
        if id(tensor) not in kept or result.dtype not in LOW_PRECISION:
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

    The module gets torch's tensors, of the dtypes torch gives. Cast to 16 bits from FP32 (or
    float64) stats, the new buffers get a master made from their values before the cast; moved (``.to(device)``) or
    cast between 16-bit dtypes, they keep their master, moved along, and hold its rounding to their
    new dtype; cast back to FP32 or float64 (``.float()``, ``.double()``), they take the master's
    values instead of the rounded ones. Nothing happens for a device type left out.
    """
    if not (args or "fn" in kwargs):
        return original(*args, **kwargs)  # a malformed call raises torch's own error
    fn, rest, rest_kwargs = _split_fn(args, kwargs)
    mean, var = _stats_of(module)
    # A lazy module before its first batch has no values yet: torch's cast sets the dtype it will have.
    if mean is None or var is None or isinstance(mean, _UninitializedBuffer) or mean.is_meta:
        return original(*args, **kwargs)
    kept = peek(mean, var) if mean.dtype in LOW_PRECISION else None
    if kept is None and mean.dtype in _WIDER and var.dtype is mean.dtype:
        kept = torch.stack((mean.detach(), var.detach())).float()
    if kept is None:
        return original(*args, **kwargs)

    def carrying_fn(tensor: torch.Tensor) -> torch.Tensor:
        result = fn(tensor)
        # A cast that leaves a buffer where it is (to its own device or dtype, ``share_memory()``)
        # leaves it: the same object, shared memory and all, as in plain torch. Onto a device type
        # left out, torch's own cast.
        if (result is tensor or not (tensor is mean or tensor is var) or result.is_meta
                or tensor.dtype not in LOW_PRECISION or (devices is not None and result.device.type not in devices)):
            return result
        if result.dtype in _WIDER or result.dtype in LOW_PRECISION:
            # Back to FP32 (or float64): the master's values, not the rounded ones. Between 16-bit
            # dtypes: the master rounded to the new one (a master holds while its buffers hold its
            # rounding), not the old rounding cast again.
            return kept[0 if tensor is mean else 1].to(result.device, result.dtype, copy=True)
        return result

    out = original(carrying_fn, *rest, **rest_kwargs)
    new_mean, new_var = _stats_of(module)
    if new_mean is mean and new_var is var:  # the master goes on with its buffers
        return out
    if (
        new_mean is not None and new_var is not None and new_mean.dtype in LOW_PRECISION and new_var.dtype is new_mean.dtype
        and not new_mean.is_meta and (devices is None or new_mean.device.type in devices)
    ):
        seed(new_mean, new_var, kept.to(new_mean.device, torch.float32, copy=True))
    return out


def cast_hook(wrapped: Callable[..., Any], instance: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The wrapper of ``_BatchNorm._apply`` and ``_InstanceNorm._apply``. BatchNorm's casts keep it
    FP32 as ``keep_fp32`` says (read per call), and stats that have a master carry it whatever the
    setting now (it applies to casts from FP32: a model cast under ``master`` keeps its master).
    Both keep the guard's record of the running mean: it follows it to the tensor the cast puts in
    its place, so ``report(model)`` names its skips."""
    batch_norm = isinstance(instance, _BatchNorm)
    if getattr(wrapped, "__wrapped__", None) is None:
        # What the class inherits now, not the ``Module._apply`` wrapped when the shim was enabled:
        # a library or a spy that patched it since sees the norms' casts too, as in plain torch. A
        # library's wrapper of the class's own, under the shim's, is called as it is.
        wrapped = super(_BatchNorm if batch_norm else _InstanceNorm, instance)._apply
    if not _state.active:  # a reference kept after disable() (another library's wrapper holds it)
        return wrapped(*args, **kwargs)
    config = _state.config
    before = _stats_of(instance)[0]
    if not batch_norm or _state.policy() == "off":  # torch's own cast
        out = wrapped(*args, **kwargs)
    elif config.keep_fp32 == "master" or _has_own_master(instance):
        out = apply_carrying_masters(wrapped, instance, args, kwargs, config.devices)
    else:
        out = apply_keeping_fp32(wrapped, instance, args, kwargs, config.keep_fp32, config.devices)
    after = _stats_of(instance)[0]
    if after is not before and before is not None and after is not None:
        _record.moved(before, after)
    return out


def _has_own_master(module: torch.nn.Module) -> bool:
    mean, var = _stats_of(module)
    return mean is not None and var is not None and has(mean, var)


def load_hook(wrapped: Callable[..., Any], instance: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The wrapper of ``_BatchNorm._load_from_state_dict`` and ``_InstanceNorm._load_from_state_dict``.
    Where torch swaps the loaded tensors into the module's
    (``torch.__future__.set_swap_module_params_on_conversion(True)``), it refuses a tensor with weak
    references: the shim's, of a master and of a guard record, give way for the load. A master then
    finds the loaded values at the next call, and starts again from them."""
    if not torch.__future__.get_swap_module_params_on_conversion():
        return wrapped(*args, **kwargs)
    mean, var = _stats_of(instance)
    if mean is None or var is None:
        return wrapped(*args, **kwargs)
    with _holding(mean, var), _record.holding(mean):
        return wrapped(*args, **kwargs)


@contextlib.contextmanager
def _holding(running_mean: torch.Tensor, running_var: torch.Tensor) -> Iterator[None]:
    """Within the block, the master of these buffers (if any) holds them without weak references."""
    master = _registered(running_mean, running_var)
    if master is None:
        yield
        return
    on_death = master.mean_ref.__callback__  # type: ignore[attr-defined]
    master.mean_ref, master.var_ref = (lambda: running_mean), (lambda: running_var)  # type: ignore[assignment]
    try:
        yield
    finally:
        master.mean_ref, master.var_ref = weakref.ref(running_mean, on_death), weakref.ref(running_var)
