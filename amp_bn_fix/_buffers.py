"""Keep BatchNorm running statistics (and optionally weight and bias) FP32 when a model is cast.

``Module._apply(fn)`` performs every conversion (``.half()``, ``.bfloat16()``, ``.to(...)``,
``.cuda()``, ``.type(...)``): it calls ``fn`` on each parameter, gradient and buffer and stores the
results. :func:`apply_keeping_fp32` hands the original a ``fn`` that, for the tensors to keep, turns a
16-bit result into float32 on the device the conversion chose, converting from the tensor as it was
before, so values never round-trip through half (16-bit tensors from before the shim are upcast).
torch's own code still decides how each result is stored (``.data`` assignment, a new Parameter, or
a swap), so Parameter identity, gradients and optimizer references behave exactly as in torch.

With ``keep_fp32=master`` (the default) the cast is torch's own and :func:`apply_carrying_masters`
moves the running stats' FP32 masters (``_master``) along with it.

The runtime (``_patch``) passes in the original ``_apply`` and the keep mode.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Optional, Set, Tuple

import torch

from . import _master

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
    if mean is None or var is None or mean.is_meta:
        return original(*args, **kwargs)
    kept = _master.peek(mean, var) if mean.dtype in _HALF else None
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
        _master.seed(new_mean, new_var, kept.to(new_mean.device, torch.float32, copy=True))
    return out
