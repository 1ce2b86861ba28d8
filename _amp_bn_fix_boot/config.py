"""``amp_bn_fix/_config.py`` loaded on its own, without running the ``amp_bn_fix`` package.

The package's ``__init__`` imports torch and enables the shim; the settings parser does neither, so
the start-up hook and the launcher load that one file by location and validate the environment with
the very code the package uses.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

_NAME = __name__.rpartition(".")[0] + "._config"


def load() -> ModuleType:
    """The settings module (``from_env``, ``hook_requested``, ``POLICIES``, ...), loaded once."""
    module = sys.modules.get(_NAME)
    if module is not None:
        return module
    package = importlib.util.find_spec("amp_bn_fix")  # locates the package without importing it
    if package is None or not package.submodule_search_locations:
        raise ImportError("amp_bn_fix is not installed for this interpreter")
    location = os.path.join(list(package.submodule_search_locations)[0], "_config.py")
    spec = importlib.util.spec_from_file_location(_NAME, location)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses looks the defining module up in sys.modules.
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module
