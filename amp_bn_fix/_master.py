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
own values. Casts carry masters along (``_buffers``), so ``.to(device)`` and ``.float()`` lose nothing.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch

from ._compat import foreach_copy

_F32 = torch.float32


class _Master:
    __slots__ = ("mean_ref", "var_ref", "values", "versions")

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, values: torch.Tensor,
                 on_death: "weakref.ReferenceType[torch.Tensor]") -> None:
        self.mean_ref = on_death
        self.var_ref = weakref.ref(running_var)
        self.values = values
        self.versions = (running_mean._version, running_var._version)


# id(running_mean) -> its master
_masters: Dict[int, _Master] = {}


def _current(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[_Master]:
    master = _masters.get(id(running_mean))
    if (
        master is None
        or master.mean_ref() is not running_mean
        or master.var_ref() is not running_var
        or master.versions != (running_mean._version, running_var._version)
    ):
        return None
    return master


def values(running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
    """The FP32 ``(2, C)`` master of these 16-bit stats, started from their values if there is none."""
    master = _current(running_mean, running_var)
    if master is not None:
        return master.values
    return seed(running_mean, running_var, torch.stack((running_mean, running_var)).to(_F32))


def peek(running_mean: torch.Tensor, running_var: torch.Tensor) -> Optional[torch.Tensor]:
    """The master of these stats if one is kept (nothing is made)."""
    master = _current(running_mean, running_var)
    return None if master is None else master.values


def is_kept(running_mean: torch.Tensor, running_var: torch.Tensor) -> bool:
    """Whether these stats have a master (a cheap lookup: the decision asks it outside autocast)."""
    return _current(running_mean, running_var) is not None


def seed(running_mean: torch.Tensor, running_var: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keep ``values`` (FP32, ``(2, C)``, on the stats' device) as the master of these stats."""
    key = id(running_mean)

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
    """These stats were updated without the shim: their master, if any, no longer holds."""
    _masters.pop(id(running_mean), None)


def clear() -> None:
    """Drop every master (the shim stops watching the buffers: ``disable()``)."""
    _masters.clear()
