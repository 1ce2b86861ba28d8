"""The wrapper a patch puts in place: wrapt's function wrapper, copied and pickled like the function it replaces."""

from __future__ import annotations

import copy
import importlib
import inspect
import operator
from typing import Any, Dict, Tuple

import wrapt


class _ModuleByName:
    """Pickles as ``importlib.import_module(name)``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Tuple[Any, ...]:
        return importlib.import_module, (self.name,)


class _BoundShimWrapper(wrapt.BoundFunctionWrapper):
    """A shim wrapper looked up on an instance or a class (``bn._apply``, ``SyncBatchNorm.apply``),
    copied and pickled as the method it stands for: ``getattr(holder, name)``, where ``holder`` is
    what it was looked up on (a method's instance or class, or the class of a function looked up
    on one), so it unpickles to whatever is installed there then.
    """

    def _holder(self) -> Any:
        holder = getattr(self.__wrapped__, "__self__", None)
        return self._self_owner if holder is None else holder

    def __copy__(self) -> "_BoundShimWrapper":
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        # As a bound method's: the same method of a deep copy of its instance (a class is its own).
        return getattr(copy.deepcopy(self._holder(), memo), self.__name__)

    def __reduce_ex__(self, protocol: int) -> Any:
        return getattr, (self._holder(), self.__name__)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)


class ShimWrapper(wrapt.FunctionWrapper):
    """wrapt's function wrapper, copied and pickled like the plain function it replaces.

    A copy is the object itself; a pickle refers to where the function lives
    (``torch.nn.functional.batch_norm``), so it unpickles to whatever is installed there then.
    The class attribute marks amp_bn_fix's wrappers across ``importlib.reload`` of this module.
    """

    _amp_bn_fix_wrapper = True
    __bound_function_wrapper__ = _BoundShimWrapper

    def __init__(self, wrapped: Any, wrapper: Any, module_attribute: bool = False) -> None:
        if not module_attribute or not inspect.isfunction(wrapped):
            super().__init__(wrapped, wrapper)
            return
        # wrapt binds a plain function as "function", and then every call looks up ``__self__`` on
        # it (an AttributeError raised and cleared: half of the wrapper's cost). A module's function
        # is never bound to an instance, so it is given the "staticmethod" binding, whose calls go
        # straight to the wrapper.
        # wrapt has no public spelling for it: its base class's keyword, pinned by a test.
        super(wrapt.FunctionWrapper, self).__init__(wrapped, None, wrapper, binding="staticmethod")

    def __copy__(self) -> "ShimWrapper":
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShimWrapper":
        return self

    def __reduce_ex__(self, protocol: int) -> Any:
        module, name = self.__module__, self.__qualname__
        if _lookup(module, name) is self:
            return name  # pickled as a global, exactly like the original function
        # A reference kept after disable(): the same reference, spelled with the standard library.
        return operator.attrgetter(name), (_ModuleByName(module),)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)


def _lookup(module: str, name: str) -> Any:
    try:
        return operator.attrgetter(name)(importlib.import_module(module))
    except (ImportError, AttributeError):
        return None


def is_shim_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is an amp_bn_fix wrapper, from this incarnation of the module or an earlier one."""
    return getattr(type(obj), "_amp_bn_fix_wrapper", False) is True
