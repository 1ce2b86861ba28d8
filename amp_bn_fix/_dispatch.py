"""The dispatcher door's registration: kernels for ``aten::batch_norm`` and ``aten::instance_norm`` at autocast's keys.

Also ``aten::_batch_norm_impl_index`` there, which TorchScript's autodiff calls instead of
``batch_norm``, and its backward at the device's autograd key (``_doors``).

The ``F.batch_norm`` wrapper sees Python calls of that one function. Every other way to a batch
norm reaches ATen's ``batch_norm`` op: ``torch.batch_norm``, ``torch.ops.aten.batch_norm``,
``instance_norm`` (a batch norm over a reshaped input), TorchScript at run time, ``torch.jit.trace``
and the tracers under ``torch.compile``. Under autocast the dispatcher calls the kernel at the device
type's autocast key before autograd and the device's kernel, and torch has only a fallthrough there,
so Python kernels registered at AutocastCPU/CUDA/XPU see all of those calls; they are doors like the
wrapper (``_doors``). Outside autocast the key is excluded, so the kernels are not called at all.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Literal, Optional, Set, Tuple

import torch

from . import _compat, _doors

# The device types whose autocast key has only torch's fallthrough for ``batch_norm``. Not MPS:
# torch's own kernel there already computes batch_norm in FP32, and a key with any kernel is left alone.
DEVICE_TYPES = ("cpu", "cuda", "xpu")
KEYS = tuple(_compat.AUTOCAST_KEYS[t].name for t in DEVICE_TYPES if t in _compat.AUTOCAST_KEYS)

# The registration, kept across ``importlib.reload`` of this module (IPython's autoreload: the
# module's namespace is reused), so that a reload leaves one: a Library that is garbage-collected
# removes its kernels without a word. In the module's namespace, not on a ``DispatchPatch``: every
# incarnation of the class, and whichever of them ``_patch`` holds, reads the same one.
_library: Optional[torch.library.Library] = globals().get("_library")
_keys: Tuple[str, ...] = globals().get("_keys", ())
_warned_keys: Set[Tuple[str, str]] = globals().get("_warned_keys", set())


def registered_keys() -> Tuple[str, ...]:
    """The dispatch keys our kernels are registered at (empty when unregistered)."""
    return _keys


def describe() -> str:
    """The registration, for the compile cache key: the device types it covers (``cpu+cuda+xpu``) or ``none``."""
    return "+".join(key[len("Autocast"):].lower() for key in _keys) or "none"


class DispatchPatch:
    """The dispatcher door as a patch: our kernels, registered in one ``torch.library.Library``.

    ``_patch.install`` applies it when not applied and ``_patch.uninstall`` removes it, both under
    the state's lock.
    """

    @property
    def applied(self) -> bool:
        return _library is not None

    def apply(self) -> bool:
        """Register the kernels at every key of ``KEYS`` that torch leaves to autocast's fallthrough.

        Returns False when no key was free.
        """
        global _library, _keys
        plan: List[Tuple[str, str, Any]] = []
        for device_type in DEVICE_TYPES:
            key = _compat.AUTOCAST_KEYS.get(device_type)
            if key is None or not _free("batch_norm", key.name):
                continue
            plan.append(("batch_norm", key.name, _doors.batch_norm_kernel(device_type)))
            if _free("instance_norm", key.name):
                plan.append(("instance_norm", key.name, _doors.instance_norm_kernel(device_type)))
            # TorchScript's autodiff: its forward op under autocast, and its backward, which runs
            # outside autocast (at the device's autograd key, where torch has only a composite kernel).
            backward_key = "Autograd" + key.name[len("Autocast"):]
            if (_free("_batch_norm_impl_index", key.name) and hasattr(torch._C.DispatchKey, backward_key)
                    and _free("_batch_norm_impl_index_backward", backward_key)):
                plan.append(("_batch_norm_impl_index", key.name, _doors.batch_norm_impl_index_kernel(device_type)))
                plan.append(("_batch_norm_impl_index_backward", backward_key, _doors.batch_norm_impl_index_backward))
        if not plan:
            return False
        library = torch.library.Library("aten", "IMPL")
        try:
            for op, key, kernel in plan:
                library.impl(op, kernel, key)
        except BaseException:
            library._destroy()
            raise
        _library = library
        _keys = tuple(dict.fromkeys(key for _, key, _ in plan if key.startswith("Autocast")))
        return True

    def remove(self) -> Literal["nothing", "all"]:
        """Remove the kernels: ``"nothing"`` when none were registered."""
        global _library, _keys
        library, _library, _keys = _library, None, ()
        if library is None:
            return "nothing"
        library._destroy()
        return "all"


# The dispatcher door in ``_patch``'s list of patches.
PATCH = DispatchPatch()


def _free(op: str, key: str) -> bool:
    """Whether ``op`` has no kernel at ``key`` (a fallthrough), warning once about another library's."""
    if not _compat.has_dispatch_kernel(f"aten::{op}", key):
        return True
    if (op, key) not in _warned_keys:
        _warned_keys.add((op, key))
        warnings.warn(
            f"amp_bn_fix: another library has a kernel for aten::{op} at the {key} dispatch key; "
            f"amp_bn_fix leaves it in place, so {_LEFT_THERE.get(op, 'that op stays as that library makes it')}.",
            RuntimeWarning,
            stacklevel=5,  # the user's ``amp_bn_fix.enable()`` line (at import, the package's own)
        )
    return False


# What keeps the policy, or not, where another library's kernel stays in place of the door's.
_LEFT_THERE = {
    "batch_norm": "only torch.nn.functional.batch_norm calls get its policy there",
    "instance_norm": "InstanceNorm under autocast stays as that library makes it there",
}
