"""Every torch call whose spelling depends on the torch version lives here (torch >= 2.4)."""

from __future__ import annotations

import torch

# Both take a device type since torch 2.4; older spellings (torch.is_autocast_cpu_enabled, ...)
# are deprecated and not supported.
_is_autocast_available = torch.amp.is_autocast_available


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for types autocast does not know)."""
    return _is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_dtype(device_type: str) -> torch.dtype:
    """The lower-precision dtype autocast currently uses on ``device_type``."""
    return torch.get_autocast_dtype(device_type)


def autocast_disabled(device_type: str) -> torch.autocast:
    """A context manager that turns autocast off for ``device_type``."""
    return torch.autocast(device_type, enabled=False)


def functorch_transforms_active() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, ...) is running (a private torch query)."""
    return torch._C._are_functorch_transforms_active()
